"""The batched decode step captured in CUDA graphs, one per batch-size bucket, replayed each step.

A decode step of a small model is mostly kernel-launch overhead on a GPU: capturing it once
(`torch.cuda.CUDAGraph`) and replaying it launches every kernel in one go. A graph has fixed
shapes, so it runs `Transformer.decode_fixed` (keys over the whole cache capacity, masked by
each row's length) on static input buffers; a batch of B rows runs in the smallest bucket
>= B, its extra rows padded (they write position 0 of cache rows that are free, which the
next prefill of those rows overwrites). Batches larger than every bucket run eagerly.

All buckets are captured when the decoder is built, while the cache is empty (capturing
writes into the cache). Without CUDA (`capture=False`), the same padded path runs eagerly,
which is how the CPU tests check it.
"""

from __future__ import annotations

import torch

from .kv_cache import ContextLengthError, KVCache

BUCKETS = (1, 2, 4, 8, 16, 32)


class GraphedDecoder:
    def __init__(self, model, cache: KVCache, buckets: tuple[int, ...] = BUCKETS, *, capture: bool | None = None):
        device = model.tok_emb.weight.device
        self.model, self.cache = model, cache
        self.capture = device.type == "cuda" if capture is None else capture
        fitting = {b for b in buckets if b <= cache.n_rows}
        if cache.n_rows < max(buckets):
            fitting.add(cache.n_rows)  # e.g. 3 rows: buckets 1, 2, 3
        self.buckets = sorted(fitting)
        top = max(self.buckets)
        self.ids = torch.zeros(top, 1, dtype=torch.long, device=device)  # static inputs
        self.lengths = torch.zeros(top, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if self.capture:
            for b in self.buckets:
                self.graphs[b] = self._capture(b)
            cache.reset()

    @torch.inference_mode()
    def _capture(self, b: int):
        ids, lengths = self.ids[:b], self.lengths[:b]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the graph (allocations, autotuning)
            for _ in range(2):
                self.model.decode_fixed(ids, self.cache, lengths)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.model.decode_fixed(ids, self.cache, lengths)
        return graph, out

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def run(self, ids: torch.Tensor) -> torch.Tensor:
        """Decode one token for cache rows 0 .. B-1 (ids (B, 1)); advances their lengths; (B, 1, V) logits."""
        B = ids.shape[0]
        starts = self.cache.lengths[:B]
        if int(starts.max()) + 1 > self.cache.capacity:
            raise ContextLengthError(
                f"sequence of {int(starts.max()) + 1} tokens exceeds the context length {self.cache.capacity}")
        b = self.bucket(B)
        if b is None:  # larger than every bucket: the same step, eagerly
            logits = self.model.decode_fixed(ids, self.cache, starts.to(ids.device))
        else:
            self.ids[:B].copy_(ids)
            self.ids[B:b].zero_()
            self.lengths[:B].copy_(starts)
            self.lengths[B:b].zero_()
            if b in self.graphs:
                graph, out = self.graphs[b]
                graph.replay()
            else:
                out = self.model.decode_fixed(self.ids[:b], self.cache, self.lengths[:b])
            logits = out[:B]
        self.cache.lengths[:B] += 1
        return logits

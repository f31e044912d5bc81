"""The batched decode step captured in CUDA graphs, one per batch-size bucket, replayed each step.

A decode step of a small model is mostly kernel-launch and host overhead on a GPU: capturing
it once (`torch.cuda.CUDAGraph`) and replaying it launches every kernel in one go. A graph has
fixed shapes, so it runs `Transformer.decode_fixed` (keys over the whole cache capacity, masked
by each row's length) on static input buffers; a batch of B rows runs in the smallest bucket
>= B, its extra rows padded (they write position 0 of cache rows that are free, which the next
prefill of those rows overwrites). Batches larger than every bucket run eagerly.

The graph also holds the greedy choice: each row's argmax and its log-probability (logit -
logsumexp), so a step in which every row is greedy without alternatives costs the host one
copy in (token ids and lengths, from pinned memory) and one copy out ((B, 2) numbers); other
steps sample from the logits (`sample_rows`). Each bucket is captured twice: plain, and with
the attention probabilities of every layer ((B, H, 1, P), the explicit softmax), replayed
when a row streams its attention, so one such client keeps the batch on a graph.

The host's part of a step (the rows' lengths, the staged inputs) is done on numpy views of
the same memory, not with torch calls: every torch call lets go of the GIL, and on a busy
server each hand-over can wait for the event loop's whole turn (bench/README.md). A step
lets go three times: the copy in, the replay and the copy out, which waits for the device.

All buckets are captured when the decoder is built, while the cache is empty (capturing
writes into the cache). Without CUDA (`capture=False`), the same padded path runs eagerly,
which is how the CPU tests check it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from attnlens.model.config import ContextLengthError
from attnlens.model.kv_cache import KVCache
from attnlens.model.parts import fixed_shapes
from attnlens.model.sampling import GeneratedToken, sample_rows

BUCKETS = (1, 2, 4, 8, 16, 32)


class StepResult(NamedTuple):
    logits: torch.Tensor  # (B, 1, V)
    greedy: torch.Tensor  # (B, 2) float64: each row's argmax id and its log-probability
    attentions: list[torch.Tensor] | None  # with attention: per layer (B, H, 1, P)


def fixed_step(model, ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache,
               attention: bool = False) -> StepResult:
    """decode_fixed, then each row's greedy token and its log-probability, all on the device."""
    logits, attentions = model.decode_fixed(ids, cache, lengths, return_attention=attention)  # (B, 1, V)
    last = logits[:, -1].float()  # (B, V)
    best, arg = last.max(dim=-1)
    logprob = best - torch.logsumexp(last, dim=-1)
    return StepResult(logits, torch.stack([arg.double(), logprob.double()], dim=1), attentions)


class GraphedDecoder:
    def __init__(self, model, cache: KVCache, buckets: tuple[int, ...] = BUCKETS, *, capture: bool | None = None):
        device = model.device
        self.model, self.cache = model, cache
        self.capture = device.type == "cuda" if capture is None else capture
        fitting = {b for b in buckets if b <= cache.n_rows}
        if cache.n_rows < max(buckets):
            fitting.add(cache.n_rows)  # e.g. 3 rows: buckets 1, 2, 3
        self.buckets = sorted(fitting)
        top = max(self.buckets)
        # static inputs, (top, 2): per row its token id and its length (filled positions), copied
        # in one go from a pinned host buffer of the same layout
        self.inputs = torch.zeros(top, 2, dtype=torch.long, device=device)
        self.staging = torch.zeros(top, 2, dtype=torch.long, pin_memory=self.capture)
        self._staging = self.staging.numpy()  # the same pinned memory, written without torch calls
        self._lengths = cache.lengths.numpy()  # the cache's (R,) lengths, the same memory (never reallocated)
        # (bucket, with attention) -> the captured graph and its static outputs
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, StepResult]] = {}
        if self.capture:
            pool = torch.cuda.graph_pool_handle()  # the variants share one memory pool
            for b in self.buckets:
                for attention in (False, True):
                    self.graphs[b, attention] = self._capture(b, attention, pool)
            cache.reset()

    def _static(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[:b, 0:1], self.inputs[:b, 1]  # ids (b, 1), lengths (b,): views

    @torch.inference_mode()
    def _capture(self, b: int, attention: bool, pool):
        ids, lengths = self._static(b)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with fixed_shapes():  # every attention backend, cuDNN's included: its plan is built here, once
            with torch.cuda.stream(side):  # warm up outside the graph (allocations, autotuning)
                for _ in range(2):
                    fixed_step(self.model, ids, lengths, self.cache, attention)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = fixed_step(self.model, ids, lengths, self.cache, attention)
        return graph, out

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def run(self, ids: torch.Tensor, attention: bool = False) -> StepResult:
        """Decode one token for cache rows 0 .. B-1 (ids (B, 1), on the host or the device);
        advances their lengths; (B, 1, V) logits, each row's greedy choice and, with
        `attention`, every layer's (B, H, 1, P) probabilities."""
        B = ids.shape[0]
        longest = int(self._lengths[:B].max())
        if longest + 1 > self.cache.capacity:
            raise ContextLengthError(
                f"sequence of {longest + 1} tokens exceeds the context length {self.cache.capacity}")
        b = self.bucket(B)
        if b is None:  # larger than every bucket: the same step, eagerly
            device = self.inputs.device
            out = fixed_step(self.model, ids.to(device), self.cache.lengths[:B].to(device), self.cache, attention)
        else:
            if ids.device.type == "cpu":
                staging = self._staging
                staging[:B, 0] = ids.numpy()[:, 0]
                staging[:B, 1] = self._lengths[:B]
                if b > B:  # padding rows: token 0 at position 0
                    staging[B:b] = 0
                self.inputs[:b].copy_(self.staging[:b], non_blocking=True)  # one copy in
            else:
                self.inputs[:B, 0] = ids[:, 0]
                self.inputs[:B, 1] = self.cache.lengths[:B].to(ids.device)
                if b > B:
                    self.inputs[B:b] = 0
            if (b, attention) in self.graphs:
                graph, out = self.graphs[b, attention]
                graph.replay()
            else:
                out = fixed_step(self.model, *self._static(b), self.cache, attention)
            out = StepResult(out.logits[:B], out.greedy[:B],
                             None if out.attentions is None else [a[:B] for a in out.attentions])
        self._lengths[:B] += 1
        return out

    def decode(self, ids: torch.Tensor, samplers: list, while_running=None) -> tuple[StepResult, list]:
        """One decode step and each row's next token: the step's outputs (attention included
        when a row asks for it), GeneratedToken per row. When every row is greedy and asks for
        no alternatives, the tokens come from the graph's own argmax (one small copy back);
        otherwise `sample_rows` picks them from the logits. `while_running()` is called after
        the replay is launched, before anything is read back."""
        out = self.run(ids, attention=any(s.return_attention for s in samplers))
        if while_running is not None:
            while_running()
        if all(s.params.temperature == 0 and s.n_logprobs == 0 and not s.adjusts_logits for s in samplers):
            return out, [GeneratedToken(id=int(t), logprob=lp) for t, lp in out.greedy.tolist()]
        return out, sample_rows(out.logits[:, -1], samplers)

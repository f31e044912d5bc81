"""The engine core's scheduling policy (vLLM v1's Scheduler): which generations hold a cache row
and in what order, which waiting prompts are prefilled together in a step, whether a long prompt
goes in pieces and how large each piece is, all within the KV budget. It decides and keeps the
lists; the core (core.py) runs the forwards, samples, and moves the cache rows it is told of.

    waiting    generations with a slot and no row yet, oldest first
    decoding   generation i owns cache row i (the core keeps the rows 0 .. n-1 packed)
    chunking   the long prompt being prefilled a piece a step, into row len(decoding)
"""

from __future__ import annotations

import collections

from attnlens.app.engine.request import Generation
from attnlens.model.kv_cache import BlockCache, RowCache


class Scheduler:
    def __init__(self, cache: RowCache | None, context_length: int, *, kv_budget: int | None,
                 prefill_chunk: int, prefill_chunk_alone: int | None):
        # read for its accounting: the positions a row holds, and, in blocks, the bytes rows take
        self.capacity = cache.capacity if cache is not None else 0
        self.blocks = cache if isinstance(cache, BlockCache) else None
        self.context_length = context_length
        self.kv_budget = kv_budget
        # A long prompt is prefilled `prefill_chunk` tokens a step into the row after the decoding
        # ones, so the streams decoding beside it keep getting tokens between its pieces and the
        # watchdog sees progress; `prefill_chunk_alone` tokens a step while no other generation
        # decodes or waits: fewer, larger products (a product's weights are packed for BLAS once per
        # call; SmolLM2's 2,048-token prompt, 2 threads: 4.6-4.8 s in 256-token pieces, 4.0-4.3 s in
        # one, bench/README.md)
        self.prefill_chunk = prefill_chunk
        self.prefill_chunk_alone = max(prefill_chunk, prefill_chunk_alone or prefill_chunk)
        self.waiting: collections.deque[Generation] = collections.deque()
        self.decoding: list[Generation] = []
        self.chunking: Generation | None = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.decoding or self.chunking is not None)

    def running(self) -> list[Generation]:
        """The generations holding a row: the decoding ones, then the long prompt in pieces."""
        return self.decoding + ([self.chunking] if self.chunking is not None else [])

    def reserved(self, g: Generation) -> int:
        """Positions g may come to hold: its prompt and every token it may generate."""
        return min(self.capacity, len(g.params.prompt_ids) + g.params.max_new_tokens)

    def fits(self, batch: list[Generation]) -> bool:
        """Whether the running generations and the prompts of `batch` (prefilled together) fit the KV
        budget, each at the most it may come to hold (its prompt and every token it may generate, in
        whole blocks): admitted work never runs out of blocks. One generation alone always does (the
        pool holds a whole context)."""
        running = self.running()
        if self.blocks is None or self.kv_budget is None or len(running) + len(batch) == 1:
            return True
        # prompts prefilled together are right-padded to the longest: each holds that much until the
        # forward ends (the padding's blocks go back then)
        padded = max(len(g.params.prompt_ids) for g in batch) if len(batch) > 1 else 0
        lengths = [self.reserved(g) for g in running] + [max(self.reserved(g), padded) for g in batch]
        return self.blocks.bytes_for_lengths(lengths) <= self.kv_budget

    def chunked(self, g: Generation) -> bool:
        """Whether g's prompt is prefilled in pieces: longer than one piece, and nothing that needs
        the whole prompt in one forward (prompt scores; a mean ablation's mean over the prompt)."""
        p = g.params
        return len(p.prompt_ids) > self.prefill_chunk and p.prompt_logprobs is None and not p.ablate

    def next_prefills(self) -> list[Generation]:
        """The prompts to prefill in this step, taken from `waiting`: the oldest one, plus more while
        the padded batch holds no more tokens than one full-context prompt (so the running streams
        never wait longer than one long prefill). A prompt to score (echo) goes alone. None while the
        oldest does not fit the KV budget beside the running ones (it waits for some of them to
        finish), or is a long prompt while another is prefilled in pieces. Short prompts are
        prefilled while a long one goes in pieces."""
        if not self.waiting:
            return []
        if not self.fits([self.waiting[0]]) or (self.chunking is not None and self.chunked(self.waiting[0])):
            return []  # it waits for room, or for the long prompt in pieces to finish (one at a time)
        batch = [self.waiting.popleft()]
        if batch[0].params.prompt_logprobs is not None or self.chunked(batch[0]):
            return batch
        longest = len(batch[0].params.prompt_ids)
        while self.waiting and self.waiting[0].params.prompt_logprobs is None:
            n = len(self.waiting[0].params.prompt_ids)
            if (len(batch) + 1) * max(longest, n) > self.context_length or self.chunked(self.waiting[0]) \
                    or not self.fits(batch + [self.waiting[0]]):
                break
            batch.append(self.waiting.popleft())
            longest = max(longest, n)
        return batch

    def piece_size(self, others_waiting: bool) -> int:
        """Tokens of the long prompt's next piece: larger while nothing else decodes or waits."""
        alone = not (self.decoding or self.waiting or others_waiting)
        return self.prefill_chunk_alone if alone else self.prefill_chunk

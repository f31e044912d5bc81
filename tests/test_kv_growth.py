"""A KV cache that holds only what the tokens in flight need (model/kv_cache.py, grow=True) and an
engine that keeps it within its byte budget (app/engine/core.py): the same logits as a full
recompute while it grows, the same tokens as each request alone, prompts that wait while the
cache is full, and memory given back when the work ends."""

from __future__ import annotations

import asyncio

import pytest
import torch

from attnlens.app.engine import Engine, GenerationParams
from attnlens.app.engine.outputs import DoneEvent, TokenEvent
from attnlens.model import SamplingParams
from helpers import reference_tokens, run_async

PROMPTS = ["To be", "Whether 'tis nobler in the mind", "The slings", "Or to take arms against a sea",
           "And by opposing", "No more; and by a sleep to say we end", "Café", "東京 and emoji"]


def test_a_growing_cache_gives_a_full_recomputes_logits_for_rows_of_different_lengths(ckpt):
    model = ckpt.model
    torch.manual_seed(0)
    V = ckpt.config.vocab_size
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (5, 17, 30)]
    cache = model.new_kv_cache(4, grow=True)
    cache.block = 16
    assert cache.allocated == (0, 0)
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        for i, p in enumerate(prompts):  # prefilled one by one into rows 0, 1, 2
            model(torch.tensor([p]), kv_cache=cache, rows=slice(i, i + 1))
        assert cache.allocated == (3, 32)  # the longest row, 30, in blocks of 16
        for step in range(20):  # decoded together: rows at 5.., 17.., 30.. grow past 32 and 48
            nxt = torch.randint(0, V, (3, 1))
            out = model(nxt, kv_cache=cache, rows=slice(0, 3)).logits[:, -1]
            for r in range(3):
                seqs[r].append(int(nxt[r, 0]))
                full = model(torch.tensor([seqs[r]])).logits[0, -1]
                torch.testing.assert_close(out[r], full, atol=1e-4, rtol=0)
    assert cache.allocated == (3, 64) and cache.lengths[:3].tolist() == [25, 37, 50]
    held = cache.bytes_held
    cache.move(2, 0)  # row 0 finished: the last row takes its place
    cache.free(2)
    cache.trim(2)  # 2 rows of 50 positions still need 2 x 64: not half of 3 x 64, kept
    assert cache.allocated == (3, 64) and cache.bytes_held == held
    cache.move(1, 0)
    cache.free(1)  # only the 37-position row is left: 1 x 48 is under half of 3 x 64
    cache.lengths[0] = 37
    cache.trim(1)
    assert cache.allocated == (1, 48)
    seqs = [seqs[1]]
    with torch.no_grad():  # what the kept row holds survived the move and the trim
        nxt = torch.randint(0, V, (1, 1))
        out = model(nxt, kv_cache=cache, rows=slice(0, 1)).logits[0, -1]
    full = model(torch.tensor([seqs[0] + [int(nxt[0, 0])]])).logits[0, -1]
    torch.testing.assert_close(out, full, atol=1e-4, rtol=0)
    cache.free(0)
    cache.trim(0)
    assert cache.allocated == (0, 0) and cache.bytes_held == 0


def sampling(i: int) -> dict:
    return dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, seed=7 + i, top_k=20)


async def _collect(generation, live: list[int], engine: Engine):
    tokens, last = [], None
    async for event in generation.events():
        live.append(engine.cache.allocated[0])
        if isinstance(event, TokenEvent):
            tokens.append(event.id)
        else:
            last = event
    return tokens, last


@pytest.mark.parametrize("rows_in_budget", [8, 2], ids=["all-fit", "two-fit"])
def test_the_engine_keeps_the_growing_cache_in_its_budget(ckpt, rows_in_budget):
    """Eight requests of up to 24 new tokens: with a budget for eight whole reservations they decode
    together; with one for two, the others wait their turn. Each request's tokens are what it
    generates alone; the cache never holds more rows than the budget admits and is empty after."""
    tok = ckpt.tokenizer
    n_new = 24
    params = [GenerationParams(tok.encode(p), n_new, SamplingParams(**sampling(i))) for i, p in enumerate(PROMPTS)]
    probe = ckpt.model.new_kv_cache(1, grow=True)
    longest = max(len(p.prompt_ids) for p in params) + n_new
    budget = probe.bytes_for(rows_in_budget, longest)
    engine = Engine(ckpt, max_concurrent=8, max_queue=8, kv_cache_bytes=budget)
    assert engine.cache_grows and engine.cache_bytes == budget
    seen: list[int] = []

    async def main():
        gens = engine.submit_all(params)
        return await asyncio.gather(*(_collect(g, seen, engine) for g in gens))

    try:
        results = run_async(main())
    finally:
        engine.close()
    for i, (tokens, done) in enumerate(results):
        assert isinstance(done, DoneEvent), done
        assert tokens == [t.id for t in reference_tokens(ckpt, PROMPTS[i], n_new, **sampling(i))], i
    assert max(seen) <= rows_in_budget
    if rows_in_budget == 8:
        assert max(seen) > 2  # they did decode together
    assert engine.cache.allocated == (0, 0)

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
    assert not cache.trim(2)  # 2 rows of 50 positions still need 2 x 64: not half of 3 x 64, kept
    assert cache.allocated == (3, 64) and cache.bytes_held == held
    cache.move(1, 0)
    cache.free(1)  # only the 37-position row is left: 1 x 48 is under half of 3 x 64
    cache.lengths[0] = 37
    assert cache.trim(1)
    assert cache.allocated == (1, 48)
    seqs = [seqs[1]]
    with torch.no_grad():  # what the kept row holds survived the move and the trim
        nxt = torch.randint(0, V, (1, 1))
        out = model(nxt, kv_cache=cache, rows=slice(0, 1)).logits[0, -1]
    full = model(torch.tensor([seqs[0] + [int(nxt[0, 0])]])).logits[0, -1]
    torch.testing.assert_close(out, full, atol=1e-4, rtol=0)
    cache.free(0)
    assert cache.trim(0)
    assert cache.allocated == (0, 0) and cache.bytes_held == 0


def sampling(i: int) -> dict:
    return dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, seed=7 + i, top_k=20)


async def _collect(generation, on_event=lambda: None):
    """(token events, the last event) of a generation; on_event() runs at each event."""
    tokens, last = [], None
    async for event in generation.events():
        on_event()
        if isinstance(event, TokenEvent):
            tokens.append(event)
        else:
            last = event
    return tokens, last


def _run_all(engine, params, on_event=lambda: None) -> list:
    """Every generation of `params` submitted at once, each (token events, last event); the engine
    is closed after."""
    async def main():
        gens = engine.submit_all(params)
        return await asyncio.gather(*(_collect(g, on_event) for g in gens))

    try:
        return run_async(main())
    finally:
        engine.close()


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

    results = _run_all(engine, params, lambda: seen.append(engine.cache.allocated[0]))
    for i, (tokens, done) in enumerate(results):
        assert isinstance(done, DoneEvent), done
        assert [t.id for t in tokens] == [t.id for t in reference_tokens(ckpt, PROMPTS[i], n_new, **sampling(i))], i
    assert max(seen) <= rows_in_budget
    if rows_in_budget == 8:
        assert max(seen) > 2  # they did decode together
    assert engine.cache.allocated == (0, 0)


LONG = ["Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune",
        "Or to take arms against a sea of troubles, and by opposing end them: to die, to sleep"]


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_long_prompts_are_prefilled_in_pieces_between_decode_steps(ckpt, tiny_checkpoint, kind):
    """Prompts longer than `prefill_chunk` go in 6-token pieces, one a step, into the row after the
    decoding ones, while short generations decode and finish beside them (their rows move under
    the long one's): every request's tokens and log-probabilities are what it gives alone."""
    from attnlens.app.engine import EngineProcess

    tok = ckpt.tokenizer
    prompts = [PROMPTS[0], PROMPTS[2], LONG[0], PROMPTS[4], LONG[1], PROMPTS[6]]
    lengths = [3, 2, 12, 4, 10, 20]
    assert all(len(tok.encode(p)) > 3 * 6 for p in LONG)
    params = [GenerationParams(tok.encode(p), n, SamplingParams(**sampling(i)), n_logprobs=2)
              for i, (p, n) in enumerate(zip(prompts, lengths))]
    kw = dict(max_concurrent=8, max_queue=8, kv_cache_bytes=1 << 30, prefill_chunk=6)
    engine = Engine(ckpt, **kw) if kind == "thread" else EngineProcess(
        ckpt, model_dir=tiny_checkpoint, device="cpu", dtype="float32", **kw)
    chunked: list[int] = []
    if kind == "thread":
        engine._chunked_then = engine._run_chunk

        def spy(records):
            chunked.append(int(engine.cache.lengths[len(engine._decoding)]))
            engine._chunked_then(records)
        engine._run_chunk = spy

    results = _run_all(engine, params)
    for i, (tokens, done) in enumerate(results):
        assert isinstance(done, DoneEvent), done
        ref = reference_tokens(ckpt, prompts[i], lengths[i], n_logprobs=2, **sampling(i))
        assert [t.id for t in tokens] == [t.id for t in ref], i
        for got, want in zip(tokens, ref):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    if kind == "thread":
        # piece by piece from position 0, each prompt over 6 tokens once: a short one finishing beside it
        # moves its row down with what it holds (a lost row would start again from 0)
        assert chunked.count(0) == sum(len(p.prompt_ids) > 6 for p in params) == 3
        assert 6 in chunked and 12 in chunked
        assert engine.cache.allocated == (0, 0)


def test_a_long_prefill_alone_reports_progress_each_piece(ckpt):
    """With nothing else decoding, each piece but the last still hands something over (an empty
    step), so an engine process's watchdog sees progress through a long prefill."""
    tok = ckpt.tokenizer
    engine = Engine(ckpt, max_concurrent=2, max_queue=2, kv_cache_bytes=1 << 30, prefill_chunk=4)
    emitted: list[int] = []
    real = engine._emit
    engine._emit = lambda records: (emitted.append(len(records)), real(records))
    ids = tok.encode(LONG[0])

    async def main():
        return await _collect(engine.submit(GenerationParams(ids, 2, SamplingParams(temperature=0.0))))

    try:
        tokens, done = run_async(main())
    finally:
        engine.close()
    assert isinstance(done, DoneEvent)
    pieces = -(-len(ids) // 4)
    assert emitted[:pieces - 1] == [0] * (pieces - 1)

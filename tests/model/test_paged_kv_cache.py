"""The KV cache in blocks from one pool (model/paged_kv_cache.py) and an engine that keeps it within
its byte budget (app/engine/core.py): the same logits and attention as a full recompute, rows
moving and the pool packing without losing a key, the same tokens as each request alone, prompts
that wait while the cache is full, and memory given back when the work ends."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import reference_tokens, run_async, small_config_model

from attnlens.app.engine import Engine, GenerationParams
from attnlens.app.engine.outputs import DoneEvent, TokenEvent
from attnlens.model import SamplingParams, paged_kv_cache
from attnlens.model.native import library as native
from attnlens.model.paged_kv_cache import PagedKVCache

PROMPTS = ["To be", "Whether 'tis nobler in the mind", "The slings", "Or to take arms against a sea",
           "And by opposing", "No more; and by a sleep to say we end", "Café", "東京 and emoji"]


def _paged(model, rows: int, block: int = 16) -> PagedKVCache:
    c = model.config
    return PagedKVCache(c.n_layers, rows, c.kv_heads, c.context_length, c.d_head, block=block)


def _full(model, seq: list[int], attention: bool = False):
    out = model(torch.tensor([seq]), return_attention=attention)
    return out.logits[0, -1], (None if not attention else [a[0, :, -1] for a in out.attentions])


@pytest.fixture(params=["c-kernel", "torch"])
def step_attention(request, monkeypatch):
    """Both ways a decode step attends over the blocks: model/native/block_attention.c where it is built,
    and torch's batched products (the path without a C compiler)."""
    if request.param == "c-kernel" and not native.available()[0]:
        pytest.skip(f"C kernels: {native.available()[1]}")
    if request.param == "torch":
        monkeypatch.setattr(paged_kv_cache, "native_attention", lambda q, keys: False)
    return request.param


GQA = dict(context_length=160, d_model=48, n_heads=6, n_kv_heads=2, positional="rotary", norm_type="rmsnorm", ffn="gated",
           activation="silu", bias=False)


@pytest.mark.parametrize("overrides", [GQA, dict(context_length=160), dict(GQA, sliding_window=24),
                                       dict(GQA, qk_norm=True, head_dim=16)],
                         ids=["llama-gqa", "gpt", "mistral-window", "qwen3-qk-norm"])
def test_blocks_give_a_full_recomputes_logits_and_attention(overrides, step_attention):
    """Rows of 5, 17 and 30 tokens (a right-padded prefill) decode together across many blocks of
    16, recording attention: each step's logits and each row's attention row equal a full forward
    of that row alone. Then the first row finishes: the last moves into its place (its table, not
    its keys), the pool packs the two left from block 0, and they go on as before."""
    model = small_config_model(**overrides)
    V = model.config.vocab_size
    torch.manual_seed(1)
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (5, 17, 30)]
    cache = _paged(model, 4)
    seqs = [list(p) for p in prompts]
    T = max(map(len, prompts))
    padded = torch.tensor([p + [0] * (T - len(p)) for p in prompts])
    with torch.no_grad():
        model(padded, kv_cache=cache, rows=slice(0, 3), valid=torch.tensor([len(p) for p in prompts]))
        assert cache.lengths[:3].tolist() == [5, 17, 30]
        assert [len(t) for t in cache.tables[:3]] == [1, 2, 2]  # the padding's blocks went back
        for step in range(40):
            nxt = torch.randint(0, V, (3, 1))
            out = model(nxt, kv_cache=cache, rows=slice(0, 3), return_attention=True)
            for r in range(3):
                seqs[r].append(int(nxt[r, 0]))
                logits, rows = _full(model, seqs[r], attention=True)
                torch.testing.assert_close(out.logits[r, -1], logits, atol=1e-4, rtol=0)
                n = len(seqs[r])
                for layer, full_row in enumerate(rows):
                    got = out.attentions[layer][r, :, -1]
                    torch.testing.assert_close(got[:, :n], full_row, atol=1e-5, rtol=0)
                    assert not got[:, n:].any()  # past the row's length: nothing
        assert cache.lengths[:3].tolist() == [45, 57, 70]
        assert cache.blocks_in_use == 3 + 4 + 5
        cache.move(2, 0)  # row 0 finished: the last row takes its place
        seqs = [seqs[2], seqs[1]]
        cache.trim(2)  # row 0's blocks went back: not scattered enough to pack
        assert min(b for t in cache.tables for b in t) > 0
        cache.compact()
        assert sorted(b for t in cache.tables for b in t) == list(range(9))  # packed from block 0
        for step in range(20):
            nxt = torch.randint(0, V, (2, 1))
            out = model(nxt, kv_cache=cache, rows=slice(0, 2)).logits[:, -1]
            for r in range(2):
                seqs[r].append(int(nxt[r, 0]))
                torch.testing.assert_close(out[r], _full(model, seqs[r])[0], atol=1e-4, rtol=0)
        cache.free(1)  # one row left, one run of blocks: the step's one-row path
        cache.trim(1)
        assert cache.tables[0] == list(range(len(cache.tables[0])))
        nxt = torch.randint(0, V, (1, 1))
        out = model(nxt, kv_cache=cache, rows=slice(0, 1)).logits[0, -1]
        torch.testing.assert_close(out, _full(model, seqs[0] + [int(nxt[0, 0])])[0], atol=1e-4, rtol=0)
        # a prompt continuing a row (the next piece of a long prompt) reads the row's blocks gathered
        piece = torch.randint(0, V, (1, 20)).tolist()[0]
        out = model(torch.tensor([piece]), kv_cache=cache, rows=slice(0, 1)).logits[0, -1]
        torch.testing.assert_close(out, _full(model, seqs[0] + [int(nxt[0, 0])] + piece)[0], atol=1e-4, rtol=0)
    cache.free(0)
    assert cache.blocks_in_use == 0 and cache.bytes_held == 0


def test_a_scattered_row_and_a_full_pool(step_attention):
    """Two rows growing in turns take interleaved blocks; the step's path for blocks that are not
    one run gives the full recompute's logits. A pool with no free block refuses with a clear error."""
    from attnlens.model.paged_kv_cache import KVCacheFullError

    model = small_config_model(**GQA)
    V = model.config.vocab_size
    torch.manual_seed(2)
    cache = _paged(model, 2, block=4)
    seqs = [torch.randint(0, V, (3,)).tolist() for _ in range(2)]
    with torch.no_grad():
        for r in range(2):
            model(torch.tensor([seqs[r]]), kv_cache=cache, rows=slice(r, r + 1))
        for step in range(12):  # one row at a time: each takes the next free block in turn
            r = step % 2
            nxt = torch.randint(0, V, (1, 1))
            seqs[r].append(int(nxt[0, 0]))
            out = model(nxt, kv_cache=cache, rows=slice(r, r + 1)).logits[0, -1]
            torch.testing.assert_close(out, _full(model, seqs[r])[0], atol=1e-4, rtol=0)
        assert cache.tables[0] != list(range(cache.tables[0][0], cache.tables[0][0] + len(cache.tables[0])))
    small = PagedKVCache(1, 2, 1, 8, 4, block=4, pool_bytes=1)  # the least pool: one context, 2 blocks
    small.reserve(0, 8)
    with pytest.raises(KVCacheFullError, match="blocks are all held"):
        small.reserve(1, 1)


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
def test_the_engine_keeps_the_cache_in_its_budget(ckpt, rows_in_budget):
    """Eight requests of up to 24 new tokens: with a budget for eight whole reservations they decode
    together; with one for two, the others wait their turn. Each request's tokens are what it
    generates alone; the cache never holds more rows than the budget admits and is empty after."""
    tok = ckpt.tokenizer
    n_new = 24
    params = [GenerationParams(tok.encode(p), n_new, SamplingParams(**sampling(i))) for i, p in enumerate(PROMPTS)]
    probe = ckpt.model.new_kv_cache(1, paged=True)
    longest = max(len(p.prompt_ids) for p in params) + n_new
    budget = probe.bytes_for(rows_in_budget, longest)
    engine = Engine(ckpt, max_concurrent=8, max_queue=8, kv_cache_bytes=budget)
    assert engine.client.core.cache_paged and engine.cache_bytes == budget
    seen: list[int] = []

    results = _run_all(engine, params, lambda: seen.append(sum(1 for t in engine.client.core.cache.tables if t)))
    for i, (tokens, done) in enumerate(results):
        assert isinstance(done, DoneEvent), done
        assert [t.id for t in tokens] == [t.id for t in reference_tokens(ckpt, PROMPTS[i], n_new, **sampling(i))], i
    assert max(seen) <= rows_in_budget
    if rows_in_budget == 8:
        assert max(seen) > 2  # they did decode together
    assert engine.client.core.cache.blocks_in_use == 0


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
        engine.client.core._chunked_then = engine.client.core._run_chunk

        def spy(records):
            chunked.append(int(engine.client.core.cache.lengths[len(engine.client.core.scheduler.decoding)]))
            engine.client.core._chunked_then(records)
        engine.client.core._run_chunk = spy

    results = _run_all(engine, params)
    for i, (tokens, done) in enumerate(results):
        assert isinstance(done, DoneEvent), done
        ref = reference_tokens(ckpt, prompts[i], lengths[i], n_logprobs=2, **sampling(i))
        assert [t.id for t in tokens] == [t.id for t in ref], i
        for got, want in zip(tokens, ref):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    assert engine.cache_held == 0  # every block went back (a process reports it with its last hand-over)
    if kind == "thread":
        # piece by piece from position 0, each prompt over 6 tokens once: a short one finishing beside it
        # moves its row down with what it holds (a lost row would start again from 0)
        assert chunked.count(0) == sum(len(p.prompt_ids) > 6 for p in params) == 3
        assert 6 in chunked and 12 in chunked
        assert engine.client.core.cache.blocks_in_use == 0


def test_a_long_prefill_alone_reports_progress_each_piece(ckpt):
    """With nothing else decoding, each piece but the last still hands something over (an empty
    step), so an engine process's watchdog sees progress through a long prefill."""
    tok = ckpt.tokenizer
    engine = Engine(ckpt, max_concurrent=2, max_queue=2, kv_cache_bytes=1 << 30, prefill_chunk=4)
    emitted: list[int] = []
    real = engine.client.core.sink
    engine.client.core.sink = lambda records: (emitted.append(len(records)), real(records))
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


def test_a_long_prompt_alone_goes_in_larger_pieces_and_small_ones_beside_others(ckpt):
    """prefill_chunk_alone: while nothing else decodes or waits, a long prompt goes in pieces of that
    size; once a short generation decodes beside it, in prefill_chunk ones again. Tokens as alone."""
    tok = ckpt.tokenizer
    long_ids = tok.encode(LONG[0])
    assert len(long_ids) > 24
    engine = Engine(ckpt, max_concurrent=4, max_queue=4, kv_cache_bytes=1 << 30, prefill_chunk=3,
                    prefill_chunk_alone=8)
    core = engine.client.core
    pieces: list[tuple[int, bool]] = []  # (position before the piece, whether others decode)
    real = core._run_chunk

    def spy(records):
        pieces.append((int(core.cache.lengths[len(core.scheduler.decoding)]), bool(core.scheduler.decoding)))
        real(records)
    core._run_chunk = spy

    async def alone():
        return await _collect(engine.submit(GenerationParams(long_ids, 2, SamplingParams(temperature=0.0))))

    try:
        tokens, done = run_async(alone())
        assert [p for p, _ in pieces] == list(range(0, len(long_ids), 8))  # 8 at a time, alone
        assert [t.id for t in tokens] == [t.id for t in reference_tokens(ckpt, long_ids, 2, temperature=0.0)]
        pieces.clear()
        short = GenerationParams(tok.encode(PROMPTS[0]), 20, SamplingParams(temperature=0.0))

        async def beside():
            gens = engine.submit_all([short, GenerationParams(long_ids, 2, SamplingParams(temperature=0.0))])
            return await asyncio.gather(*(_collect(g) for g in gens))

        results = run_async(beside())
    finally:
        engine.close()
    steps = [b - a for (a, _), (b, _) in zip(pieces, pieces[1:])]
    assert pieces[0][1] and all(s == 3 for s, (_, others) in zip(steps, pieces) if others)  # small beside others
    assert [t.id for t in results[1][0]] == [t.id for t in reference_tokens(ckpt, long_ids, 2, temperature=0.0)]


def test_short_prompts_start_while_a_long_one_goes_in_pieces(ckpt):
    """A long prompt in 8-token pieces, then four short ones sent after it: the short ones are
    prefilled beside it (the long one's row moves up to make room) and finish before its first token,
    each with the tokens it gives alone, and so does the long one."""
    tok = ckpt.tokenizer
    long_ids = tok.encode(LONG[0])
    prompts = [long_ids] + [tok.encode(p) for p in PROMPTS[0:7:2]]
    assert len(long_ids) > 3 * 8 and max(len(p) for p in prompts[1:]) <= 8
    params = [GenerationParams(p, 3, SamplingParams(**sampling(i))) for i, p in enumerate(prompts)]
    engine = Engine(ckpt, max_concurrent=5, max_queue=5, kv_cache_bytes=1 << 30, prefill_chunk=8)
    order: list[int] = []

    async def main():
        gens = engine.submit_all(params)

        async def one(i, g):
            return await _collect(g, lambda: order.append(i))
        return await asyncio.gather(*(one(i, g) for i, g in enumerate(gens)))

    try:
        results = run_async(main())
    finally:
        engine.close()
    for i, (tokens, done) in enumerate(results):
        assert isinstance(done, DoneEvent), done
        assert [t.id for t in tokens] == [t.id for t in reference_tokens(ckpt, prompts[i], 3, **sampling(i))], i
    first_long = order.index(0)
    assert all(order[:first_long].count(i) == 4 for i in (1, 2, 3, 4)), order  # 3 tokens and the end each
    assert engine.client.core.cache.blocks_in_use == 0


@pytest.mark.parametrize("D", [64, 16, 80], ids=["d64-eight-keys-at-once", "d16", "d80-two-strips"])
def test_long_rows_split_over_the_threads_attend_as_one_softmax(D):
    """The C kernel splits a row's positions into parts of 512 (flash-decoding) and merges them by
    their maxima and sums: rows of 1,300, 513 and 5 positions (3, 2 and 1 parts) give the outputs
    and probabilities of one softmax over each row's keys, computed here in float64. D = 64 takes
    the eight-keys-at-once scores; 80 weighs the values in two strips of dims."""
    if not native.available()[0]:
        pytest.skip(f"C kernels: {native.available()[1]}")
    K, G = 2, 3
    cache = paged_kv_cache.PagedKVCache(1, 3, K, 2048, D, dtype=torch.float32)
    lengths = [1300, 513, 5]
    torch.manual_seed(0)
    for row, n in enumerate(lengths):
        cache.reserve(row, n)
        cache.lengths[row] = n - 1
    write = cache.begin(slice(0, 3), 3, 1)
    k, v = torch.randn(3, K, 1, D) * 3, torch.randn(3, K, 1, D)
    cache.store(write, 0, k, v)
    plane_k, plane_v = cache.keys[0], cache.values[0]
    for row, n in enumerate(lengths):  # every earlier position random too, spread wide (scores up to ~50)
        for p in range(n - 1):
            plane_k[cache.tables[row][p // 64], :, p % 64] = torch.randn(K, D) * 3
            plane_v[cache.tables[row][p // 64], :, p % 64] = torch.randn(K, D)
    q = torch.randn(3, K * G, 1, D)
    with torch.no_grad():
        out, probs = write.blocks(q, plane_k, plane_v, 0.25, True)
    keys, values = cache._gathered(plane_k, write), cache._gathered(plane_v, write)  # (B, K, S, D)
    for row, n in enumerate(lengths):
        for h in range(K * G):
            s = (q[row, h, 0].double() @ keys[row, h // G, :n].double().T) * 0.25
            p = torch.softmax(s, dim=-1)
            torch.testing.assert_close(probs[row, h, 0, :n].double(), p, atol=2e-6, rtol=1e-5)
            assert not probs[row, h, 0, n:].any()
            torch.testing.assert_close(out[row, h, 0].double(), p @ values[row, h // G, :n].double(),
                                       atol=2e-5, rtol=1e-5)


def test_every_cache_offers_the_engines_protocol_and_only_the_paged_one_its_blocks():
    from attnlens.model.families.encoder_decoder import TranslationCache
    from attnlens.model.kv_cache import BlockCache, KVCache, RowCache

    rows = KVCache(2, 3, 2, 16, 4)
    paged = PagedKVCache(2, 3, 2, 16, 4, block=4)
    translation = TranslationCache(2, 3, 2, 16, 4)
    assert all(isinstance(c, RowCache) for c in (rows, paged, translation))
    assert isinstance(paged, BlockCache) and not isinstance(rows, BlockCache)
    assert not isinstance(translation, BlockCache)


def test_the_block_table_keeps_the_books_without_a_tensor():
    """Rows take runs of blocks, give them back, move their tables, and pack into one run; the
    pool's contents are another object's (BlockPool)."""
    from attnlens.model.paged_kv_cache import BlockTable

    t = BlockTable(n_rows=3, n_blocks=8, block=4)
    t.reserve(0, 9)  # 3 blocks
    t.reserve(1, 4)
    t.reserve(2, 5)
    assert t.tables == [[0, 1, 2], [3], [4, 5]] and t.blocks_in_use == 6
    t.free(1)
    t.lengths[2] = 5
    t.move(2, 1)
    assert t.tables == [[0, 1, 2], [4, 5], []] and int(t.lengths[1]) == 5 and int(t.lengths[2]) == 0
    assert t.pack() == [0, 1, 2, 4, 5] and t.tables == [[0, 1, 2], [3, 4], []]
    assert t.pack() == []  # packed already
    assert t.take_dirty_free() == [5] and t.take_dirty_free() == []  # block 5 was written, now free

"""The service's building blocks without HTTP: stop-string hold-back, the engine's
admission, isolation between requests, cancellation, and the attention codec."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from helpers import drain, reference_ids, run_async

from attnlens.app.engine import Engine, GenerationParams, QueueFull
from attnlens.app.engine.outputs import DoneEvent, ErrorEvent
from attnlens.app.engine.textstream import TextStream
from attnlens.app.serving.attention_codec import decode, encode
from attnlens.model import SamplingParams


# --- stop strings --------------------------------------------------------------
def run_stream(tok, text: str, stops: list[str]):
    ts = TextStream(tok, stops)
    shown = []  # what a streaming client would have seen, in order
    for i, t in enumerate(tok.encode(text)):
        released = ts.push(i, t, None)
        shown.extend(r.delta for r in released)
        if ts.stopped:
            break
    else:
        shown.extend(r.delta for r in ts.finish())
    return ts, "".join(shown)


def test_stop_string_across_tokens_is_cut_and_never_shown(ckpt):
    tok = ckpt.tokenizer
    text = "To be, or not to be, that is the question"
    ts, shown = run_stream(tok, text, ["not to"])
    assert ts.stopped and ts.text == "To be, or " and shown == ts.text


def test_hold_back_releases_a_false_start(ckpt):
    tok = ckpt.tokenizer
    # " no" starts "not to" but the match fails at "t be": everything must come out
    ts, shown = run_stream(tok, "or no be", ["not to"])
    assert not ts.stopped and shown == ts.text == "or no be"


def test_held_back_tokens_are_not_released_early(ckpt):
    tok = ckpt.tokenizer
    ts = TextStream(tok, ["not to"])
    released = []
    for i, t in enumerate(tok.encode("or no")):
        released += ts.push(i, t, None)
    assert "".join(r.delta for r in released) == "or"  # " no" might begin the stop string
    assert "".join(r.delta for r in ts.finish()) == " no"


def test_stop_string_inside_a_multibyte_character_sequence(ckpt):
    tok = ckpt.tokenizer
    ts, shown = run_stream(tok, "that is 東京 the", ["京"])
    assert ts.stopped and ts.text == shown == "that is 東"


def test_released_token_texts_join_to_the_text(ckpt):
    tok = ckpt.tokenizer
    ts = TextStream(tok, ["question"])
    out = []
    for i, t in enumerate(tok.encode("that is the question: To be")):
        out += ts.push(i, t, None)
        if ts.stopped:
            break
    assert ts.text == "that is the "
    assert "".join(r.text for r in out) == ts.text


# --- attention codec -------------------------------------------------------------
@pytest.mark.parametrize("fmt,packing,tol", [("json", "full", 1e-6), ("f16", "full", 1e-3), ("f16", "tril", 1e-3),
                                             ("u8", "full", 0.5 / 255 + 1e-6), ("u8", "tril", 0.5 / 255 + 1e-6)])
def test_codec_round_trip(fmt, packing, tol):
    rng = np.random.default_rng(0)
    a = np.tril(rng.random((2, 3, 7, 7))).astype(np.float32)
    a /= a.sum(-1, keepdims=True)
    fields = encode(a, fmt, packing)
    assert fields["shape"] == [2, 3, 7, 7]
    back = decode(fields)
    assert back.shape == a.shape and np.abs(back - a).max() <= tol
    assert np.all(np.triu(back, 1) == 0)


# --- the engine ------------------------------------------------------------------
class GatedModel:
    """Delegates to the real model; every forward first waits for `gate`, and a forward
    that sees `poison` among its input ids raises."""

    def __init__(self, model, poison: int | None = None):
        self._model = model
        self.gate = threading.Event()
        self.gate.set()
        self.poison = poison

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, ids, **kw):
        assert self.gate.wait(30)
        if self.poison is not None and bool((ids == self.poison).any()):
            raise RuntimeError("poisoned input")
        return self._model(ids, **kw)


def test_engine_matches_generate_tokens_for_interleaved_requests(ckpt):
    tok = ckpt.tokenizer
    prompts = ["To be", "Whether 'tis", "The slings", "Or to take", "And by opposing", "No more"]
    params = [dict(temperature=0.0), dict(temperature=0.9, seed=1), dict(temperature=1.2, top_k=20, seed=2),
              dict(temperature=0.8, top_p=0.9, seed=3), dict(temperature=1.0, seed=4), dict(temperature=0.7, seed=5)]
    engine = Engine(ckpt, max_concurrent=3, max_queue=10)

    async def main():
        generations = [engine.submit(GenerationParams(tok.encode(p), 20, SamplingParams(**kw)))
                   for p, kw in zip(prompts, params)]
        return await asyncio.gather(*(drain(g) for g in generations))

    try:
        results = run_async(main())
    finally:
        engine.close()
    for (tokens, done), p, kw in zip(results, prompts, params):
        assert isinstance(done, DoneEvent)
        assert tokens == reference_ids(ckpt, p, 20, **kw)


def test_queue_full_error_isolation_and_cancellation(ckpt):
    tok = ckpt.tokenizer
    poison = tok.encode("question")[0]
    gated = GatedModel(ckpt.model, poison=poison)
    engine = Engine(ckpt, max_concurrent=2, max_queue=1)
    engine.client.core.model = gated
    gated.gate.clear()  # nothing progresses until we say so

    async def main():
        ids = tok.encode("To be")
        good = engine.submit(GenerationParams(ids, 15, SamplingParams(temperature=0.0)))
        bad = engine.submit(GenerationParams(tok.encode("the question"), 15, SamplingParams(temperature=0.0)))
        waiting = engine.submit(GenerationParams(ids, 50, SamplingParams(temperature=0.0)))
        with pytest.raises(QueueFull) as e:
            engine.submit(GenerationParams(ids, 5))
        assert e.value.retry_after >= 1
        waiting.cancel()  # gives up while still waiting: frees its place
        gated.gate.set()
        good_tokens, good_done = await asyncio.wait_for(drain(good), 30)
        _, bad_done = await asyncio.wait_for(drain(bad), 30)
        return good_tokens, good_done, bad_done

    try:
        good_tokens, good_done, bad_done = run_async(main())
        assert isinstance(bad_done, ErrorEvent) and "poisoned" not in bad_done.message  # details stay in the log
        assert isinstance(good_done, DoneEvent)
        assert good_tokens == reference_ids(ckpt, "To be", 15, temperature=0.0)
        assert engine.alive and engine.errors == 1

        async def after():
            # slots and the queue place of the cancelled request are all free again
            generations = [engine.submit(GenerationParams(tok.encode("No more"), 3, SamplingParams(temperature=0.0)))
                       for _ in range(3)]
            return await asyncio.gather(*(drain(g) for g in generations))

        assert all(isinstance(done, DoneEvent) for _, done in run_async(after()))
        assert engine.in_flight == 0 and engine.waiting == 0
    finally:
        gated.gate.set()
        engine.close()


class CountingModel(GatedModel):
    def __init__(self, model):
        super().__init__(model)
        self.calls = 0

    def __call__(self, ids, **kw):
        self.calls += 1
        return super().__call__(ids, **kw)


def test_cancelled_generation_stops_within_a_step(ckpt):
    tok = ckpt.tokenizer
    engine = Engine(ckpt, max_concurrent=1, max_queue=0)
    counting = engine.client.core.model = CountingModel(ckpt.model)

    async def main():
        generation = engine.submit(GenerationParams(tok.encode("To be"), 60, SamplingParams(temperature=0.0)))
        async for ev in generation.events():
            if ev.index == 2:
                generation.cancel()
                calls_at_cancel = counting.calls
                break
        for _ in range(300):
            if engine.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        return calls_at_cancel

    try:
        calls_at_cancel = run_async(main())
        assert engine.in_flight == 0
        assert counting.calls <= calls_at_cancel + 1  # at most the step already under way
    finally:
        engine.close()


def test_dangling_partial_character_is_reported_once(ckpt):
    tok = ckpt.tokenizer
    ids = tok.encode("東")
    assert len(ids) > 1  # byte-level pieces of one character
    ts = TextStream(tok, [])
    deltas = [r.delta for i, t in enumerate(ids[:-1]) for r in ts.push(i, t, None)]
    assert deltas and all(d == "" for d in deltas)
    assert ts.finish() == []
    assert ts.text == "\ufffd" and "".join(deltas) + ts.unsent == ts.text

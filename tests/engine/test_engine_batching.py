"""The batched engine: one forward per step for every running generation, checked against
each request run alone (model.generate_tokens), plus admission, cancellation, failures,
Retry-After and the /attention bound, in-process (no server)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, ClassVar

import httpx
import numpy as np
import pytest
import torch
from helpers import DEVICES, drain, reference_ids, reference_tokens, run_async

from attnlens.app.engine import Engine, EngineProcess, GenerationCancelled, GenerationParams, QueueFull, RequestTooLarge
from attnlens.app.engine.front import Admission, DrainRate
from attnlens.app.engine.outputs import DoneEvent, ErrorEvent, TokenEvent
from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.model import SamplingParams, load_checkpoint
from attnlens.model.analysis.operations import OPERATIONS


@pytest.fixture(scope="module", params=DEVICES)
def ckpt(request, tiny_checkpoint):
    """The tiny checkpoint in float32 on the CPU and, where there is one, on a CUDA device (the
    engine then replays its decode steps from CUDA graphs, checked against the eager reference)."""
    return load_checkpoint(tiny_checkpoint, device=request.param)

PROMPTS = ["To be", "Whether 'tis nobler in the mind", "The slings", "Or to take arms against a sea",
           "And by opposing", "No more; and by a sleep to say we end", "Café", "東京 and emoji",
           "To die—to sleep", "Or", "question", "That is the question: whether", "sea of troubles",
           "naïve résumé", "outrageous fortune,", "The"]


def make_engine(kind: str, ckpt, tiny_checkpoint, **kw):
    """The engine core on a thread here, or in a process of its own (the server's default)
    loading the same checkpoint onto the same device in float32."""
    if kind == "thread":
        return Engine(ckpt, **kw)
    return EngineProcess(ckpt, model_dir=tiny_checkpoint, device=str(ckpt.model.tok_emb.weight.device),
                         dtype="float32", **kw)


ENGINE_KINDS = pytest.mark.parametrize("kind", ["thread", "process"])


def sampling(i: int) -> dict:
    """Greedy for every third request, else seeded sampling with top-k / top-p variations."""
    if i % 3 == 0:
        return dict(temperature=0.0)
    return dict(temperature=0.7 + 0.1 * (i % 5), seed=100 + i, top_k=20 if i % 2 else None,
                top_p=0.9 if i % 4 == 1 else 1.0)


def run(engine: Engine, params: list[GenerationParams]):
    async def main():
        generations = engine.submit_all(params)
        return await asyncio.gather(*(collect_tokens(g) for g in generations))

    return run_async(main())


async def collect_tokens(generation):
    tokens, last = [], None
    async for event in generation.events():
        if isinstance(event, TokenEvent):
            tokens.append(event)
        else:
            last = event
    return tokens, last


@ENGINE_KINDS
@pytest.mark.parametrize("overlap", [False, True], ids=["records-after-the-step", "records-while-the-next-step-runs"])
def test_sixteen_together_equal_each_alone_tokens_and_logprobs(ckpt, tiny_checkpoint, kind, overlap):
    """Determinism: fp32 on the CPU, a seeded or greedy request gives the same tokens (and
    log-probabilities within 1e-4) whether it runs alone or in a batch of 16; the same with the
    step's records handed over while the next step runs (the default on CUDA), and with the
    engine in a process of its own."""
    tok = ckpt.tokenizer
    engine = make_engine(kind, ckpt, tiny_checkpoint, max_concurrent=16, max_queue=0, overlap_outputs=overlap)
    params = [GenerationParams(tok.encode(p), 24, SamplingParams(**sampling(i)), n_logprobs=2)
              for i, p in enumerate(PROMPTS)]
    try:
        results = run(engine, params)
    finally:
        engine.close()
    for i, (tokens, done) in enumerate(results):
        assert isinstance(done, DoneEvent)
        ref = reference_tokens(ckpt, PROMPTS[i], 24, n_logprobs=2, **sampling(i))
        assert [t.id for t in tokens] == [t.id for t in ref], f"request {i} differs in the batch"
        for got, want in zip(tokens, ref):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [a.logprob for a in got.top_logprobs] == pytest.approx(want.top_logprobs, abs=1e-4)


@ENGINE_KINDS
def test_rows_of_different_lengths_joining_and_leaving_mid_batch(ckpt, tiny_checkpoint, kind):
    """Four slots, ten requests of different prompt lengths and budgets: requests finish at
    different steps and waiting ones take their rows mid-batch; later ones join while others run."""
    tok = ckpt.tokenizer
    engine = make_engine(kind, ckpt, tiny_checkpoint, max_concurrent=4, max_queue=20)
    budgets = [3, 17, 9, 30, 5, 12, 25, 1, 8, 20]

    async def main():
        first = engine.submit_all([GenerationParams(tok.encode(PROMPTS[i]), budgets[i],
                                                    SamplingParams(**sampling(i))) for i in range(6)])
        tasks = [asyncio.create_task(collect_tokens(g)) for g in first]
        await asyncio.sleep(0.01)  # the first ones are decoding when the rest arrive
        rest = engine.submit_all([GenerationParams(tok.encode(PROMPTS[i]), budgets[i],
                                                   SamplingParams(**sampling(i))) for i in range(6, 10)])
        tasks += [asyncio.create_task(collect_tokens(g)) for g in rest]
        return await asyncio.gather(*tasks)

    try:
        results = run_fn(main)
    finally:
        engine.close()
    for i, (tokens, done) in enumerate(results):
        assert isinstance(done, DoneEvent)
        assert [t.id for t in tokens] == reference_ids(ckpt, PROMPTS[i], budgets[i], **sampling(i)), i
    assert engine.in_flight == 0 and engine.waiting == 0
    if kind == "thread":
        assert engine.client.core.cache.lengths.tolist() == [0] * 4


def run_fn(fn):
    return run_async(fn())


class RecordingModel:
    """Delegates to the real model; records (batch, new tokens) of every forward, can be
    slowed down, held at a gate, or made to fail when its input holds `poison`."""

    def __init__(self, model, *, poison: int | None = None, delay: float = 0.0):
        self._model = model
        self.calls: list[tuple[int, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.poison = poison
        self.delay = delay

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, ids, **kw):
        assert self.gate.wait(30)
        self.calls.append(tuple(ids.shape))
        if self.delay:
            time.sleep(self.delay)
        if self.poison is not None and ids.shape[1] == 1 and bool((ids == self.poison).any()):
            raise RuntimeError("poisoned input")
        return self._model(ids, **kw)

    def analyse(self, ids, target_ids=None):  # an /attention call: held at the gate too
        assert self.gate.wait(30)
        self.calls.append((1, len(ids)))
        return self._model.analyse(ids, target_ids)

    def run_sequence(self, tokens):  # the forward of an /attention call (model/analysis/attention_maps.py): likewise
        assert self.gate.wait(30)
        self.calls.append((1, len(tokens["tokens"])))
        return self._model.run_sequence(tokens)


def test_one_forward_per_step_and_prefills_never_longer_than_one_full_prompt(ckpt):
    """Eight requests at once: three long prompts (each alone, a decode step between them)
    and five short ones (prefilled together in one right-padded forward)."""
    tok = ckpt.tokenizer
    ctx = ckpt.config.context_length
    engine = Engine(ckpt, max_concurrent=8, max_queue=0, cuda_graphs=False)  # the recorder sees every forward
    rec = engine.client.core.model = RecordingModel(ckpt.model)
    long_ids = (tok.encode(" ".join(PROMPTS)) * 4)[:40]
    prompts = [long_ids, tok.encode("To be"), long_ids[:38], tok.encode("Or"), tok.encode("The slings"),
               long_ids[:36], tok.encode("No more"), tok.encode("Café")]
    params = [GenerationParams(ids, 10, SamplingParams(temperature=0.0)) for ids in prompts]
    try:
        results = run(engine, params)
    finally:
        engine.close()
    for (tokens, done), ids in zip(results, prompts):
        assert isinstance(done, DoneEvent) and [t.id for t in tokens] == reference_ids(ckpt, ids, 10, temperature=0.0)
    prefills = [(i, b, t) for i, (b, t) in enumerate(rec.calls) if t > 1]
    decodes = [b for b, t in rec.calls if t == 1]
    assert all(b == 1 or b * t <= ctx for _, b, t in prefills)  # a batch of prompts costs at most one full one
    assert len(prefills) < len(prompts)  # the short ones went together
    assert sum(b for _, b, _ in prefills) == len(prompts)
    # a decode step follows every prefill but the last: running streams wait one prefill at most
    assert all(j - i > 1 for (i, _, _), (j, _, _) in zip(prefills, prefills[1:]))
    assert max(decodes) == 8 and len(decodes) < 20  # 8 x 10 tokens in one batch, not 80 forwards


def test_cancellation_frees_the_row_for_the_next_request(ckpt):
    tok = ckpt.tokenizer
    engine = Engine(ckpt, max_concurrent=2, max_queue=4)
    engine.client.core.model = RecordingModel(ckpt.model, delay=0.002)

    async def main():
        long_a, long_b = engine.submit_all([
            GenerationParams(tok.encode("To be"), 60, SamplingParams(temperature=0.0)),
            GenerationParams(tok.encode("The slings"), 40, SamplingParams(temperature=0.9, seed=3))])
        b_task = asyncio.create_task(collect_tokens(long_b))
        async for ev in long_a.events():
            if ev.index == 3:
                long_a.cancel()
                break
        late = engine.submit(GenerationParams(tok.encode("No more"), 12, SamplingParams(temperature=1.0, seed=9)))
        return await collect_tokens(late), await b_task

    try:
        (late_tokens, late_done), (b_tokens, b_done) = run_fn(main)
    finally:
        engine.close()
    assert engine.cancelled == 1 and engine.in_flight == 0
    assert isinstance(late_done, DoneEvent) and isinstance(b_done, DoneEvent)
    # the reused row holds nothing of the cancelled request; the other stream went on unharmed
    assert [t.id for t in late_tokens] == reference_ids(ckpt, "No more", 12, temperature=1.0, seed=9)
    assert [t.id for t in b_tokens] == reference_ids(ckpt, "The slings", 40, temperature=0.9, seed=3)


def test_a_failing_request_leaves_the_batch_running(ckpt):
    """The third greedy token of one request poisons its decode input: that request ends with an
    error event, the others in the same batch finish with their reference tokens."""
    tok = ckpt.tokenizer
    victim = reference_ids(ckpt, "To be", 5, temperature=0.0)
    poison = victim[2]
    others = [p for p in PROMPTS[1:] if poison not in reference_ids(ckpt, p, 15, temperature=0.0)
              and poison not in tok.encode(p)][:3]
    assert len(others) == 3
    engine = Engine(ckpt, max_concurrent=4, max_queue=0, cuda_graphs=False)  # the recorder sees every forward
    engine.client.core.model = RecordingModel(ckpt.model, poison=poison)
    params = [GenerationParams(tok.encode("To be"), 15, SamplingParams(temperature=0.0))]
    params += [GenerationParams(tok.encode(p), 15, SamplingParams(temperature=0.0)) for p in others]
    try:
        results = run(engine, params)
        assert engine.alive and engine.errors == 1
    finally:
        engine.close()
    tokens, last = results[0]
    assert isinstance(last, ErrorEvent) and last.message.startswith("internal error while generating")
    assert [t.id for t in tokens] == victim[: victim.index(poison) + 1]  # it fails feeding the poison
    for (tokens, last), p in zip(results[1:], others):
        assert isinstance(last, DoneEvent)
        assert [t.id for t in tokens] == reference_ids(ckpt, p, 15, temperature=0.0)


def test_a_cancelled_waiting_request_frees_its_queue_place_at_once(ckpt):
    """One long generation holds the only slot (its forward is held at a gate), one waits; the
    waiter gives up, and a new request is admitted while the slot is still taken."""
    tok = ckpt.tokenizer
    engine = Engine(ckpt, max_concurrent=1, max_queue=1)
    rec = engine.client.core.model = RecordingModel(ckpt.model)
    rec.gate.clear()
    ids = tok.encode("To be")

    async def main():
        holder = engine.submit(GenerationParams(ids, 50, SamplingParams(temperature=0.0)))
        for _ in range(200):  # the engine takes it into the slot (then waits at the gate)
            if engine.in_flight == 1:
                break
            await asyncio.sleep(0.005)
        assert engine.in_flight == 1
        waiter = engine.submit(GenerationParams(ids, 5, SamplingParams(temperature=0.0)))
        with pytest.raises(QueueFull):
            engine.submit(GenerationParams(ids, 5))
        waiter.cancel()
        newcomer = engine.submit(GenerationParams(ids, 4, SamplingParams(temperature=0.0)))  # no QueueFull
        assert engine.in_flight == 1 and engine.waiting == 1 and engine.cancelled == 1
        with pytest.raises(GenerationCancelled):
            await asyncio.wait_for(drain(waiter), 5)  # the waiter's consumer ends too
        rec.gate.set()
        holder.cancel()
        return await asyncio.wait_for(drain(newcomer), 30)

    try:
        tokens, done = run_fn(main)
    finally:
        rec.gate.set()
        engine.close()
    assert isinstance(done, DoneEvent) and tokens == reference_ids(ckpt, "To be", 4, temperature=0.0)


def test_a_request_of_several_generations_is_admitted_whole_or_not_at_all(ckpt):
    tok = ckpt.tokenizer
    engine = Engine(ckpt, max_concurrent=2, max_queue=3)
    rec = engine.client.core.model = RecordingModel(ckpt.model)
    rec.gate.clear()
    p = GenerationParams(tok.encode("To be"), 5, SamplingParams(temperature=0.0))

    async def main():
        with pytest.raises(RequestTooLarge, match="6 generations.*2 running \\+ 3 waiting"):
            engine.submit_all([p] * 6)  # more than all places, even on an idle server
        assert engine.waiting + engine.in_flight == 0
        held = engine.submit_all([p] * 3)
        with pytest.raises(QueueFull):
            engine.submit_all([p] * 3)  # 3 > the 2 places left: none is admitted
        assert engine.waiting + engine.in_flight == 3
        engine.submit_all([p] * 2)  # exactly fits
        for g in held:
            g.cancel()

    try:
        run_fn(main)
    finally:
        rec.gate.set()
        engine.close()


# --- Retry-After ---------------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Waiting:
    def __init__(self, max_new_tokens=10, produced=0):
        self.params = GenerationParams([1], max_new_tokens)
        self.produced = produced


def test_retry_after_follows_the_measured_drain_rate_and_grows_with_the_queue():
    clock = FakeClock()
    s = Admission(max_concurrent=2, max_queue=4, max_calls=1, clock=clock)
    s.admit_generations([Waiting() for _ in range(6)])
    s.generations.take()  # two running, four waiting
    # four generations finished over the last 8 seconds: 0.5 per second
    for t in (992.0, 994.0, 996.0, 998.0):
        clock.now = t
        s.drain.note_finished()
    clock.now = 1000.0
    with pytest.raises(QueueFull) as e:
        s.admit_generations([Waiting()])
    # 4 waiting + this one = 5 generations to get through at 0.5/s
    assert e.value.retry_after == 10 == math.ceil((4 + 1) / (4 / 8.0))
    assert s.retry_after(needed=3) == 14  # a longer line ahead: a longer wait
    s.generations.waiting.pop()
    s.generations.waiting.pop()
    assert s.retry_after() == 6  # a shorter queue: a shorter wait
    # finishing faster shortens it: eight more finishes in the next second
    for _ in range(8):
        clock.now += 0.125
        s.drain.note_finished()
    assert s.retry_after() == math.ceil(3 / (12 / (clock.now - 992.0)))
    # nothing finishes for a minute: the measured rate falls and the advice grows
    clock.now += 60
    assert s.retry_after() > 10


def test_retry_after_before_any_finish_comes_from_the_step_time():
    clock = FakeClock()
    d = DrainRate(clock)
    assert d.retry_after(5, running=0, tokens_owed=0) == 1  # nothing known yet
    d.note_step(0.05)  # 2 running generations owe 100 tokens: ~50 steps of 50 ms each = 2.5 s per pair
    assert d.per_second(running=2, tokens_owed=100) == pytest.approx(2 / 2.5)
    assert d.retry_after(4, running=2, tokens_owed=100) == 5


# --- the HTTP contract, in-process ---------------------------------------------------
def in_process(tiny_checkpoint, scenario, **settings):
    """Run `scenario(app, client)` against the app with its lifespan, in this event loop; its
    engine on a thread here, where a scenario can wrap the model (RecordingModel)."""
    app = create_app(Settings(model=tiny_checkpoint, device="cpu", warmup=False, engine_process=False, **settings))

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
                return await scenario(app, client)

    return run_async(main())


def test_429_contract_of_generate_and_v1_in_process(tiny_checkpoint):
    async def scenario(app, client):
        engine = app.state.attnlens.registry.get(None).runner
        rec = engine.client.core.model = RecordingModel(engine.client.core.model)
        clock = FakeClock()
        engine.admission.drain.clock = clock
        for t in (996.0, 998.0):  # two finishes over the last 4 seconds: 0.5 per second
            clock.now = t
            engine.admission.drain.note_finished()
        clock.now = 1000.0
        rec.gate.clear()
        ids = engine.tokenizer.encode("To be")
        held = engine.submit_all([GenerationParams(ids, 5) for _ in range(3)])  # 2 running + 1 waiting
        for _ in range(200):
            if engine.in_flight == 2:
                break
            await asyncio.sleep(0.005)
        try:
            r = await client.post("/generate", json={"prompt": "To be", "max_new_tokens": 2})
            assert r.status_code == 429 and "busy" in r.json()["detail"] and r.json()["code"] == "queue_full"
            assert r.headers["retry-after"] == str(math.ceil((1 + 1) / 0.5))  # 1 waiting + this one
            r = await client.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert r.json()["error"]["type"] == "rate_limit_exceeded" and r.headers["retry-after"] == "4"
            # can never fit (2 prompts x n=2 = 4 generations > 2 + 1 places): a 400 naming why
            r = await client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 2})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "too_many_generations" and err["param"] == "n"
            assert "4 generations" in err["message"] and "ATTNLENS_MAX_CONCURRENT" in err["message"]
            assert engine.in_flight + engine.waiting == 3  # nothing of the refused requests was admitted
        finally:
            for g in held:
                g.cancel()
            rec.gate.set()

    in_process(tiny_checkpoint, scenario, max_concurrent=2, max_queue=1)


def test_attention_bound_answers_429_when_full(tiny_checkpoint):
    async def scenario(app, client):
        engine = app.state.attnlens.registry.get(None).runner
        rec = engine.client.core.model = RecordingModel(engine.client.core.model)
        rec.gate.clear()
        first = asyncio.create_task(client.post("/attention", json={"text": "To be, or not"}))
        for _ in range(200):
            if engine.attention_in_flight == 1:
                break
            await asyncio.sleep(0.005)
        assert engine.attention_in_flight == 1
        r = await client.post("/attention", json={"text": "To be"})
        assert r.status_code == 429 and r.json()["code"] == "queue_full"
        assert "ATTNLENS_MAX_ATTENTION_CONCURRENT" in r.json()["detail"] and int(r.headers["retry-after"]) >= 1
        # generation is not on that line: it still runs
        rec.gate.set()
        r = await client.post("/generate", json={"prompt": "To be", "max_new_tokens": 3, "temperature": 0})
        assert r.status_code == 200
        assert (await first).status_code == 200
        assert engine.attention_in_flight == 0

    in_process(tiny_checkpoint, scenario, max_attention_concurrent=1)


@dataclass(frozen=True)
class FnCall:
    """A stand-in model operation that runs `fn(model, report)` on the engine's thread (the call line under test)."""

    operation: ClassVar[str] = "test_fn"
    fn: Callable


@pytest.fixture
def fn_calls(monkeypatch):
    monkeypatch.setitem(OPERATIONS, FnCall.operation, lambda model, call, report: call.fn(model, report))


def test_a_long_model_call_hands_over_heartbeats(ckpt, fn_calls):
    """A model call that reports progress (an /attention analysis: after each block and each map)
    makes the engine hand over an empty step at most once a second, which an engine process's
    watchdog counts as progress; a call that does not report hands over nothing until it ends."""
    from attnlens.app.engine import Engine

    engine = Engine(ckpt, max_concurrent=2, max_queue=2)
    emitted: list[int] = []
    real = engine.client.core.sink
    engine.client.core.sink = lambda records: (emitted.append(len(records)), real(records))

    def slow(report, reports: bool):
        for _ in range(5):
            time.sleep(0.3)
            if reports:
                report()
        return "done"

    try:
        assert run_async(engine.call(FnCall(lambda m, report: slow(report, True)))) == "done"
        beats = emitted.count(0)
        assert 1 <= beats <= 2  # 1.5 s of work, one beat a second at most
        emitted.clear()
        assert run_async(engine.call(FnCall(lambda m, report: slow(report, False)))) == "done"
        assert emitted.count(0) == 0
    finally:
        engine.close()


def test_generations_take_turns_with_a_long_model_call(ckpt, fn_calls):
    """A long model call (an /attention analysis) gives the generations decoding beside it a step
    at each of its report points: their tokens keep coming, and they finish before it does. The
    core steps the call between its own steps: no decode step runs from inside it."""
    from attnlens.app.engine import Engine
    from attnlens.model.hooks import active as active_hooks

    engine = Engine(ckpt, max_concurrent=2, max_queue=2)
    call_done, seen_hooks, seen_stacks = [], [], []

    def long_call(model, report):
        for _ in range(60):
            time.sleep(0.05)
            report()
        call_done.append(time.perf_counter())
        return "done"

    real_forward = engine.client.core.model.forward

    def forward(*a, **kw):  # the turn's steps run without the call's hooks or reporter, on the core's stack
        seen_hooks.append(active_hooks())
        seen_stacks.append({f.name for f in traceback.extract_stack()})
        return real_forward(*a, **kw)

    engine.client.core.model.forward = forward

    async def main():
        call = asyncio.ensure_future(engine.call(FnCall(long_call)))
        await asyncio.sleep(0.2)  # the call runs
        params = GenerationParams(ckpt.tokenizer.encode("To be"), 12, SamplingParams(temperature=0.0))
        tokens, done = await collect_tokens(engine.submit_all([params])[0])
        finished = time.perf_counter()
        assert await call == "done"
        return tokens, done, finished

    try:
        tokens, done, finished = run_async(main())
    finally:
        engine.client.core.model.forward = real_forward
        engine.close()
    assert isinstance(done, DoneEvent) and len(tokens) == 12
    assert finished < call_done[0]  # all 12 tokens came while the call still worked
    assert [t.id for t in tokens] == reference_ids(ckpt, "To be", 12, temperature=0.0)
    assert seen_hooks and all(h is None for h in seen_hooks)
    # the core steps the call: no decode step runs inside the call (from one of its report points)
    assert seen_stacks and not any({"long_call", "run_operation"} & names for names in seen_stacks)


def test_a_call_paused_inside_its_own_autograd_leaves_the_generations_in_inference_mode(ckpt, fn_calls):
    """Attribution patching enables autograd inside its call; at its report points the core runs
    decode steps on the same thread, which must still see inference mode (the KV cache's tensors
    are inference tensors: an in-place write outside inference mode raises)."""
    from attnlens.app.engine import Engine

    engine = Engine(ckpt, max_concurrent=2, max_queue=2)
    modes = []
    real_forward = engine.client.core.model.forward

    def forward(*a, **kw):  # the generations' forwards: in inference mode, whatever the call's mode
        modes.append(torch.is_inference_mode_enabled())
        return real_forward(*a, **kw)

    engine.client.core.model.forward = forward

    def with_grad(model, report):
        with torch.inference_mode(False), torch.enable_grad():
            w = torch.ones(3, requires_grad=True)
            for _ in range(40):
                time.sleep(0.02)
                report()
                assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()  # its own mode back
            (w * 2).sum().backward()
            return w.grad.tolist()

    async def main():
        call = asyncio.ensure_future(engine.call(FnCall(with_grad)))
        await asyncio.sleep(0.1)
        params = GenerationParams(ckpt.tokenizer.encode("To be"), 8, SamplingParams(temperature=0.0))
        tokens, done = await collect_tokens(engine.submit_all([params])[0])
        return tokens, done, await call

    try:
        tokens, done, grad = run_async(main())
    finally:
        engine.client.core.model.forward = real_forward
        engine.close()
    assert isinstance(done, DoneEvent) and [t.id for t in tokens] == reference_ids(ckpt, "To be", 8, temperature=0.0)
    assert grad == [2.0, 2.0, 2.0]
    assert modes and all(modes)


def test_a_model_call_stops_at_its_next_report_point_when_its_caller_goes(ckpt, fn_calls):
    from attnlens.app.engine import Engine

    engine = Engine(ckpt, max_concurrent=2, max_queue=2)
    reports = []

    def endless(model, report):
        while True:
            time.sleep(0.02)
            reports.append(1)
            report()

    async def main():
        call = asyncio.ensure_future(engine.call(FnCall(endless)))
        await asyncio.sleep(0.3)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        for _ in range(100):
            if engine.client.core.calls_cancelled:
                break
            await asyncio.sleep(0.02)
        n = len(reports)
        assert await engine.call(FnCall(lambda m, report: "next")) == "next"  # the engine goes on serving
        return n

    try:
        n = run_async(main())
    finally:
        engine.close()
    assert engine.client.core.calls_cancelled == 1 and len(reports) == n


@pytest.mark.parametrize("route,body", [
    ("/generate", {"prompt": "To be", "max_new_tokens": 60}),
    ("/v1/completions", {"prompt": ["To be", "Or"], "max_tokens": 60}),
])
def test_a_non_streamed_handler_ends_when_its_client_disconnects(tiny_checkpoint, route, body):
    """The client goes away mid-generation: the generation is cancelled, the handler returns,
    and the request is counted (status 499) in attnlens_http_requests_total."""

    async def scenario(app, client):
        engine = app.state.attnlens.registry.get(None).runner
        engine.client.core.model = RecordingModel(engine.client.core.model, delay=0.02)  # 60 tokens would take > 1 s
        import json as _json

        payload = _json.dumps(body).encode()
        sent = asyncio.Event()
        disconnect = asyncio.Event()

        async def receive():
            if not sent.is_set():
                sent.set()
                return {"type": "http.request", "body": payload, "more_body": False}
            await disconnect.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": route, "raw_path": route.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
                 "client": ("127.0.0.1", 1), "server": ("test", 80), "state": {}, "app": app}
        handler = asyncio.create_task(app(scope, receive, send))
        for _ in range(200):
            if engine.in_flight >= 1 and len(engine.client.core.model.calls) > 3:
                break
            await asyncio.sleep(0.01)
        disconnect.set()
        await asyncio.wait_for(handler, 5)  # before the fix: never returned
        assert engine.cancelled >= 1 and engine.in_flight == 0
        metrics = app.state.attnlens.metrics.render().decode()
        assert f'attnlens_http_requests_total{{method="POST",model="tiny",route="{route}",status="499"}} 1.0' in metrics

    in_process(tiny_checkpoint, scenario)


def test_per_step_attention_comes_from_the_batched_forward(ckpt):
    """Three rows of different lengths decode together, one of them asking for attention: its
    rows equal those of the request alone (its own positions only), the others are unaffected."""
    tok = ckpt.tokenizer
    engine = Engine(ckpt, max_concurrent=3, max_queue=0, cuda_graphs=False)  # the recorder sees every forward
    rec = engine.client.core.model = RecordingModel(ckpt.model)
    prompts = ["To be", "Whether 'tis nobler in the mind", "Or"]
    params = [GenerationParams(tok.encode(p), 8, SamplingParams(temperature=0.0), return_attention=(i == 1))
              for i, p in enumerate(prompts)]
    try:
        results = run(engine, params)
    finally:
        engine.close()
    assert max(b for b, t in rec.calls if t == 1) == 3
    ref = reference_tokens(ckpt, prompts[1], 8, return_attention=True, temperature=0.0)
    tokens, done = results[1]
    assert isinstance(done, DoneEvent) and [t.id for t in tokens] == [t.id for t in ref]
    for got, want in zip(tokens, ref):
        assert len(got.attention) == ckpt.config.n_layers
        for layer, rows in enumerate(got.attention):
            assert len(rows) == ckpt.config.n_heads and len(rows[0]) == want.attention[layer].shape[1]
            assert np.allclose(rows, want.attention[layer].numpy(), atol=1e-5, rtol=0)
    for i in (0, 2):
        assert results[i][0] and all(t.attention is None for t in results[i][0])
        assert [t.id for t in results[i][0]] == reference_ids(ckpt, prompts[i], 8, temperature=0.0)


def eos_prone_checkpoint(tmp_path):
    """A tiny checkpoint whose every step gives EOS about half the probability."""
    from helpers import make_tiny_checkpoint

    from attnlens.model import load_checkpoint, save_checkpoint

    path = make_tiny_checkpoint(tmp_path / "eos", tie_embeddings=False, seed=3)
    ck = load_checkpoint(path)
    with torch.no_grad():  # EOS has probability about 1/2 at every step
        ck.model.ln_f.weight.zero_()
        ck.model.ln_f.bias.fill_(1.0)
        ck.model.lm_head.weight.normal_(0, 0.01)
        ck.model.lm_head.weight[ck.tokenizer.eos_id].fill_(math.log(ck.config.vocab_size) / ck.config.d_model)
    save_checkpoint(path, ck.model, ck.tokenizer)
    ck = load_checkpoint(path)
    return ck


def test_a_generation_ending_on_eos_keeps_the_eos_score(tmp_path):
    """EOS is not text, but it is a generated token: its log-probability is kept for /v1 logprobs."""
    from attnlens.model import generate_tokens

    ck = eos_prone_checkpoint(tmp_path)
    params = SamplingParams(temperature=1.0, seed=4)
    ref = list(generate_tokens(ck.model, ck.tokenizer.encode("To be"), 20, params, n_logprobs=2))
    ids = [t.id for t in ref]
    assert ck.tokenizer.eos_id in ids
    eos_at = ids.index(ck.tokenizer.eos_id)
    engine = Engine(ck, max_concurrent=2, max_queue=0)

    async def main():
        g = engine.submit(GenerationParams(ck.tokenizer.encode("To be"), 20, params, n_logprobs=2))
        tokens, done = await collect_tokens(g)
        return tokens, done, g.eos_token

    try:
        tokens, done, eos = run_async(main())
    finally:
        engine.close()
    assert done.finish_reason == "eos" and done.completion_tokens == eos_at + 1
    assert [t.id for t in tokens] == ids[:eos_at]
    assert eos.id == ck.tokenizer.eos_id and eos.logprob == pytest.approx(ref[eos_at].logprob, abs=1e-4)
    assert [a.id for a in eos.top_logprobs] == ref[eos_at].top_ids


@ENGINE_KINDS
@pytest.mark.parametrize("overlap", [False, True], ids=["records-after-the-step", "records-while-the-next-step-runs"])
def test_a_random_mix_of_requests_and_cancellations_keeps_every_answer_right(ckpt, tiny_checkpoint, kind, overlap):
    """40 requests (greedy or seeded, stop strings, logprobs, attention, echo scores) through 4
    slots, a quarter of them cancelled at random moments: every other one equals its reference
    run alone, every one ends, and the engine is left empty; with the step's records handed
    over after it, or while the next step runs; with the engine on a thread or in its own process."""
    import random

    from attnlens.app.engine.textstream import TextStream

    tok = ckpt.tokenizer
    rng = random.Random(7)
    engine = make_engine(kind, ckpt, tiny_checkpoint, max_concurrent=4, max_queue=40, overlap_outputs=overlap)
    specs = []
    for i in range(40):
        prompt = rng.choice(PROMPTS)
        kw = sampling(rng.randrange(30))
        specs.append(dict(prompt=prompt, n=rng.randint(1, 25), kw=kw, stop=rng.choice([[], ["e"], ["the", "o "]]),
                          logprobs=rng.choice([0, 2]), attention=rng.random() < 0.2,
                          echo=rng.random() < 0.2, cancel_after=rng.choice([None, None, None, 0, 2, 5])))

    async def one(spec):
        params = GenerationParams(tok.encode(spec["prompt"]), spec["n"], SamplingParams(**spec["kw"]),
                                  stop=spec["stop"], n_logprobs=spec["logprobs"],
                                  return_attention=spec["attention"], prompt_logprobs=1 if spec["echo"] else None)
        g = engine.submit(params)
        await asyncio.sleep(rng.random() * 0.01)
        tokens = []
        try:
            if spec["cancel_after"] == 0:
                g.cancel()
            async for ev in g.events():
                if isinstance(ev, TokenEvent):
                    tokens.append(ev)
                    if spec["cancel_after"] is not None and len(tokens) >= spec["cancel_after"]:
                        g.cancel()
                else:
                    return g, tokens, ev
        except GenerationCancelled:
            return g, tokens, "cancelled"
        return g, tokens, None

    async def main():
        return await asyncio.gather(*(one(s) for s in specs))

    try:
        results = run_async(main())
    finally:
        engine.close()
    assert engine.in_flight == 0 and engine.waiting == 0 and engine.errors == 0
    if kind == "thread":  # (the engine process's cache is its own: there the answers show it)
        assert engine.client.core.cache.lengths.tolist() == [0] * 4
    finished = 0
    for spec, (g, tokens, last) in zip(specs, results):
        assert last is not None
        ref = reference_tokens(ckpt, spec["prompt"], spec["n"], **spec["kw"])
        ids = [t.id for t in tokens]
        if last == "cancelled":
            assert ids == [t.id for t in ref][: len(ids)]
            continue
        finished += 1
        assert isinstance(last, DoneEvent)
        # the reference, cut where the stop string begins (TextStream is tested on its own)
        ts, want = TextStream(tok, spec["stop"]), []
        for i, t in enumerate(ref):
            want += ts.push(i, t.id, None)
            if ts.stopped:
                break
        else:
            want += ts.finish()
        assert ids == [r.id for r in want] and last.text == ts.text
        assert last.finish_reason == ("stop" if ts.stopped else "eos" if len(ref) < spec["n"] else "length")
        if spec["logprobs"]:
            assert all(len(t.top_logprobs) == 2 for t in tokens)
        assert all((t.attention is not None) == spec["attention"] for t in tokens)
        assert (g.prompt_scores is not None) == spec["echo"]
    assert finished >= 20


def test_events_already_waiting_come_as_one_batch(ckpt):
    """A stream writer that falls behind gets every waiting event at once (one SSE write), in
    order; a cancellation still raises after the events before it."""
    tok = ckpt.tokenizer
    engine = Engine(ckpt, max_concurrent=2, max_queue=0)

    async def main():
        g = engine.submit(GenerationParams(tok.encode("To be"), 6, SamplingParams(temperature=0.0)))
        while g.generation.t_end is None:  # let the whole generation finish before reading anything
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # its records reach the queue on this loop
        return [batch async for batch in g.event_batches()]

    try:
        batches = run_async(main())
    finally:
        engine.close()
    assert len(batches) == 1
    *tokens, done = batches[0]
    assert isinstance(done, DoneEvent) and all(isinstance(t, TokenEvent) for t in tokens)
    assert [t.id for t in tokens] == reference_ids(ckpt, "To be", 6, temperature=0.0)


def test_a_stream_left_unread_past_its_backlog_bound_ends_with_an_error(ckpt):
    """Attention rows make token events big: a client that reads none of them while they pile up
    past max_stream_backlog_bytes gets the tokens queued so far, then an error naming the
    setting; its row is freed and a client that reads as it goes is unaffected."""
    tok = ckpt.tokenizer
    per_token = 32 * ckpt.config.n_layers * ckpt.config.n_heads * 20  # attention of ~20 positions
    engine = Engine(ckpt, max_concurrent=2, max_queue=0, max_stream_backlog_bytes=5 * per_token)
    params = GenerationParams(tok.encode("To be"), 40, SamplingParams(temperature=0.0), return_attention=True)

    async def main():
        idle, reader = engine.submit_all([params, GenerationParams(tok.encode("The slings"), 40,
                                                                   SamplingParams(temperature=0.0))])
        read = await collect_tokens(reader)
        while idle.generation.t_end is None:
            await asyncio.sleep(0.01)
        return await collect_tokens(idle), read

    try:
        (tokens, last), (read_tokens, read_done) = run_async(main())
    finally:
        engine.close()
    assert isinstance(last, ErrorEvent) and "ATTNLENS_MAX_STREAM_BACKLOG_BYTES" in last.message
    assert 0 < len(tokens) < 40
    assert [t.id for t in tokens] == reference_ids(ckpt, "To be", 40, temperature=0.0)[: len(tokens)]
    assert isinstance(read_done, DoneEvent)
    assert [t.id for t in read_tokens] == reference_ids(ckpt, "The slings", 40, temperature=0.0)
    assert engine.in_flight == 0 and engine.client.core.cache.lengths.tolist() == [0, 0]


def test_ignore_eos_runs_to_max_new_tokens_past_an_eos(tmp_path):
    """GenerationParams.ignore_eos (vLLM's, for benchmarks): the EOS the same seed ends on is a
    token like the others, and the generation runs to its max_new_tokens, as generate_tokens does."""
    from attnlens.model import generate_tokens

    ck = eos_prone_checkpoint(tmp_path)
    params = SamplingParams(temperature=1.0, seed=4)
    ids = [t.id for t in generate_tokens(ck.model, ck.tokenizer.encode("To be"), 20, params)]
    assert ck.tokenizer.eos_id in ids[:-1]
    engine = Engine(ck, max_concurrent=2, max_queue=0)

    async def main():
        return await collect_tokens(engine.submit(GenerationParams(ck.tokenizer.encode("To be"), 20, params,
                                                                   ignore_eos=True)))

    try:
        tokens, done = run_async(main())
    finally:
        engine.close()
    assert done.finish_reason == "length" and done.completion_tokens == 20
    assert [t.id for t in tokens] == ids

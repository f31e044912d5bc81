"""Issue 24, defect 5: what stream clients leave unread is bounded per stream
(ATTNLENS_MAX_STREAM_BACKLOG_BYTES) and for all streams together
(ATTNLENS_MAX_STREAM_BACKLOG_TOTAL_BYTES, app/engine/outputs.py's StreamBudget). Both through the app,
for the thread engine and the engine process: a stream whose client reads nothing (its writes
block, as on a socket nobody reads) ends with the error event. The memory a live server gets
back once such clients leave is measured in test_service_faults_live.py."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import threading
import weakref

import pytest
import torch
from fastapi.testclient import TestClient
from helpers import parse_sse, run_async

from attnlens.app.engine import Engine, GenerationParams
from attnlens.app.engine.outputs import DoneEvent, ErrorEvent, RequestState, StreamBudget, TokenRecord
from attnlens.app.engine.request import Generation
from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.app.serving.generation_streams import event_batches
from attnlens.model import SamplingParams
from attnlens.model.sampling import GeneratedToken


async def unread_stream(app, engine, body: dict, *, timeout: float = 60.0) -> str:
    """POST /generate as a client that takes the first chunk and then reads nothing (every
    further write blocks) until the engine holds no generation; then it reads to the end."""
    data = json.dumps(body).encode()
    readable, chunks, received = asyncio.Event(), [], []

    async def receive():
        if not received:
            received.append(True)
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Event().wait()  # never disconnects

    async def send(message):
        if message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if len(chunks) >= 1:
                await readable.wait()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/generate", "raw_path": b"/generate", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    task = asyncio.create_task(app(scope, receive, send))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not chunks or engine.in_flight or engine.waiting:  # the generation ended with nobody reading
        assert loop.time() < deadline, "the unread stream's generation never ended"
        await asyncio.sleep(0.02)
    readable.set()
    await asyncio.wait_for(task, timeout)
    return b"".join(chunks).decode()


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_max_stream_backlog_bytes_ends_an_unread_stream_through_the_app(tiny_checkpoint, engine_process):
    settings = Settings(model=tiny_checkpoint, device="cpu", warmup=False, engine_process=engine_process,
                        max_stream_backlog_bytes=40_000, max_new_tokens=60)
    with TestClient(create_app(settings)) as c:
        app, engine = c.app, c.app.state.attnlens.registry.get(None).runner
        body = {"prompt": "To be", "max_new_tokens": 60, "temperature": 0, "stream": True, "return_attention": True}
        text = c.portal.call(unread_stream, app, engine, body)
        events = parse_sse(text)
        assert events[-1][0] == "error", text[-500:]
        error = json.loads(events[-1][1])
        assert "ATTNLENS_MAX_STREAM_BACKLOG_BYTES" in error["message"] and error["code"] == "stream_backlog_exceeded"
        tokens = [e for e in events if e[0] == "token"]
        assert 0 < len(tokens) < 60  # what it queued before the bound, then the error
        # a client that reads is unaffected
        r = c.post("/generate", json={**body, "return_attention": False})
        assert parse_sse(r.text)[-1][0] == "done"


def test_the_total_budget_sheds_the_stream_holding_most_and_gives_its_bytes_back(ckpt):
    """Three streams nobody reads, whose backlogs together pass the budget: the one holding the
    most is ended with an error and its unread events dropped (their bytes leave the count at
    once); the smaller ones finish; every byte is given back once the streams are read or let go."""
    tok = ckpt.tokenizer
    per_token = 512 + 32 * ckpt.config.n_layers * ckpt.config.n_heads * 20  # attention of ~20 positions
    budget = StreamBudget(30 * per_token)
    engine = Engine(ckpt, max_concurrent=3, max_queue=0, max_stream_backlog_bytes=10_000_000)
    engine.stream_budget = budget
    greedy = SamplingParams(temperature=0.0)

    async def main():
        big = engine.submit(GenerationParams(tok.encode("To be"), 40, greedy, return_attention=True))
        small = engine.submit_all([GenerationParams(tok.encode("The slings"), 6, greedy, return_attention=True),
                                   GenerationParams(tok.encode("Whether"), 6, greedy, return_attention=True)])
        while engine.in_flight or engine.waiting or not small[1].closed:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the last records reach the queues
        assert budget.in_use <= budget.limit and budget.shed == 1 and big.shed
        results = []
        for g in (big, *small):
            results.append([e async for e in g.events()])
        return results

    try:
        results = run_async(main())
    finally:
        engine.close()
    shed, *finished = results
    assert len(shed) == 1 and isinstance(shed[0], ErrorEvent) and shed[0].code == "stream_backlog_exceeded"
    assert "ATTNLENS_MAX_STREAM_BACKLOG_TOTAL_BYTES" in shed[0].message
    for events in finished:
        assert isinstance(events[-1], DoneEvent) and len(events) == 7
    gc.collect()
    assert budget.in_use == 0


def test_a_stream_let_go_unread_gives_its_bytes_back(ckpt):
    """A finished stream whose client leaves without reading: once the route lets go of the
    generation, its output is freed (no reference cycle) and the budget gets its bytes back."""
    tok = ckpt.tokenizer
    budget = StreamBudget(10**9)
    engine = Engine(ckpt, max_concurrent=1, max_queue=0)
    engine.stream_budget = budget

    async def main():
        g = engine.submit(GenerationParams(tok.encode("To be"), 8, SamplingParams(temperature=0.0),
                                           return_attention=True))
        while g.generation.t_end is None:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        held = budget.in_use
        g.cancel()  # what a route does in its finally
        del g
        return held, budget.in_use

    try:
        held, after = run_async(main())
    finally:
        engine.close()
    assert held > 0 and after == 0


def stream_state(ckpt, budget: StreamBudget) -> RequestState:
    """A stream's server-side state, fed its records by hand (no engine): call on the event loop."""
    params = GenerationParams(ckpt.tokenizer.encode("To be"), 20, SamplingParams(), return_attention=True)
    state = RequestState(Generation(params), asyncio.get_running_loop(), ckpt.tokenizer, [])
    budget.join(state)
    return state


def give_tokens(ckpt, state: RequestState, n: int) -> None:
    """n token records with attention rows (2 layers x 4 heads x 40 positions), as the engine hands them over."""
    for token_id in ckpt.tokenizer.encode(" or not to be that is")[:n]:
        rows = [torch.rand(4, 40) for _ in range(2)]
        state.handle(TokenRecord(state.generation, GeneratedToken(token_id, -0.5, [1, 2], [-1.0, -2.0], rows)))


def test_a_batch_its_writer_holds_stays_counted_until_it_asks_for_the_next_or_stops(ckpt):
    """The events a writer took count until it asks for more (they were sent) or stops: a client
    that does not read holds them in a write that waits."""
    budget = StreamBudget(10**9)

    async def main():
        state = stream_state(ckpt, budget)
        give_tokens(ckpt, state, 3)
        queued = budget.in_use
        batches = state.event_batches()
        first = await batches.__anext__()  # every event waiting, being sent
        while_sent = budget.in_use
        give_tokens(ckpt, state, 1)
        await batches.__anext__()  # the first batch was sent
        after_first = budget.in_use
        await batches.aclose()  # the writer stops (its client left)
        return queued, len(first), while_sent, after_first

    queued, taken, while_sent, after_first = run_async(main())
    assert taken == 3 and while_sent == queued > 0 and 0 < after_first < queued
    assert budget.in_use == 0


def test_a_writer_cancelled_while_it_waits_keeps_no_events_in_its_traceback(ckpt):
    """A stream's writer is cancelled while it waits for events when its client leaves; asyncio
    and anyio keep that CancelledError (and the frames in its traceback) in reference cycles until
    the cyclic GC runs, so those frames must hold none of the events they handed on: their
    attention rows are freed at once."""
    budget = StreamBudget(10**9)
    taken, kept = [], []

    async def main():
        state = stream_state(ckpt, budget)
        give_tokens(ckpt, state, 3)

        async def writer():  # what the /generate route runs
            try:
                async for batch in event_batches(state):
                    taken.extend(weakref.ref(rows) for event in batch for rows in event.attention)
                    del batch
            except asyncio.CancelledError as e:
                kept.append(e)  # as anyio's task group keeps it
                raise

        task = asyncio.create_task(writer())
        await asyncio.sleep(0.05)  # it took every event and waits for more
        give_tokens(ckpt, state, 2)
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    gc.disable()
    try:
        run_async(main())
        assert kept and len(taken) == 2 * 5
        assert [r for r in taken if r() is not None] == []
    finally:
        gc.enable()


class _CyclicOutput:
    """A stream's output as the budget sees it, kept alive only by a reference cycle: the garbage
    collector, not the reference count, frees it (and runs the budget's finaliser)."""

    def __init__(self):
        from attnlens.app.engine.outputs import Held

        self.held, self.shed, self.budget, self.me = Held(), False, None, self

    def shed_backlog(self, limit: int) -> None:
        self.shed = True


class _CollectingLock:
    """The budget's lock, with a garbage collection run each time it is taken: the collection that
    lands inside add()'s locked sums (any allocation may start one)."""

    def __init__(self):
        self.lock = threading.Lock()

    def __enter__(self):
        self.lock.acquire()
        gc.collect()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def test_a_collection_inside_the_budgets_sums_does_not_deadlock():
    """An output's finaliser runs wherever the garbage collector runs: inside add(), with the
    budget's lock held, it must not take the lock again (it deadlocked a server's event loop in a
    20-minute soak). Its bytes are counted at the next reading."""
    budget = StreamBudget(10**9)
    out = _CyclicOutput()
    budget.join(out)
    budget.add(100)
    out.held.bytes = 100
    del out
    budget._lock = _CollectingLock()  # type: ignore[assignment]
    worker = threading.Thread(target=budget.add, args=(1,), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "add() deadlocked on its own finaliser"
    assert budget.in_use == 1

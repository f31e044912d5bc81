"""The engine core in a process of its own (app/engine/process.py, the server's default):
admission stays in the server, so a cancelled waiter leaves at once even while the engine
process is busy (here: stopped with SIGSTOP); the engine process dying ends every request it
held with an error, never a hang; model calls travel by pickle, and one that cannot fails
alone. That its answers equal each request run alone is tested with the thread engine's, in
test_engine_batching.py (the `kind` parameter)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import numpy as np
import pytest
import torch
from helpers import drain, make_tiny_checkpoint, reference_ids, run_async

from attnlens.app.engine import EngineClosed, EngineProcess, GenerationCancelled, GenerationParams, QueueFull
from attnlens.app.engine.outputs import DoneEvent, ErrorEvent
from attnlens.model import SamplingParams
from attnlens.model.analysis.attention_maps import attention_maps
from attnlens.model.analysis.operations import AttentionCall

GREEDY = SamplingParams(temperature=0.0)


def engine_process(ckpt, tiny_checkpoint, **kw) -> EngineProcess:
    return EngineProcess(ckpt, model_dir=tiny_checkpoint, device="cpu", dtype="float32", **kw)


@contextlib.contextmanager
def paused(engine: EngineProcess):
    """The engine process is stopped (SIGSTOP) inside the block: it takes no step, reads nothing."""
    os.kill(engine.client.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(engine.client.process.pid, signal.SIGCONT)


def test_a_cancelled_waiter_frees_its_place_while_the_engine_process_is_busy(ckpt, tiny_checkpoint):
    """One generation holds the only slot while the engine process is stopped; a waiter gives up
    and a new request is admitted at once; when the engine process goes on, the newcomer gets
    its reference tokens."""
    engine = engine_process(ckpt, tiny_checkpoint, max_concurrent=1, max_queue=1)
    ids = ckpt.tokenizer.encode("To be")

    async def main():
        with paused(engine):
            holder = engine.submit(GenerationParams(ids, 50, GREEDY))
            waiter = engine.submit(GenerationParams(ids, 5, GREEDY))
            with pytest.raises(QueueFull):
                engine.submit(GenerationParams(ids, 5))
            waiter.cancel()
            newcomer = engine.submit(GenerationParams(ids, 4, GREEDY))  # no QueueFull
            assert engine.in_flight == 1 and engine.waiting == 1 and engine.cancelled == 1
            with pytest.raises(GenerationCancelled):
                await asyncio.wait_for(drain(waiter), 5)
        holder.cancel()
        return await asyncio.wait_for(drain(newcomer), 30)

    try:
        tokens, done = run_async(main())
    finally:
        engine.close()
    assert isinstance(done, DoneEvent) and tokens == reference_ids(ckpt, "To be", 4, temperature=0.0)


def test_the_engine_process_dying_ends_what_it_held_with_an_error(ckpt, tiny_checkpoint):
    engine = engine_process(ckpt, tiny_checkpoint, max_concurrent=1, max_queue=2)
    ids = ckpt.tokenizer.encode("To be")

    async def main():
        os.kill(engine.client.process.pid, signal.SIGSTOP)
        running = engine.submit(GenerationParams(ids, 50, GREEDY))
        waiting = engine.submit(GenerationParams(ids, 5, GREEDY))
        call = asyncio.create_task(engine.call(AttentionCall(ids=ids, layers=[0], heads=[0])))
        await asyncio.sleep(0.05)
        os.kill(engine.client.process.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(drain(running), drain(waiting)), 10)
        with pytest.raises(EngineClosed, match="engine process stopped"):
            await asyncio.wait_for(call, 10)
        with pytest.raises(EngineClosed, match="engine process stopped"):
            engine.submit(GenerationParams(ids, 5))
        return results

    try:
        results = run_async(main())
        assert not engine.alive and engine.in_flight == 0 and engine.waiting == 0
    finally:
        engine.close()
    for tokens, last in results:
        assert isinstance(last, ErrorEvent) and "engine process stopped" in last.message


def test_model_calls_travel_by_pickle_and_one_that_cannot_fails_alone(ckpt, tiny_checkpoint):
    engine = engine_process(ckpt, tiny_checkpoint, max_concurrent=2, max_queue=0)
    ids = ckpt.tokenizer.encode("To be, or not")

    async def main():
        with pytest.raises(RuntimeError, match="internal error in a model call"):
            await engine.call(lambda model: attention_maps(model, ids, [0], [0]))  # a closure does not pickle
        maps = (await engine.call(AttentionCall(ids=ids, layers=[0, 1], heads=[1, 3]))).maps["self"]
        tokens, done = await drain(engine.submit(GenerationParams(ids, 6, GREEDY)))
        return maps, tokens, done

    try:
        maps, tokens, done = run_async(main())
        assert engine.alive and engine.attention_in_flight == 0
    finally:
        engine.close()
    with torch.inference_mode():  # (another process, maybe other threads: the last bits may differ)
        assert np.allclose(maps, attention_maps(ckpt.model, ids, [0, 1], [1, 3]), atol=1e-6)
    assert isinstance(done, DoneEvent) and tokens == reference_ids(ckpt, "To be, or not", 6, temperature=0.0)


def test_a_stop_string_ends_the_generation_in_the_engine_process(tmp_path):
    """The server finds the stop string and tells the engine process, which runs ahead of the
    server, to stop: it stops long before the budget (a model slow enough that ~250 steps take
    a good fraction of a second), and the answer counts only the tokens up to the stop."""
    from attnlens.model import load_checkpoint

    path = make_tiny_checkpoint(tmp_path / "slower", d_model=256, n_layers=8, d_ff=1024, context_length=256)
    ck = load_checkpoint(path)
    tok, budget = ck.tokenizer, 250
    ref = reference_ids(ck, "To be", budget, temperature=0.0)
    at = next(i for i in range(3, budget) if tok.decode(ref[i : i + 1]).strip())  # a token with visible text
    stop = tok.decode(ref[at : at + 1]).strip()
    first = next(i for i in range(budget) if stop in tok.decode(ref[: i + 1]))  # where the text first holds it
    assert first < 20 and len(ref) == budget
    engine = engine_process(ck, path, max_concurrent=1, max_queue=0)

    async def main():
        g = engine.submit(GenerationParams(tok.encode("To be"), budget, GREEDY, stop=[stop]))
        return g, await drain(g)

    try:
        g, (tokens, done) = run_async(main())
        assert engine.in_flight == 0
    finally:
        engine.close()
    assert isinstance(done, DoneEvent) and done.finish_reason == "stop"
    assert done.completion_tokens == first + 1 and tokens == ref[: len(tokens)]
    assert g.generation.produced < budget  # the engine process's own count: it stopped when told


def test_close_ends_every_generation_and_the_engine_process(ckpt, tiny_checkpoint):
    engine = engine_process(ckpt, tiny_checkpoint, max_concurrent=1, max_queue=1)
    ids = ckpt.tokenizer.encode("To be")

    async def main():
        with paused(engine):
            generations = engine.submit_all([GenerationParams(ids, 50, GREEDY), GenerationParams(ids, 5, GREEDY)])
        await asyncio.to_thread(engine.close)
        return await asyncio.wait_for(asyncio.gather(*(drain(g) for g in generations)), 10)

    results = run_async(main())
    assert engine.client.process.returncode == 0
    for tokens, last in results:  # the running one may have finished first; none is left hanging
        assert isinstance(last, DoneEvent) or "shutting down" in last.message


def test_a_model_that_cannot_load_fails_start_up_with_the_reason(ckpt, tmp_path):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="nowhere"):
        EngineProcess(ckpt, model_dir=tmp_path / "nowhere", device="cpu")
    assert time.monotonic() - start < 60


def test_readyz_says_when_the_engine_process_has_stopped(tiny_checkpoint):
    """With restarts turned off (ATTNLENS_ENGINE_MAX_RESTARTS=0) a dead engine process stays dead:
    /readyz says so and why, and requests get a 503 that says the engine failed. (Restarts, the
    default, are tested in test_engine_supervision.py.)"""
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    settings = Settings(model=tiny_checkpoint, device="cpu", warmup=False, engine_max_restarts=0)
    with TestClient(create_app(settings)) as c:
        engine = c.app.state.attnlens.registry.get(None).runner
        assert engine.restartable and c.get("/readyz").status_code == 200
        os.kill(engine.client.process.pid, signal.SIGKILL)
        for _ in range(500):
            if engine.state == "failed":
                break
            time.sleep(0.01)
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        detail = r.json()["detail"]
        assert "engine process stopped" in detail and "ATTNLENS_ENGINE_MAX_RESTARTS=0" in detail, detail
        assert r.json()["models"][tiny_checkpoint.name]["state"] == "failed"
        r = c.post("/generate", json={"prompt": "To be", "max_new_tokens": 2})
        assert r.status_code == 503 and "engine process stopped" in r.json()["detail"]
        assert r.json()["code"] == "engine_failed"


def test_a_hand_over_the_server_cannot_take_ends_everything_with_an_error(ckpt, tiny_checkpoint, monkeypatch):
    """A bug in reading the engine process's records stops the engine process and ends every
    request with an error: nothing waits for records that nobody reads any more."""
    import attnlens.app.engine.process as process

    def broken(item, generation):
        raise ValueError("a record the server cannot read")

    monkeypatch.setattr(process, "_record", broken)
    engine = engine_process(ckpt, tiny_checkpoint, max_concurrent=1, max_queue=1)
    ids = ckpt.tokenizer.encode("To be")

    async def main():
        generations = engine.submit_all([GenerationParams(ids, 20, GREEDY), GenerationParams(ids, 5, GREEDY)])
        return await asyncio.wait_for(asyncio.gather(*(drain(g) for g in generations)), 10)

    try:
        results = run_async(main())
        assert engine.client.process.wait(10) is not None and not engine.alive
    finally:
        engine.close()
    for tokens, last in results:
        assert isinstance(last, ErrorEvent) and "engine process stopped" in last.message

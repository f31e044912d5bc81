"""Issue 24, defects 1 and 2: engine processes are supervised (app/engine/supervisor.py).

In-process (TestClient runs the lifespan) on tiny models, with real engine processes that are
really killed (SIGKILL) or stopped (SIGSTOP): a dead engine process is restarted and the
service heals; requests that arrive meanwhile wait, or past ATTNLENS_ENGINE_RESTART_WAIT_S get
a 503 engine_restarting with Retry-After; a crash loop gives up and says why; an engine that
holds work and makes no progress is killed by the watchdog; the translator's engine is watched
like the decoder's; /readyz, /models and /metrics report each model's state. And the server
never writes to an engine's pipe from the event loop. The same against a live server, with
streams cut mid-way, is in test_service_faults_live.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from fastapi.testclient import TestClient
from helpers import drain, run_async
from translator_helpers import make_tiny_translator

from attnlens.app.engine import EngineProcess, GenerationParams
from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.model import SamplingParams

FAST = dict(engine_restart_backoff_s=0.05, engine_restart_backoff_max_s=0.2)


def wait_for(predicate, timeout: float = 60.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout} s")
        time.sleep(0.02)


def engine_of(client, name: str) -> EngineProcess:
    engine = client.app.state.attnlens.registry.models[name].runner
    assert engine.restartable
    return engine


@pytest.fixture(scope="module")
def translator_dir(tmp_path_factory):
    return make_tiny_translator(tmp_path_factory.mktemp("sup") / "tr")


def test_a_killed_engine_process_is_restarted_and_the_service_heals(tiny_checkpoint, translator_dir):
    """SIGKILL each model's engine in turn: /readyz says which model restarts and why, the other
    model keeps answering, a request sent while it restarts waits and gets its answer, and the
    new engine process answers; /models and /metrics count the restart."""
    name = tiny_checkpoint.name
    # a request sent while its engine restarts waits for it: on a loaded 2-core machine a new engine
    # process can take longer than the default 10 s to load, and this test is about healing
    settings = Settings(model=tiny_checkpoint, models=[tiny_checkpoint, translator_dir], device="cpu",
                        warmup=False, engine_restart_wait_s=60.0, **FAST)
    with TestClient(create_app(settings)) as c:
        assert c.get("/readyz").json()["models"] == {name: {"state": "running", "restarts": 0, "detail": None},
                                                     "tr": {"state": "running", "restarts": 0, "detail": None}}
        for victim, other, prompt in [(name, "tr", "To be"), ("tr", name, "ninety-seven")]:
            engine = engine_of(c, victim)
            old_pid = engine.client.process.pid
            os.kill(old_pid, signal.SIGKILL)
            wait_for(lambda: engine.state != "running", 10, "the death noticed")
            ready = c.get("/readyz")
            if ready.status_code == 503:  # (the restart may already be done on a fast machine)
                assert ready.json()["models"][victim]["state"] in ("restarting", "starting")
                assert "exit code -9" in ready.json()["detail"] and victim in ready.json()["detail"]
            # the other model is not affected; this one's request waits for the new engine process
            assert c.post("/generate", json={"model": other, "prompt": "To be", "max_new_tokens": 3}).status_code == 200
            r = c.post("/generate", json={"model": victim, "prompt": prompt, "max_new_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
            assert engine.client.process.pid != old_pid and engine.state == "running"
            assert c.get("/readyz").status_code == 200
        models = {m["name"]: m for m in c.get("/models").json()["models"]}
        assert models[name]["state"] == "running" and models[name]["restarts"] == 1
        assert models["tr"]["restarts"] == 1
        metrics = c.get("/metrics").text
        assert f'attnlens_engine_restarts_total{{model="{name}"}} 1.0' in metrics
        assert 'attnlens_engine_state{model="tr",state="running"} 1.0' in metrics
        assert 'attnlens_engine_state{model="tr",state="restarting"} 0.0' in metrics


def test_what_the_dead_engine_held_ends_with_a_503_and_the_waiting_line_survives(ckpt, tiny_checkpoint):
    """The generation running in the engine process when it dies ends with an error (a 503,
    engine_restarting, with Retry-After, for a plain answer); one still waiting in line is sent
    to the new engine process and gets its whole answer."""
    settings = Settings(model=tiny_checkpoint, device="cpu", warmup=False, max_concurrent=1, max_queue=2, **FAST)
    with TestClient(create_app(settings)) as c:
        engine = engine_of(c, tiny_checkpoint.name)
        ids = ckpt.tokenizer.encode("To be")

        async def main():
            os.kill(engine.client.process.pid, signal.SIGSTOP)  # holds the running one where it is
            running = engine.submit(GenerationParams(ids, 50, SamplingParams(temperature=0.0)))
            waiting = engine.submit(GenerationParams(ids, 5, SamplingParams(temperature=0.0)))
            await asyncio.sleep(0.1)
            os.kill(engine.client.process.pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(drain(running), drain(waiting)), 60)

        (_, lost), (tokens, done) = c.portal.call(main)
        assert lost.code == "engine_restarting" and lost.retry_after >= 1 and "restarted" in lost.message
        assert done.finish_reason == "length" and len(tokens) == 5
        from attnlens.app.serving.generation_streams import error_status

        err = error_status(lost)
        assert err.status_code == 503 and err.headers["Retry-After"] == str(lost.retry_after)


def test_requests_wait_for_a_restart_only_so_long_then_get_503_with_retry_after(tiny_checkpoint, monkeypatch):
    """A restart that takes longer than ATTNLENS_ENGINE_RESTART_WAIT_S: what waited ends, and new
    requests are refused at once, with 503 engine_restarting and a Retry-After; when the engine
    process is back, they are served again."""
    import attnlens.app.engine.process as process

    gate = threading.Event()
    real_spawn = process._spawn

    def slow_spawn(spec):
        gate.wait(60)  # the new engine process starts only when the test lets it
        return real_spawn(spec)

    settings = Settings(model=tiny_checkpoint, device="cpu", warmup=False, engine_restart_wait_s=0.5, **FAST)
    with TestClient(create_app(settings)) as c:
        engine = engine_of(c, tiny_checkpoint.name)
        monkeypatch.setattr(process, "_spawn", slow_spawn)
        os.kill(engine.client.process.pid, signal.SIGKILL)
        wait_for(lambda: engine.state != "running", 10)
        t0 = time.monotonic()
        r = c.post("/generate", json={"prompt": "To be", "max_new_tokens": 2})  # waits 0.5 s, then 503
        assert r.status_code == 503 and r.json()["code"] == "engine_restarting", r.text
        assert time.monotonic() - t0 < 30 and int(r.headers["retry-after"]) >= 1
        r = c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2})  # refused at once now
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_restarting"
        assert int(r.headers["retry-after"]) >= 1
        gate.set()
        wait_for(lambda: engine.state == "running", 60, "the restart")
        assert c.post("/generate", json={"prompt": "To be", "max_new_tokens": 2}).status_code == 200


def test_a_crash_loop_gives_up_and_says_why(tiny_checkpoint, monkeypatch):
    """Every new engine process fails to start: after ATTNLENS_ENGINE_MAX_RESTARTS deaths the model
    is given up: state failed, /readyz 503 naming the setting and the last error, requests 503
    engine_failed; the server itself keeps answering."""
    import attnlens.app.engine.process as process

    def broken_spawn(spec):
        raise OSError("no more processes (as the test has it)")

    settings = Settings(model=tiny_checkpoint, device="cpu", warmup=False, engine_max_restarts=2, **FAST)
    with TestClient(create_app(settings)) as c:
        engine = engine_of(c, tiny_checkpoint.name)
        monkeypatch.setattr(process, "_spawn", broken_spawn)
        os.kill(engine.client.process.pid, signal.SIGKILL)
        wait_for(lambda: engine.state == "failed", 30, "giving up")
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        detail = r.json()["detail"]
        assert "ATTNLENS_ENGINE_MAX_RESTARTS=2" in detail and "3 times" in detail, detail
        assert "no more processes" in detail, detail
        r = c.post("/generate", json={"prompt": "To be", "max_new_tokens": 2})
        assert r.status_code == 503 and r.json()["code"] == "engine_failed" and "ATTNLENS_ENGINE_MAX_RESTARTS" in r.text
        assert c.get("/models").json()["models"][0]["state"] == "failed"
        assert c.get("/healthz").status_code == 200


def test_the_watchdog_restarts_an_engine_that_holds_work_and_makes_no_progress(tiny_checkpoint):
    """A stopped engine process (SIGSTOP) with a generation in it: after ATTNLENS_ENGINE_STALL_S it
    is killed and restarted; the request it held ends (503), and the next one is answered. An idle
    engine is never killed, however long it waits."""
    settings = Settings(model=tiny_checkpoint, device="cpu", warmup=False, engine_stall_s=1.0, **FAST)
    with TestClient(create_app(settings)) as c:
        engine = engine_of(c, tiny_checkpoint.name)
        time.sleep(1.5)  # idle for longer than the stall time: not a stall
        assert engine.state == "running"
        old_pid = engine.client.process.pid
        os.kill(old_pid, signal.SIGSTOP)
        t0 = time.monotonic()
        r = c.post("/generate", json={"prompt": "To be", "max_new_tokens": 20})
        assert r.status_code == 503 and r.json()["code"] == "engine_restarting", r.text
        assert time.monotonic() - t0 < 30
        assert "no progress" in (engine.detail or "") or engine.state == "running"
        wait_for(lambda: engine.state == "running", 60, "the restart")
        assert engine.client.process.pid != old_pid
        assert c.post("/generate", json={"prompt": "To be", "max_new_tokens": 2}).status_code == 200


def test_nothing_waits_on_the_pipe_of_a_stopped_engine_process(ckpt, tiny_checkpoint):
    """With the engine process stopped, a megabyte of commands is handed over at once: the pipe
    (64 KB) is written by the writer thread, never by the caller (the event loop)."""
    engine = EngineProcess(ckpt, model_dir=tiny_checkpoint, device="cpu", dtype="float32")
    os.kill(engine.client.process.pid, signal.SIGSTOP)
    try:
        done = threading.Event()

        def flood():
            for _ in range(16):
                engine.client._writer.put(b"x" * 65536)  # the engine process logs and ignores what is no command
            done.set()

        threading.Thread(target=flood, daemon=True).start()
        assert done.wait(10), "sending to a stopped engine process blocked the caller"
    finally:
        os.kill(engine.client.process.pid, signal.SIGCONT)
    try:
        async def one():
            return await drain(engine.submit(GenerationParams(ckpt.tokenizer.encode("To be"), 3,
                                                              SamplingParams(temperature=0.0))))

        tokens, last = run_async(one())
        assert last.finish_reason == "length" and len(tokens) == 3  # the pipe caught up, in order
    finally:
        engine.close()

"""Graceful shutdown (app/server/shutdown.py, app/server/uvicorn_server.py), in this process: the server `attnlens serve`
runs (uvicorn, the drain on SIGTERM) on a loopback port, with its engine on a thread whose model
the test holds, so a generation is mid-stream exactly when the SIGTERM comes."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest
from helpers import HeldModel, run_async, sse_events
from live_server import free_port

from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.app.server.uvicorn_server import build_server

PROMPT = {"prompt": "To be", "max_new_tokens": 20, "temperature": 0, "stream": True}


def serve_in_process(tiny_checkpoint, scenario, **settings):
    """Run `scenario(app, server, task, base_url)` beside the real server, in one event loop."""
    s = Settings(model=tiny_checkpoint, device="cpu", warmup=False, engine_process=False, host="127.0.0.1",
                 port=free_port(), **settings)
    app = create_app(s)
    server = build_server(app, s)

    async def main():
        task = asyncio.create_task(server.serve())
        for _ in range(1000):
            if server.started or task.done():
                break
            await asyncio.sleep(0.02)
        assert server.started, task.result()
        try:
            return await scenario(app, server, task, f"http://127.0.0.1:{s.port}")
        finally:
            if not task.done():
                server.should_exit = True
                await asyncio.wait_for(task, 30)

    return run_async(main())


async def read_events(lines, until: str | None = None) -> list[tuple[str, dict]]:
    """(event, data) pairs from a stream's lines, to its end or through the first `until` event."""
    out, block = [], []
    async for line in lines:
        block.append(line)
        if line == "":
            for name, data in sse_events(block):
                out.append((name, json.loads(data)))
            block = []
            if until is not None and out and out[-1][0] == until:
                break
    return out


async def wait_for(condition, what: str, limit: int = 1500) -> None:
    for _ in range(limit):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def test_sigterm_refuses_new_requests_and_lets_a_running_stream_finish(tiny_checkpoint):
    async def scenario(app, server, task, base_url):
        state = app.state.attnlens
        engine = state.registry.get(None).runner
        model = engine.client.core.model = HeldModel(engine.client.core.model, hold_at=3)  # two tokens out, then held
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client, \
                httpx.AsyncClient(base_url=base_url, timeout=30) as other:
            assert (await other.get("/readyz")).status_code == 200  # a kept-alive connection, used again below
            async with client.stream("POST", "/generate", json=PROMPT) as stream:
                lines = stream.aiter_lines()
                first = await read_events(lines, until="token")
                assert first[-1][0] == "token"
                assert await asyncio.to_thread(model.held.wait, 30)

                server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
                await wait_for(lambda: state.drain.draining, "draining")

                ready = await other.get("/readyz")
                assert ready.status_code == 503 and ready.json()["status"] == "draining"
                refused = await other.post("/generate", json={**PROMPT, "stream": False})
                assert refused.status_code == 503 and refused.json()["code"] == "shutting_down"
                assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
                async with httpx.AsyncClient(base_url=base_url, timeout=30) as fresh:
                    v1 = await fresh.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2})
                    assert v1.status_code == 503 and v1.json()["error"]["code"] == "shutting_down"
                    assert (await fresh.get("/healthz")).status_code == 200  # alive: no restart mid-drain
                    metrics = await fresh.get("/metrics")
                    assert metrics.status_code == 200 and 'attnlens_requests_in_flight{model="tiny"} 1.0' in metrics.text
                assert not task.done() and engine.alive  # the stream holds the server up

                model.release.set()
                rest = await read_events(lines)
            tokens = [e for e in first + rest if e[0] == "token"]
            assert [e[0] for e in rest][-1] == "done", rest[-3:]
            done = rest[-1][1]
            assert done["usage"]["completion_tokens"] == len(tokens) and done["finish_reason"] in ("length", "stop")
            await asyncio.wait_for(task, 30)  # drained: the server stops by itself
        assert state.drain.active == 0
        assert not engine.alive  # the lifespan closed the engine after the drain
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(base_url=base_url, timeout=5) as late:
                await late.get("/healthz")

    serve_in_process(tiny_checkpoint, scenario, shutdown_grace_s=60)


def test_a_stream_still_running_after_the_grace_period_ends_with_an_error_event(tiny_checkpoint):
    async def scenario(app, server, task, base_url):
        state = app.state.attnlens
        engine = state.registry.get(None).runner
        # held until the engine closes: a generation longer than the grace period
        model = engine.client.core.model = HeldModel(engine.client.core.model, hold_at=3, give_up=lambda: engine.admission.closed)
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            async with client.stream("POST", "/generate", json=PROMPT) as stream:
                lines = stream.aiter_lines()
                first = await read_events(lines, until="token")
                assert await asyncio.to_thread(model.held.wait, 30)
                server.handle_exit(signal.SIGTERM, None)
                rest = await read_events(lines)  # ends: the protocol's error event, not a cut connection
            assert first[-1][0] == "token"
            assert rest[-1][0] == "error" and rest[-1][1]["message"] == "the server is shutting down", rest[-3:]
            assert rest[-1][1]["code"] == "shutting_down"
            await asyncio.wait_for(task, 30)
        assert not engine.alive

    serve_in_process(tiny_checkpoint, scenario, shutdown_grace_s=0.2)


def test_sigint_stops_at_once_and_a_second_sigterm_ends_the_grace_period(tiny_checkpoint):
    """Ctrl-C keeps uvicorn's own meaning (stop now, no drain); a second SIGTERM during a drain
    ends its grace period: the stream still running gets its error event at once."""

    async def scenario(app, server, task, base_url):
        server.handle_exit(signal.SIGINT, None)
        await asyncio.wait_for(task, 30)
        assert not app.state.attnlens.drain.draining

    serve_in_process(tiny_checkpoint, scenario)

    async def twice(app, server, task, base_url):
        engine = app.state.attnlens.registry.get(None).runner
        model = engine.client.core.model = HeldModel(engine.client.core.model, hold_at=3, give_up=lambda: engine.admission.closed)
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            async with client.stream("POST", "/generate", json=PROMPT) as stream:
                lines = stream.aiter_lines()
                await read_events(lines, until="token")
                assert await asyncio.to_thread(model.held.wait, 30)
                server.handle_exit(signal.SIGTERM, None)
                await wait_for(lambda: app.state.attnlens.drain.draining, "draining")
                server.handle_exit(signal.SIGTERM, None)  # the grace period is 60 s: this one does not wait for it
                rest = await read_events(lines)
            assert rest[-1][0] == "error" and rest[-1][1]["message"] == "the server is shutting down", rest[-3:]
            assert rest[-1][1]["code"] == "shutting_down"
            await asyncio.wait_for(task, 30)
        assert not engine.alive

    serve_in_process(tiny_checkpoint, twice, shutdown_grace_s=60)

"""Two real replicas (`attnlens serve` on two loopback ports) behind Debian's nginx running the
shipped configuration (deploy/nginx, via nginx_front.py), driven over TCP by httpx and by the
official `openai` client: streams pass token by token, /attention and the OpenAI routes work,
a killed replica costs only the streams it held, and a SIGTERM'd replica drains without
cutting one.

The replicas serve a tiny random model that never samples EOS, with a 2048-token context, so a
long generation holds its slot for seconds; both need an API key, which nginx passes through.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
from helpers import child_pids, never_eos_checkpoint, run_async, sse_events
from live_server import free_port, live_server
from nginx_front import NGINX, nginx_front

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(NGINX is None, reason="needs Debian's nginx (apt-get install nginx; .ci/run does)")]

KEY = "replica-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny2k"
LONG = 1000  # tokens: a stream this long still runs when the test acts on it
BACKLOG = 8_000_000  # bytes of a stream its client may leave unread (ATTNLENS_MAX_STREAM_BACKLOG_BYTES)
ENV = {"ATTNLENS_API_KEY": KEY, "ATTNLENS_MAX_CONCURRENT": "8", "ATTNLENS_MAX_QUEUE": "16",
       "ATTNLENS_MAX_NEW_TOKENS": str(LONG), "ATTNLENS_SHUTDOWN_GRACE_S": "120", "OMP_NUM_THREADS": "1",
       "ATTNLENS_MAX_STREAM_BACKLOG_BYTES": str(BACKLOG), "ATTNLENS_LOG_LEVEL": "info"}


class Replicas:
    """Two replicas on fixed ports behind one nginx; `revive()` starts again any that stopped."""

    def __init__(self, ckpt: Path, tmp: Path):
        self.ckpt, self.tmp = ckpt, tmp
        self.ports = [free_port(), free_port()]
        self.stacks: list[ExitStack | None] = [None, None]
        self.servers = [None, None]

    def start(self, i: int) -> None:
        stack = ExitStack()
        self.servers[i] = stack.enter_context(live_server(self.ckpt, self.tmp, env=ENV, port=self.ports[i]))
        self.stacks[i] = stack

    def revive(self) -> bool:
        """Start again the replicas that are gone; True if any was."""
        revived = False
        for i, server in enumerate(self.servers):
            if server is None or server.process.poll() is not None:
                if self.stacks[i] is not None:
                    self.stacks[i].close()
                self.start(i)
                revived = True
        return revived

    def close(self) -> None:
        for stack in self.stacks:
            if stack is not None:
                stack.close()

    def metric(self, i: int, name: str) -> float:
        text = httpx.get(self.servers[i].base_url + "/metrics", headers=AUTH, timeout=30).text
        for line in text.splitlines():
            if line.startswith(f'{name}{{model="{MODEL}"}} '):
                return float(line.split()[-1])
        raise AssertionError(f"{name} not in replica {i}'s /metrics")

    def held(self, i: int) -> int:
        """Generations replica i runs or queues now."""
        return int(self.metric(i, "attnlens_generations_running_or_waiting"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ckpt = never_eos_checkpoint(tmp_path_factory.mktemp("replicas") / MODEL, context_length=2048)
    replicas = Replicas(ckpt, tmp_path_factory.mktemp("replica-logs"))
    try:
        replicas.revive()
        with nginx_front(tmp_path_factory.mktemp("nginx"), replicas.ports) as nginx:
            replicas.nginx = nginx
            yield replicas
    finally:
        replicas.close()


@pytest.fixture
def replicas(cluster):
    start = time.monotonic()
    if cluster.revive() and getattr(cluster, "nginx", None) is not None:
        # nginx took the dead replica out for the upstream's fail_timeout (10 s, max_fails=1):
        # wait that out from before the restart, so the next test finds both replicas in turn
        time.sleep(max(0.0, 10.5 - (time.monotonic() - start)))
    return cluster


async def open_stream(client: httpx.AsyncClient, max_new_tokens: int = LONG, prompt: str = "To be"):
    """A /generate stream through nginx, read up to its first token event: (response, lines, events)."""
    request = client.build_request("POST", "/generate", json={"prompt": prompt, "max_new_tokens": max_new_tokens,
                                                             "temperature": 0, "stream": True})
    response = await client.send(request, stream=True)
    assert response.status_code == 200, await response.aread()
    lines = response.aiter_lines()
    events = await read_events(lines, until="token")
    assert events and events[-1][0] == "token"
    return response, lines, events


async def read_events(lines, until: str | None = None) -> list[tuple[str, dict]]:
    out, block = [], []
    async for line in lines:
        block.append(line)
        if line == "":
            out += [(name, json.loads(data)) for name, data in sse_events(block)]
            block = []
            if until is not None and out and out[-1][0] == until:
                break
    return out


async def finish(stream) -> tuple[str, list]:
    """Read a stream to its end: ("done", events) or ("error", events) if it ended otherwise."""
    response, lines, events = stream
    try:
        events += await read_events(lines)
    except httpx.HTTPError:  # the connection ended mid-answer (nginx closes it when its replica dies)
        return "error", events
    finally:
        await response.aclose()
    return ("done" if events[-1][0] == "done" else "error"), events


async def quick_requests(client: httpx.AsyncClient, oai: openai.AsyncOpenAI, n: int) -> list[str]:
    """n small requests of every kind through nginx; what went wrong with each (empty: all fine)."""
    async def one(k: int) -> str | None:
        kind = k % 4
        if kind == 0:
            r = await client.post("/generate", json={"prompt": "To be", "max_new_tokens": 4, "temperature": 0})
            return None if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4 else r.text
        if kind == 1:
            try:
                stream = await open_stream(client, max_new_tokens=4)
            except AssertionError as e:
                return f"stream: {e}"
            outcome, events = await finish(stream)
            return None if outcome == "done" else f"stream ended with {events[-1:]}"
        if kind == 2:
            r = await client.post("/attention", json={"text": "To be, or not", "layers": [0], "heads": [0]})
            return None if r.status_code == 200 else r.text
        c = await oai.completions.create(model=MODEL, prompt="To be", max_tokens=4, temperature=0)
        return None if c.choices[0].finish_reason == "length" else str(c)

    results = await asyncio.gather(*(one(k) for k in range(n)), return_exceptions=True)
    return [repr(r) for r in results if r is not None]


def clients(base_url: str):
    return (httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=120),
            openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=120))


def engine_processes(replicas) -> list[int]:
    pids = [pid for server in replicas.servers for pid in child_pids(server.process.pid)
            if Path(f"/proc/{pid}/comm").read_text().strip() == "attnlens-engine"]
    assert len(pids) == 2, pids
    return pids


def test_a_stream_arrives_token_by_token_not_buffered(replicas):
    """The second token event of a short stream (its whole answer, some 3 kB, would fit one of
    nginx's buffers) reaches the client while its generation still runs: the moment it
    arrives, the test freezes both replicas' engine processes (SIGSTOP), and the replica still
    holds the generation, 18 tokens from its end. So nothing between the model and the client
    (the server's writer, its compression, nginx) holds events back until the answer ends.
    (nginx 1.22 passes on what it has whenever its replica pauses, even with proxy_buffering on;
    what `proxy_buffering off` changes is the next test's.)"""

    async def scenario():
        engines = engine_processes(replicas)
        client, _ = clients(replicas.nginx.base_url)
        async with client:
            response, lines, events = await open_stream(client, max_new_tokens=20)
            assert response.headers["content-type"].startswith("text/event-stream")
            assert "content-length" not in response.headers  # chunked, as it goes
            block = []
            try:
                async for line in lines:  # up to the second token event, then freeze at once
                    block.append(line)
                    if line == "" and any(name == "token" for name, _ in sse_events(block)):
                        for pid in engines:
                            os.kill(pid, signal.SIGSTOP)
                        break
                second = list(sse_events(block))
                assert [name for name, _ in second] == ["token"] and json.loads(second[0][1])["index"] == 1
                held = [await asyncio.to_thread(replicas.held, i) for i in (0, 1)]
                assert sorted(held) == [0, 1], held  # still running (frozen): not done when its event came
            finally:
                for pid in engines:
                    os.kill(pid, signal.SIGCONT)
            outcome, rest = await finish((response, lines, []))
            tokens = [e for name, e in events + rest if name == "token"]
            assert outcome == "done" and len(tokens) == 19 and rest[-1][1]["usage"]["completion_tokens"] == 20

    run_async(scenario())


def test_a_client_that_stops_reading_is_felt_by_its_replica(replicas):
    """Unbuffered, nginx reads a stream from the replica only as fast as the client takes it:
    a client that reads nothing makes the replica's per-stream backlog bound apply (the
    generation ends, its KV row freed) once the sockets between them are full. A buffering
    nginx would instead spool the whole stream (some 30 MB of attention rows) to its disk while
    the replica ran the generation to its end for nobody."""

    async def scenario():
        client, _ = clients(replicas.nginx.base_url)
        async with client:
            prompt = "To be, or not to be, that is the question. " * 50  # 1300 tokens: rows of 1300+ keys
            request = client.build_request("POST", "/generate", json={
                "prompt": prompt, "max_new_tokens": 300, "temperature": 0, "stream": True, "return_attention": True})
            response = await client.send(request, stream=True)
            assert response.status_code == 200
            for _ in range(1200):  # read nothing until the replicas hold no generation any more
                if sum([await asyncio.to_thread(replicas.held, i) for i in (0, 1)]) == 0:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the generation never ended")
            events = await read_events(response.aiter_lines())
            await response.aclose()
        name, data = events[-1]
        assert name == "error" and "ATTNLENS_MAX_STREAM_BACKLOG_BYTES" in data["message"], (name, len(events))
        assert len([e for e in events if e[0] == "token"]) < 300

    run_async(scenario())


def test_attention_and_the_openai_client_through_nginx(replicas):
    async def scenario():
        client, oai = clients(replicas.nginx.base_url)
        direct, direct_oai = clients(replicas.servers[0].base_url)
        async with client, direct:
            body = {"text": "To be, or not to be, that is the question", "layers": [0, 1]}
            through, alone = await client.post("/attention", json=body), await direct.post("/attention", json=body)
            assert through.status_code == 200 and through.json() == alone.json()  # same weights, same maps

            c = await oai.completions.create(model=MODEL, prompt="To be", max_tokens=12, temperature=0, logprobs=2)
            d = await direct_oai.completions.create(model=MODEL, prompt="To be", max_tokens=12, temperature=0,
                                                    logprobs=2)
            assert c.choices[0].text == d.choices[0].text and c.choices[0].finish_reason == "length"
            pieces = [chunk.choices[0].text async for chunk in await oai.completions.create(
                model=MODEL, prompt="To be", max_tokens=12, temperature=0, stream=True) if chunk.choices]
            assert len(pieces) >= 12 and "".join(pieces) == c.choices[0].text  # streamed through, piece by piece

            # nginx passes Authorization through; without it the replica refuses
            async with httpx.AsyncClient(base_url=replicas.nginx.base_url, timeout=60) as anonymous:
                r = await anonymous.post("/generate", json={"prompt": "x"})
            assert r.status_code == 401 and r.json()["code"] == "invalid_api_key"
            # over the body limit: nginx refuses it itself, in the service's JSON shape
            r = await client.post("/generate", content=b'{"prompt": "' + b"x" * 1_000_001 + b'"}',
                                  headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["code"] == "body_too_large"

    run_async(scenario())


def test_a_killed_replica_costs_only_the_streams_it_held(replicas):
    """Six long streams spread over both replicas; replica 0 (its server and engine process) is
    killed: exactly the streams it held end with an error, the others run to their done event,
    and new requests of every kind all succeed, on replica 1."""

    async def scenario():
        client, oai = clients(replicas.nginx.base_url)
        async with client:
            streams = [await open_stream(client, prompt=f"To be {k}") for k in range(6)]
            held = await asyncio.to_thread(replicas.held, 0)
            assert 1 <= held <= 5, held  # nginx spread them (least_conn)
            victim = replicas.servers[0].process
            for pid in [victim.pid, *child_pids(victim.pid)]:
                os.kill(pid, signal.SIGKILL)
            victim.wait(30)
            failures = await quick_requests(client, oai, 12)
            outcomes = await asyncio.gather(*(finish(s) for s in streams))
        assert failures == []
        ended = [o for o, _ in outcomes]
        assert ended.count("error") == held and ended.count("done") == 6 - held, ended
        for outcome, events in outcomes:
            if outcome == "done":
                assert events[-1][1]["usage"]["completion_tokens"] == LONG

    run_async(scenario())


def test_a_sigtermed_replica_drains_without_cutting_a_stream(replicas):
    """Replica 0 gets SIGTERM with streams running: every stream, its own included, runs to its
    done event; new requests meanwhile all succeed (its 503s are retried on replica 1 by nginx);
    then it exits by itself, with status 0."""

    async def scenario():
        client, oai = clients(replicas.nginx.base_url)
        async with client:
            streams = [await open_stream(client, max_new_tokens=300, prompt=f"Or not {k}") for k in range(4)]
            held = await asyncio.to_thread(replicas.held, 0)
            assert held >= 1
            engine = child_pids(replicas.servers[0].process.pid)
            replicas.servers[0].process.send_signal(signal.SIGTERM)
            for _ in range(100):  # the signal is handled between two steps of its event loop
                ready = await client.get(replicas.servers[0].base_url + "/readyz")
                if ready.status_code == 503:
                    break
                await asyncio.sleep(0.1)
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            failures = await quick_requests(client, oai, 12)
            outcomes = await asyncio.gather(*(finish(s) for s in streams))
        assert failures == []
        assert [o for o, _ in outcomes] == ["done"] * 4
        assert all(events[-1][1]["usage"]["completion_tokens"] == 300 for _, events in outcomes)
        process = replicas.servers[0].process
        assert await asyncio.to_thread(process.wait, 60) == 0, replicas.servers[0].log()[-3000:]
        assert "drained: no request is running" in replicas.servers[0].log()
        assert engine and not any(Path(f"/proc/{pid}").exists() for pid in engine)  # closed, after the drain

    run_async(scenario())

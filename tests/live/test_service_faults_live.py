"""Issue 24 against a real `attnlens serve` over TCP (loopback only, bounded loops), serving a
decoder, an encoder and a translator (tiny, random), each generating model in its own engine
process:

- each engine process killed (SIGKILL) with streams in it: those streams end with an error
  event, nothing hangs, the other models keep answering, and the dead one answers again
  within a few seconds;
- an engine process stopped (SIGSTOP) while more requests than its pipe holds arrive (and the
  issue's 480 KB stop strings): /healthz keeps answering; the watchdog restarts the engine;
- inputs that used to be tokenised on the event loop (900 KB texts, 150,000 prompts) do not
  stall /healthz;
- headers over ATTNLENS_MAX_HEADER_BYTES get a 431; a stream whose client leaves counts as 499
  and as a cancelled generation;
- 64 clients that read nothing of streams with attention and logprobs: the server's memory stays
  within ATTNLENS_MAX_STREAM_BACKLOG_TOTAL_BYTES, and comes back once they leave.

/healthz latencies are measured by a probe in a process of its own; the bound asserted (0.5 s)
has room for a loaded CI machine, far below the seconds the old code stalled for; the figures
are printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import make_tiny_checkpoint
from encoder_helpers import make_tiny_encoder
from helpers import parse_sse, run_async
from live_server import live_server
from test_service_reliability_live import PROBE, host_port, raw_request, rss_bytes
from translator_helpers import make_tiny_translator

pytestmark = pytest.mark.slow

HEALTHZ_BOUND_S = 0.5
STALL_S = 4.0
BACKLOG_TOTAL = 32_000_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults-live")
    decoder = make_tiny_checkpoint(root / "dec", context_length=256, n_layers=4, n_heads=8, d_model=64)
    encoder = make_tiny_encoder(root / "enc")
    translator = make_tiny_translator(root / "tr")
    env = {"ATTNLENS_MODELS": f"{decoder},{encoder},{translator}", "ATTNLENS_LOG_LEVEL": "info",
           "OMP_NUM_THREADS": "1", "ATTNLENS_MAX_CONCURRENT": "64", "ATTNLENS_MAX_NEW_TOKENS": "200",
           "ATTNLENS_ENGINE_RESTART_BACKOFF_S": "0.1", "ATTNLENS_ENGINE_STALL_S": str(STALL_S),
           "ATTNLENS_MAX_STREAM_BACKLOG_TOTAL_BYTES": str(BACKLOG_TOTAL)}
    with live_server(decoder, root, env=env) as s:
        yield s


def pid_of(server, model: str) -> int:
    """The live engine process of `model`: the latest one the log says loads it (the server runs
    at log level info for this)."""
    import re

    pids = [int(pid) for pid, path in re.findall(r"\[engine (\d+)\] attnlens.loader: loading checkpoint (\S+)",
                                                 server.log()) if path.endswith(f"/{model}")]
    for pid in reversed(pids):
        if os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
            return pid
    raise AssertionError(f"no engine process runs {model}")


def start_probe(base_url: str, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROBE, base_url, str(seconds)], stdout=subprocess.PIPE, text=True)


def probe_result(probe: subprocess.Popen) -> list[float]:
    return json.loads(probe.communicate(timeout=120)[0])


def test_each_engine_killed_mid_stream_heals_and_the_others_keep_answering(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        for model, prompt in [("dec", "To be, or not"), ("tr", "ninety-seven")]:
            pid = pid_of(server, model)
            os.kill(pid, signal.SIGSTOP)  # streams are admitted and sent to it, then it dies under them

            async def streams():
                async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as ac:
                    async def one():
                        r = await ac.post("/generate", json={"model": model, "prompt": prompt, "stream": True,
                                                             "max_new_tokens": 40, "return_attention": True})
                        return r.status_code, parse_sse(r.text)

                    tasks = [asyncio.create_task(one()) for _ in range(3)]
                    await asyncio.sleep(0.5)
                    os.kill(pid, signal.SIGKILL)
                    return await asyncio.wait_for(asyncio.gather(*tasks), 60)  # none hangs

            t0 = time.monotonic()
            results = run_async(streams())
            for status, events in results:
                assert status == 200 and events[-1][0] == "error", events[-1:]
                assert json.loads(events[-1][1])["code"] == "engine_restarting"
            # the others answer while it restarts (or after, on a fast machine)
            other = "tr" if model == "dec" else "dec"
            assert c.post("/generate", json={"model": other, "prompt": "To be", "max_new_tokens": 3}).status_code == 200
            assert c.post("/classify", json={"text": "To be"}).status_code == 200
            while True:  # the dead model answers again
                r = c.post("/generate", json={"model": model, "prompt": prompt, "max_new_tokens": 3})
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and time.monotonic() - t0 < 60, r.text
                time.sleep(0.2)
            healed = time.monotonic() - t0
            assert pid_of(server, model) != pid
            ready = c.get("/readyz").json()
            assert ready["ready"] and ready["models"][model]["restarts"] >= 1
            print(f"\n{model}: killed with 3 streams in it, answering again {healed:.1f} s after the kill")


def test_a_stopped_engine_never_stalls_the_event_loop(server):
    """SIGSTOP the decoder's engine process and send the issue's request (4 x 120 KB stop strings:
    a 422 now) and 64 requests whose commands together overfill its pipe: /healthz answers
    throughout; after ATTNLENS_ENGINE_STALL_S the watchdog restarts the engine, and every
    request has its answer (none hangs)."""
    pid = pid_of(server, "dec")
    stops = ["a" * 250 + str(i) for i in range(4)]
    prompt = "To be, or not to be, that is the question " * 4

    async def load():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                     limits=httpx.Limits(max_connections=80)) as ac:
            issue = await ac.post("/generate", json={"prompt": "To be", "stop": ["ab" * 60000] * 4})
            many = [ac.post("/generate", json={"prompt": prompt, "stop": stops, "max_new_tokens": 150})
                    for _ in range(64)]
            return issue.status_code, [r.status_code for r in await asyncio.gather(*many)]

    probe = start_probe(server.base_url, 3.0)
    time.sleep(0.3)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        issue_status, statuses = run_async(load())
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    answered = time.monotonic() - t0
    latencies = probe_result(probe)
    print(f"\n/healthz while the engine was stopped: {len(latencies)} probes, max {max(latencies) * 1000:.1f} ms; "
          f"64 requests all answered after {answered:.1f} s ({statuses.count(503)} x 503, {statuses.count(200)} x 200)")
    assert issue_status == 422
    assert max(latencies) < HEALTHZ_BOUND_S, latencies
    assert set(statuses) <= {200, 503} and statuses.count(503) > 0  # the watchdog ended what the stopped one held
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        deadline = time.monotonic() + 60
        while c.post("/generate", json={"prompt": "To be", "max_new_tokens": 2}).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_large_inputs_never_stall_healthz(server):
    big = "a" * 900_000
    jobs = [("/classify", {"text": big}), ("/fill-mask", {"text": big + " [MASK]"}),
            ("/attention", {"model": "tr", "text": "ninety-seven", "target": big}),
            ("/v1/completions", {"model": "dec", "prompt": ["a"] * 150000, "max_tokens": 1}),
            ("/v1/completions", {"model": "dec", "prompt": ["To be, or not to be"] * 64, "max_tokens": 1})]
    probe = start_probe(server.base_url, 3.0)
    time.sleep(0.3)
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        statuses = []
        for _ in range(3):
            for path, body in jobs:
                statuses.append(c.post(path, json=body).status_code)
    latencies = probe_result(probe)
    print(f"\n/healthz during 900 KB texts and 150,000-prompt lists: max {max(latencies) * 1000:.1f} ms")
    assert statuses[:5] == [400, 400, 400, 422, 200], statuses
    assert max(latencies) < HEALTHZ_BOUND_S, latencies


def test_headers_over_the_limit_get_431(server):
    with socket.create_connection(host_port(server)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        s.settimeout(10)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 431 ") and b"ATTNLENS_MAX_HEADER_BYTES" in data, data[:200]
    with socket.create_connection(host_port(server)) as s:  # ordinary headers are fine
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Ok: " + b"a" * 8000 + b"\r\n\r\n")
        s.settimeout(10)
        assert s.recv(64).startswith(b"HTTP/1.1 200 ")


def test_a_stream_its_client_leaves_counts_as_499_and_cancelled(server):
    def counts(text: str) -> tuple[float, float]:
        s499 = sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith('attnlens_http_requests_total{') and 'route="/generate"' in line
                   and 'status="499"' in line)
        cancelled = sum(float(line.split()[-1]) for line in text.splitlines()
                        if line.startswith('attnlens_generations_total{') and 'finish_reason="cancelled"' in line)
        return s499, cancelled

    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        before = counts(c.get("/metrics").text)
        pid = pid_of(server, "dec")
        os.kill(pid, signal.SIGSTOP)
        try:
            with c.stream("POST", "/generate", json={"prompt": "To be", "max_new_tokens": 50, "stream": True}) as r:
                assert r.status_code == 200  # the answer began; its client leaves before any event
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while (after := counts(c.get("/metrics").text)) == before:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(0.5)
        after = counts(c.get("/metrics").text)
    assert after[0] == before[0] + 1 and after[1] >= before[1] + 1, (before, after)


def test_memory_of_unread_streams_is_bounded_and_comes_back(server):
    """64 clients ask for streams with attention and logprobs, then read nothing: the server's RSS
    stays within the streams' total budget (plus its working set), and comes back within a
    small margin once they leave, after the first burst and after the next.

    What used to stay (tens of MB): Python's small-object arenas, which stay mapped while any
    object in them lives, filled by a Python float for every attention probability of the events
    that the writers of unread streams held; and the events of streams cancelled when their
    clients left, kept by frames in a CancelledError's traceback that anyio's task group keeps in
    a reference cycle until the cyclic GC runs. Events hold arrays now, and a writer holds none
    while it waits (tests/engine/test_stream_budget.py, tests/api/test_stream_events.py)."""
    host, port = host_port(server)
    body = json.dumps({"model": "dec", "prompt": "To be, or not", "max_new_tokens": 200, "stream": True,
                       "return_attention": True, "logprobs": 20}).encode()

    def burst(c) -> tuple[int, int]:
        """64 unread streams until every generation has ended (finished, or shed by the budget), then
        the clients leave: (peak RSS, RSS 3 s later)."""
        socks = []
        try:
            for _ in range(64):
                s = socket.create_connection((host, port))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.sendall(raw_request("/generate", body))
                socks.append(s)
            peak, deadline = 0, time.monotonic() + 90
            while True:
                peak = max(peak, rss_bytes(server.process.pid))
                text = c.get("/metrics").text
                running = [line for line in text.splitlines() if line.startswith("attnlens_requests_in_flight{")]
                if running and float(running[0].split()[-1]) == 0:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.2)
            time.sleep(1)
            peak = max(peak, rss_bytes(server.process.pid))
        finally:
            for s in socks:
                s.close()
        time.sleep(3)  # the routes let go of their generations
        return peak, rss_bytes(server.process.pid)

    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        c.post("/generate", json=json.loads(body))  # warm: the first answer's allocations are not the clients'
        time.sleep(1)
        quiet = rss_bytes(server.process.pid)
        first_peak, baseline = burst(c)
        peak, after = burst(c)
        assert c.get("/healthz").status_code == 200
    print(f"\nRSS with 64 unread streams (attention + logprobs 20): quiet {quiet / 1e6:.0f} MB, first burst peak "
          f"{first_peak / 1e6:.0f} MB and after {baseline / 1e6:.0f} MB; second burst peak {peak / 1e6:.0f} MB, "
          f"after they left {after / 1e6:.0f} MB (budget {BACKLOG_TOTAL / 1e6:.0f} MB)")
    assert first_peak - quiet < BACKLOG_TOTAL + 100_000_000, (quiet, first_peak)
    assert baseline - quiet < 60_000_000, (quiet, baseline)
    assert peak - baseline < BACKLOG_TOTAL + 100_000_000, (baseline, peak)
    assert after - baseline < 60_000_000, (baseline, after)
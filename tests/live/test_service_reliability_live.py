"""Issue 11 against a real `attnlens serve` over TCP (loopback only, bounded loops):

- slow readers of /attention: many clients ask for ~18 MB JSON answers and read nothing;
  the server's RSS stays under a bound set by ATTNLENS_MAX_ANSWER_BYTES, the clients over
  the budget get 429 after ATTNLENS_ANSWER_WAIT_S, the stalled ones are dropped after
  ATTNLENS_SEND_TIMEOUT_S, and then answers flow again;
- /healthz answers in under 100 ms while large answers are encoded and compressed;
- request read timeouts: a slow body gets 408, partial headers and idle connections are
  closed (ATTNLENS_BODY_TIMEOUT_S, ATTNLENS_HEADER_TIMEOUT_S).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from conftest import make_tiny_checkpoint
from helpers import rss_bytes, run_async
from live_server import live_server

pytestmark = pytest.mark.slow

T = 250  # tokens per /attention request: 4 x 8 x 250 x 250 cells, ~18 MB of JSON
BUDGET = 80_000_000  # ATTNLENS_MAX_ANSWER_BYTES: two such answers (each claims ~29 MB)
SLOW_READERS = 24
SEND_TIMEOUT = 6.0
HEADER_TIMEOUT, BODY_TIMEOUT = 2.0, 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("rel-live") / "wide", context_length=256, n_layers=4,
                                n_heads=8, d_model=32)
    env = {"ATTNLENS_MAX_ANSWER_BYTES": str(BUDGET), "ATTNLENS_ANSWER_WAIT_S": "1",
           "ATTNLENS_SEND_TIMEOUT_S": str(SEND_TIMEOUT), "ATTNLENS_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT),
           "ATTNLENS_BODY_TIMEOUT_S": str(BODY_TIMEOUT), "ATTNLENS_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"}
    with live_server(ckpt, tmp_path_factory.mktemp("rel-live-logs"), env=env) as s:
        yield s


def host_port(server) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def raw_request(path: str, body: bytes, *, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Accept-Encoding: identity\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


PROBE = """
import json, sys, time, httpx
url, seconds = sys.argv[1], float(sys.argv[2])
out, end = [], time.monotonic() + seconds
with httpx.Client(base_url=url, timeout=30) as c:
    while time.monotonic() < end:
        t0 = time.perf_counter()
        assert c.get("/healthz").status_code == 200
        out.append(time.perf_counter() - t0)
        time.sleep(0.05)
print(json.dumps(out))
"""


def start_probe(base_url: str, seconds: float):
    """GET /healthz every 50 ms for `seconds` from a process of its own, so that the load's
    client work (reading and un-gzipping megabytes) never delays the probe itself."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", PROBE, base_url, str(seconds)], stdout=subprocess.PIPE, text=True)


def test_slow_readers_of_attention_keep_memory_bounded(server):
    ids = [(7 * i) % 250 + 1 for i in range(T)]
    body = json.dumps({"ids": ids, "format": "json"}).encode()
    host, port = host_port(server)
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        assert c.post("/attention", json={"ids": ids, "format": "json"}).status_code == 200  # warm
        baseline = rss_bytes(server.process.pid)
        socks = []
        try:
            for _ in range(SLOW_READERS):  # ask, then never read
                s = socket.create_connection((host, port))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.sendall(raw_request("/attention", body))
                socks.append(s)
            peak = baseline
            probe = start_probe(server.base_url, 4.0)
            deadline = time.monotonic() + 4  # the 429s come after ATTNLENS_ANSWER_WAIT_S = 1
            while time.monotonic() < deadline:
                peak = max(peak, rss_bytes(server.process.pid))
                time.sleep(0.05)
            latencies = json.loads(probe.communicate(timeout=60)[0])
            # memory: the budget plus the process's own working set, not 24 x 18 MB
            assert peak - baseline < BUDGET + 60_000_000, (baseline, peak)
            assert max(latencies) < 0.1, latencies
            # those over the budget were told to come back later
            statuses = []
            for s in socks:
                s.settimeout(0.5)
                try:
                    statuses.append(s.recv(64).split(b" ")[1])
                except (TimeoutError, IndexError):
                    statuses.append(b"?")
            assert statuses.count(b"429") >= SLOW_READERS - 4, statuses
            assert statuses.count(b"200") >= 1, statuses
            # the stalled readers are dropped after ATTNLENS_SEND_TIMEOUT_S and their claims freed
            t0 = time.monotonic()
            while True:
                r = c.post("/attention", json={"ids": ids, "format": "json"}, headers={"Accept-Encoding": "gzip"})
                if r.status_code == 200:
                    break
                assert r.status_code == 429 and time.monotonic() - t0 < SEND_TIMEOUT + 10, r.text
                assert int(r.headers["retry-after"]) >= 1
                time.sleep(0.5)
            assert r.headers.get("content-encoding") == "gzip" and len(r.json()["attention"][0][0]) == T
        finally:
            for s in socks:
                s.close()
        print(f"\nRSS baseline {baseline / 1e6:.0f} MB, peak {peak / 1e6:.0f} MB with {SLOW_READERS} slow readers "
              f"(budget {BUDGET / 1e6:.0f} MB); /healthz max {max(latencies) * 1000:.1f} ms")


def test_healthz_fast_while_big_answers_are_encoded(server):
    ids = [(11 * i) % 250 + 1 for i in range(T)]

    async def load():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            async def fetch(fmt: str, enc: str):
                r = await c.post("/attention", json={"ids": ids, "format": fmt}, headers={"Accept-Encoding": enc})
                assert r.status_code in (200, 429), r.text
                return r.status_code

            mix = [fetch(fmt, enc) for fmt in ("json", "f16", "u8") for enc in ("gzip", "identity")] * 2
            mix.append(c.post("/generate", json={"prompt": "To be", "max_new_tokens": 40, "stream": True}))
            return await asyncio.gather(*mix)

    probe = start_probe(server.base_url, 4.0)
    time.sleep(0.5)  # the probe is up
    statuses = run_async(load())
    latencies = json.loads(probe.communicate(timeout=60)[0])
    assert statuses.count(200) >= 3
    latencies.sort()
    print(f"\n/healthz under a mix of 12 large answers: {len(latencies)} probes, median "
          f"{latencies[len(latencies) // 2] * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")
    assert latencies[-1] < 0.1, latencies


# --- defect 7: timeouts while reading a request -----------------------------------------------
def read_until_closed(s: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    s.settimeout(limit_s)
    t0, data = time.monotonic(), b""
    while True:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            raise AssertionError(f"connection still open after {limit_s} s; got {data!r}") from None
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk


def test_idle_connection_is_closed(server):
    with socket.create_connection(host_port(server)) as s:
        data, waited = read_until_closed(s, HEADER_TIMEOUT + 5)
    assert data == b"" and waited >= HEADER_TIMEOUT - 0.5


def test_partial_headers_get_408_and_close(server):
    with socket.create_connection(host_port(server)) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: appl")
        data, waited = read_until_closed(s, HEADER_TIMEOUT + 5)
    assert data.startswith(b"HTTP/1.1 408 ") and b"header_timeout" in data, data


def test_slow_body_gets_408_and_close(server):
    with socket.create_connection(host_port(server)) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        data, waited = read_until_closed(s, BODY_TIMEOUT + 5)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data
    assert b"connection: close" in head.lower() and b"ATTNLENS_BODY_TIMEOUT_S" in body
    assert waited < BODY_TIMEOUT + 3


def test_keep_alive_connection_serves_several_requests(server):
    with httpx.Client(base_url=server.base_url, timeout=10) as c:  # one pooled connection
        for _ in range(3):
            assert c.get("/healthz").status_code == 200
            time.sleep(0.5)
        r = c.post("/generate", json={"prompt": "To be", "max_new_tokens": 2})
        assert r.status_code == 200, r.text


# --- README: a bad checkpoint prints its message alone and exits 3 --------------------------
@pytest.mark.parametrize("make_bad", ["missing", "corrupt"])
def test_bad_checkpoint_one_line_and_exit_3(tmp_path, tiny_checkpoint, make_bad):
    import os
    import shutil
    import subprocess
    import sys

    from conftest import REPO_ROOT
    from live_server import free_port

    bad = tmp_path / "model"
    if make_bad == "corrupt":
        shutil.copytree(tiny_checkpoint, bad)
        (bad / "model.safetensors").write_bytes(b"not safetensors at all")
    proc = subprocess.run(
        [sys.executable, "-m", "attnlens.app.cli", "serve", "--model", str(bad), "--port", str(free_port())],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "ATTNLENS_DEVICE": "cpu", "ATTNLENS_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 3
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"attnlens: cannot load the model from {bad}"), lines
    assert "Traceback" not in proc.stderr

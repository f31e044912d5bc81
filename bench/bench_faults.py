"""Issue 24's figures, for this tree and (with --peer DIR) another one measured the same way in
the same run, alternating: `attnlens serve` on the three bundled models (CPU).

- start-up: seconds from launching `attnlens serve` to /readyz answering 200;
- a stopped engine: the decoder's engine process gets SIGSTOP, the issue's request (/generate
  with 4 stop strings of 120 KB) is sent, and /healthz is probed for 5 s (timeout 5 s each):
  the longest answer (a probe that timed out counts as 5000 ms);
- memory: 64 clients ask for streams with return_attention and logprobs 20 from the decoder and
  read nothing: the server's RSS before, at its peak, and 3 s after they close.

--peer takes a folder on PYTHONPATH whose `attnlens` package is the other tree (e.g. a
`git archive` of an older commit with attnlens/app and attnlens/model linked to its app/ and
model/); run it from that tree's root with --peer-cwd.

    .venv/bin/python bench/bench_faults.py --runs 3 --peer /tmp/old/pkg --peer-cwd /tmp/old/tree
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """A process that runs (neither gone nor a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Server:
    """`attnlens serve` on the default models (CPU, log level info: its engine processes are named
    in the log), on a free port; `env`: more settings."""

    def __init__(self, pythonpath: str | None, cwd: Path, log: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "ATTNLENS_DEVICE": "cpu", "ATTNLENS_LOG_LEVEL": "info", **(env or {})}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        self.log = log
        self.t0 = time.perf_counter()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "attnlens.app.cli", "serve", "--port", str(self.port)],
                                         env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> float:
        while True:
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text()[-2000:])
            time.sleep(0.02)

    def engine_pids(self) -> dict[str, int]:
        """The live engine process of each generating model, by its checkpoint folder's name (the
        latest one the log says loads it: a restart logs its new one)."""
        pids: dict[str, int] = {}
        for pid, path in re.findall(r"\[engine (\d+)\] attnlens.loader: loading checkpoint (\S+)", self.log.read_text()):
            if alive(int(pid)):
                pids[Path(path).name] = int(pid)
        return pids

    def decoder_engine_pid(self) -> int:
        return self.engine_pids()["default"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def stopped_engine_healthz_ms(server: Server) -> float:
    pid = server.decoder_engine_pid()
    os.kill(pid, signal.SIGSTOP)
    worst = 0.0
    try:
        sender = threading.Thread(target=lambda: _quietly(lambda: httpx.post(
            server.url + "/generate", json={"prompt": "To be", "stop": ["ab" * 60000] * 4}, timeout=10)), daemon=True)
        sender.start()
        time.sleep(0.3)
        end = time.monotonic() + 5
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                httpx.get(server.url + "/healthz", timeout=5)
                worst = max(worst, (time.perf_counter() - t0) * 1000)
            except httpx.HTTPError:
                worst = max(worst, 5000.0)
            time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGCONT)
    return worst


def _quietly(fn):
    try:
        fn()
    except Exception:
        pass


def unread_streams_rss(server: Server, clients: int = 64) -> tuple[float, float, float]:
    body = json.dumps({"prompt": "To be, or not", "max_new_tokens": 200, "stream": True, "return_attention": True,
                       "logprobs": 20}).encode()
    httpx.post(server.url + "/generate", content=body, headers={"content-type": "application/json"}, timeout=60)
    time.sleep(1)
    base = rss(server.proc.pid)
    socks = []
    for _ in range(clients):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        socks.append(s)
    peak, end = base, time.monotonic() + 40
    while time.monotonic() < end:  # until the generations are over (or 40 s)
        peak = max(peak, rss(server.proc.pid))
        try:
            metrics = httpx.get(server.url + "/metrics", timeout=5).text
        except httpx.HTTPError:  # a server too busy to answer: keep measuring
            continue
        running = [line for line in metrics.splitlines() if line.startswith("attnlens_requests_in_flight ")]
        if running and float(running[0].split()[-1]) == 0:
            break
        time.sleep(0.2)
    time.sleep(1)
    peak = max(peak, rss(server.proc.pid))
    for s in socks:
        s.close()
    time.sleep(3)
    return base / 1e6, peak / 1e6, rss(server.proc.pid) / 1e6


def measure(name: str, pythonpath: str | None, cwd: Path, logs: Path) -> dict:
    server = Server(pythonpath, cwd, logs / f"{name}-{time.time_ns()}.log")
    try:
        startup = server.wait_ready()
        healthz = stopped_engine_healthz_ms(server)
        base, peak, after = unread_streams_rss(server)
    finally:
        server.stop()
    return {"tree": name, "startup_s": round(startup, 2), "healthz_max_ms_engine_stopped": round(healthz, 1),
            "rss_mb": {"baseline": round(base), "peak": round(peak), "after": round(after)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--peer", help="PYTHONPATH folder of the other tree's attnlens package")
    ap.add_argument("--peer-cwd", type=Path, help="the other tree's root (its checkpoints/)")
    ap.add_argument("--logs", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    for _ in range(args.runs):
        print(json.dumps(measure("this", None, ROOT, args.logs)), flush=True)
        if args.peer:
            print(json.dumps(measure("peer", args.peer, args.peer_cwd or ROOT, args.logs)), flush=True)


if __name__ == "__main__":
    main()

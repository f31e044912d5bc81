"""Start a real `attnlens serve` process on a free localhost port, for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    base_url: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def openai_client(self, timeout: float = 60):
        """The official `openai` client on this server's /v1, without retries."""
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="x", max_retries=0, timeout=timeout)


@contextlib.contextmanager
def live_server(model_dir: Path, log_dir: Path, *, env: dict[str, str] | None = None, timeout: float = 90.0,
                port: int | None = None):
    """Run `python -m attnlens.app.cli serve` until the block ends; waits for /readyz to answer 200.
    `port`: where to listen (default: a free one), e.g. the port of a replica started again."""
    port = port or free_port()
    log_path = Path(log_dir) / f"server-{port}.log"
    full_env = {**os.environ, "ATTNLENS_DEVICE": "cpu", **(env or {})}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "attnlens.app.cli", "serve", "--model", str(model_dir),
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env=full_env,
            cwd=Path(__file__).resolve().parent.parent,
        )
    server = LiveServer(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"attnlens serve exited with {proc.returncode}:\n{server.log()}")
            try:
                if httpx.get(server.base_url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"attnlens serve not ready after {timeout}s:\n{server.log()}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""attnlens.Server: `attnlens serve` in a child process, for a notebook or a script.

    with attnlens.Server() as server:          # the default models (SmolLM2 and the bundled ones), on a free port
        client = server.client()
        ...

It runs the server exactly as the command line does (`python -m attnlens.app.cli serve`, with
this Python), waits until /readyz answers 200 and stops it on exit. Needs attnlens[server].
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from .client import Client
from .errors import APIConnectionError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An attnlens server in a child process. `models`: checkpoint directories (the first is the
    default model; none: the server's defaults, the packaged SmolLM2 and every bundled
    checkpoint). `env`: more
    ATTNLENS_* settings. Its output goes to `log` (a file path; default a temporary file)."""

    def __init__(self, *models: str | Path, port: int | None = None, env: dict[str, str] | None = None,
                 log: str | Path | None = None, timeout: float = 180.0):
        self.models = [Path(m) for m in models]
        self.port = port
        self.env = env or {}
        if log is None:
            fd, log = tempfile.mkstemp(prefix="attnlens-server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log)
        self.timeout = timeout
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        """Start it and wait until it is ready (raises APIConnectionError with its log if it is not)."""
        if self.process is not None:
            return self
        self.port = self.port or free_port()
        env = {**os.environ, **self.env}
        cmd = [sys.executable, "-m", "attnlens.app.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.models:
            cmd += ["--model", str(self.models[0])]
            if len(self.models) > 1:
                env["ATTNLENS_MODELS"] = ",".join(str(m) for m in self.models)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        client = Client(self.url)
        try:
            client.wait_until_ready(self.timeout, stop_if=lambda: self.process.poll() is not None)
        except APIConnectionError as e:
            self.stop()
            raise APIConnectionError(f"{e}; its log ({self.log_path}):\n{self.log()[-4000:]}") from None
        finally:
            client.close()
        return self

    def client(self, **options) -> Client:
        """A Client of this server (options: Client's, e.g. api_key)."""
        return Client(self.url, **options)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 15 s); the server ends its streams and engines."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.process is not None else "stopped"
        return f"attnlens.Server({self.url if self.port else 'no port yet'}, {state})"

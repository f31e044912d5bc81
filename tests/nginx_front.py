"""Debian's nginx with the shipped configuration (deploy/nginx), on loopback, as an unprivileged
process of the test: its own prefix, pid file, logs and temp folders in a temporary directory.

deploy/nginx/nginx.conf is used as it ships, with only what ties it to a container replaced:
the upstream's `server attnlens:8000 ...` line becomes one line per replica port (same
parameters), the include paths point into the repository, `listen 80` becomes a loopback
port, and the logs, pid and temp paths go to the temporary directory. Each replacement must
match exactly once, so a change to the shipped files cannot leave the test on another config.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from helpers import REPO_ROOT

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
SHIPPED = REPO_ROOT / "deploy" / "nginx"


def replace_once(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise AssertionError(f"{where}: expected {old!r} exactly once")
    return text.replace(old, new)


def upstream_for(ports: list[int]) -> str:
    """upstream.conf with its compose `server attnlens:8000 <params>;` line made one per port."""
    text = (SHIPPED / "upstream.conf").read_text()
    lines = re.findall(r"^([ \t]*)server attnlens:8000([^;\n]*);[ \t]*$", text, re.M)
    if len(lines) != 1:
        raise AssertionError("upstream.conf: expected one `server attnlens:8000 ...;` line")
    indent, params = lines[0]
    servers = "".join(f"{indent}server 127.0.0.1:{p}{params};\n" for p in ports)
    return re.sub(r"^[ \t]*server attnlens:8000[^;\n]*;[ \t]*\n", servers, text, flags=re.M)


def loopback_config(tmp: Path, port: int, replica_ports: list[int]) -> str:
    conf = (SHIPPED / "nginx.conf").read_text()
    conf = replace_once(conf, "include /etc/nginx/attnlens/upstream.conf;", upstream_for(replica_ports), "nginx.conf")
    conf = replace_once(conf, "include /etc/nginx/attnlens/attnlens.conf;", f"include {SHIPPED / 'attnlens.conf'};",
                        "nginx.conf")
    conf = replace_once(conf, "listen 80;", f"listen 127.0.0.1:{port};", "nginx.conf")
    user = "user root;\n" if os.geteuid() == 0 else ""  # as root, workers would switch to nobody
    conf = replace_once(conf, "error_log /dev/stderr warn;",
                        f"{user}error_log {tmp}/error.log info;\npid {tmp}/nginx.pid;", "nginx.conf")
    temps = "".join(f"{name}_temp_path {tmp}/{name};\n    "
                    for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return replace_once(conf, "access_log /dev/stdout attnlens;", f"access_log {tmp}/access.log attnlens;\n    {temps}",
                        "nginx.conf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nginx:
    def __init__(self, tmp: Path, replica_ports: list[int]):
        self.tmp = Path(tmp)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.conf = self.tmp / "nginx.conf"
        self.conf.write_text(loopback_config(self.tmp, self.port, replica_ports))
        self.process: subprocess.Popen | None = None

    def command(self, *extra: str) -> list[str]:
        return [NGINX, "-p", str(self.tmp), "-c", str(self.conf), "-e", str(self.tmp / "error.log"), *extra]

    def log(self) -> str:
        parts = [(self.tmp / name).read_text(errors="replace") for name in ("error.log", "access.log")
                 if (self.tmp / name).exists()]
        return "\n".join(parts)

    def start(self) -> None:
        check = subprocess.run(self.command("-t"), capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        self.process = subprocess.Popen(self.command("-g", "daemon off;"), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        for _ in range(200):
            assert self.process.poll() is None, self.log()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            time.sleep(0.05)
        raise AssertionError(f"nginx did not listen:\n{self.log()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # graceful: workers finish their requests
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def nginx_front(tmp: Path, replica_ports: list[int]):
    """The shipped nginx in front of these loopback ports until the block ends."""
    nginx = Nginx(tmp, replica_ports)
    nginx.start()
    try:
        yield nginx
    finally:
        nginx.stop()

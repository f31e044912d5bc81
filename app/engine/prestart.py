"""Engine processes started by `attnlens serve` before its own start-up, forked once torch is imported.

Most of an engine process's start is importing torch and the engine (about 1.2 s of CPU each),
and the server imports the same. So `attnlens serve` first imports them, then, on Linux, forks
one engine process per model that will have one: each holds the imports already, asks for no
CPU until its spec comes, and waits for it while the server imports the rest and loads the
models' shapes; `take_engine_process` hands each to the model whose engine starts next (the spec
is sent then). Forked before anything has run a torch operation or touched CUDA, and before
the server has a thread of its own (only OpenBLAS's worker, which handles a fork), so the fork
is safe; each child keeps only its two pipes and ends with os._exit, never returning into the
command line. A start that first converted a packaged model (its products ran torch's OpenMP team
here) spawns instead: a forked child would wait forever for that team's threads. Elsewhere they are fresh interpreters started at once, which import beside the
server instead (`spawn_engine_process`, also what a restarted engine gets).

Which models get one is read from their config.json alone: a process left over is killed once
the engines have started, and a model without one gets a fresh process. This module imports
neither torch nor the engine until `prestart_engine_processes` runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

# the families whose declaration has a GenerationSpec (model/families): each such model's engine
# runs in a process of its own (tests/engine/test_engine_prestart.py checks this against the declarations)
GENERATING_FAMILIES = ("decoder", "encoder-decoder")


class ProcessHandle(Protocol):
    """What ProcessClient uses of an engine process: subprocess.Popen's, or ForkedProcess's."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class ForkedProcess:
    """subprocess.Popen's poll / wait / kill for a child this process forked (no exec)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: its status is lost
                    pid, status = self.pid, 255 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"engine process {self.pid}", timeout or 0)
            time.sleep(0.005)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class BareEngineProcess:
    """An engine process started without its spec: it has imported, and waits for it."""

    process: ProcessHandle
    commands: int  # our end of the pipe it reads commands from (its spec first)
    records: int  # our end of the pipe it writes records to


_waiting: list[BareEngineProcess] = []
_lock = threading.Lock()


def spawn_engine_process() -> BareEngineProcess:
    """A fresh interpreter running the engine's __main__ with two inherited pipes; it imports this
    package and nothing of the server's __main__."""
    import attnlens

    their_commands, commands = os.pipe()
    records, their_records = os.pipe()
    package_root = str(Path(attnlens.__file__).resolve().parents[1])  # the folder holding the attnlens package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    process = subprocess.Popen([sys.executable, "-m", "attnlens.app.engine", str(their_commands), str(their_records)],
                               pass_fds=(their_commands, their_records), env=env)
    os.close(their_commands)
    os.close(their_records)
    return BareEngineProcess(process, commands, records)


def fork_engine_process() -> BareEngineProcess:
    """A child of this process that becomes an engine process (worker.run_from_pipes) with the
    imports this process holds: for a process that has run no torch operation and holds no thread
    of its own (`attnlens serve` before its start-up), on Linux."""
    from attnlens.app.engine.worker import run_from_pipes

    their_commands, commands = os.pipe()
    records, their_records = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the engine process: never returns
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it closes us
            low, high = sorted((their_commands, their_records))
            os.closerange(3, low)  # nothing else of the server's: the other engine processes' pipes above all
            os.closerange(low + 1, high)
            os.closerange(high + 1, os.sysconf("SC_OPEN_MAX"))
            run_from_pipes(their_commands, their_records)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(their_commands)
    os.close(their_records)
    return BareEngineProcess(ForkedProcess(pid), commands, records)


def generates(model_dir: Path) -> bool:
    """Whether the checkpoint's family generates, from its config.json alone (no family is imported)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # the load will say what is wrong with it
    return isinstance(config, dict) and config.get("family", "decoder") in GENERATING_FAMILIES


def torch_ran_here() -> bool:
    """Whether this process has run torch's work already (it converted a packaged model, at a first
    start): a fork would then inherit an OpenMP team without its threads, and hang."""
    packaged = sys.modules.get("attnlens.model.interop.packaged")
    return bool(getattr(packaged, "converted_here", False))


def prestart_engine_processes(model_dirs: Iterable[Path], *, fork: bool | None = None) -> int:
    """Start one engine process per model of `model_dirs` that generates: forked from this process
    once it has imported the engine (`fork`; default: on Linux), else spawned. How many."""
    wanted = sum(generates(d) for d in model_dirs)
    if fork is None:
        fork = sys.platform == "linux" and not torch_ran_here()
    if fork and wanted:
        import attnlens.app.engine.worker  # noqa: F401  torch and the engine, imported once for all of them
    started = [(fork_engine_process if fork else spawn_engine_process)() for _ in range(wanted)]
    with _lock:
        _waiting.extend(started)
    return wanted


def take_engine_process() -> BareEngineProcess:
    """A prestarted engine process that is still alive, else a fresh one."""
    while True:
        with _lock:
            bare = _waiting.pop(0) if _waiting else None
        if bare is None:
            return spawn_engine_process()
        if bare.process.poll() is None:
            return bare
        _close(bare)  # it died before it was needed (killed by hand): a fresh one instead


def close_unused_engine_processes() -> None:
    """Stop the prestarted engine processes no model took (they hold nothing: killed at once)."""
    with _lock:
        unused, _waiting[:] = list(_waiting), []
    for bare in unused:
        _close(bare)


def _close(bare: BareEngineProcess) -> None:
    bare.process.kill()
    bare.process.wait()
    os.close(bare.commands)
    os.close(bare.records)

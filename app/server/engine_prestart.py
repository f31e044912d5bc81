"""Engine processes started first thing by `attnlens serve`, before it imports torch.

Most of an engine process's start (app/engine/process.py) is importing torch and the engine,
which it does before it reads its spec; the server spends its own first seconds importing the
same and loading the models' shapes, on one core. So `attnlens serve` starts one bare engine
process per model that will have one before anything else: they import while the server does,
and `take_engine_process` hands each to the model whose engine starts next (the spec is sent
then). Which models get one is read from their config.json alone (no torch here): a bare
process left over is closed once the engines have started, and a model without one gets a
fresh process, as a restarted engine always does.

This module imports neither torch nor the engine package (whose __init__ imports torch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnlens.app.server.settings import Settings

# the families whose declaration has a GenerationSpec (model/families): each such model's engine
# runs in a process of its own (tests/test_engine_prestart.py checks this against the declarations)
GENERATING_FAMILIES = ("decoder", "encoder-decoder")


@dataclass
class BareEngineProcess:
    """`python -m attnlens.app.engine` started without its spec: it imports, then waits for it."""

    process: subprocess.Popen
    commands: int  # our end of the pipe it reads commands from (its spec first)
    records: int  # our end of the pipe it writes records to


_waiting: list[BareEngineProcess] = []
_lock = threading.Lock()


def spawn_engine_process() -> BareEngineProcess:
    """A fresh interpreter (never a fork of one that holds threads or CUDA) running the engine's
    __main__ with two inherited pipes; it imports this package and nothing of the server's __main__."""
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


def generates(model_dir: Path) -> bool:
    """Whether the checkpoint's family generates, from its config.json alone (no family is imported)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # the load will say what is wrong with it
    return isinstance(config, dict) and config.get("family", "decoder") in GENERATING_FAMILIES


def prestart_engine_processes(settings: Settings) -> int:
    """Start one bare engine process per model that will have one (ATTNLENS_ENGINE_PROCESS); how many."""
    if not settings.engine_process:
        return 0
    wanted = sum(generates(d) for d in settings.model_dirs())
    started = [spawn_engine_process() for _ in range(wanted)]
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

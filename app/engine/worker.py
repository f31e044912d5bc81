"""The engine process's main: load the model, run the engine core, talk over two pipes.

The very EngineCore that runs on a thread of the server (client.py's InprocClient) runs here,
with a sink that sends its records down the pipe (wire.py) instead of to the front; the server's
ProcessClient (process.py) turns them back into records for its front. This process's main
thread runs the model (EngineCore.run: on the CPU, OpenMP's workers serve the main thread's
parallel regions without a wake-up each, twice as fast a decode step as from a second thread);
a reader thread takes the server's commands. The model never shares the interpreter (and its
GIL) with the server's event loop, so turning tokens into events, stop strings and socket writes
run beside the model's step instead of between its kernels.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from attnlens.app.engine.allocator import retain_freed_memory
from attnlens.app.engine.core import EngineCore
from attnlens.app.engine.records import MODEL_CALL_FAILED, CallResult, CoreRecord, FinishRecord
from attnlens.app.engine.request import Generation
from attnlens.app.engine.wire import Counters, dumps, encode_records, receive, send

log = logging.getLogger("attnlens.engine")


@dataclass
class EngineSpec:
    """What the engine process loads and how it runs (picklable)."""

    model_dir: Path
    device: str = "auto"
    dtype: str = "auto"
    engine: dict = field(default_factory=dict)  # EngineCore's keyword arguments
    log_level: str = "info"
    malloc_retain_bytes: int = 0  # app/engine/allocator.py


class CoreCall:
    """A model call from the server, as the core runs it: its operation (plain data, run by
    name: model/analysis/operations.py), and whether its caller went away."""

    def __init__(self, number: int, operation: Any):
        self.number, self.operation = number, operation
        self.cancelled = False


class PipeSink:
    """The core's output sink in an engine process: each hand-over goes down the pipe, with the
    core's counters; a model call's result goes as a message of its own."""

    def __init__(self, core: EngineCore, records: Connection):
        self.core = core
        self._records = records
        self._send_lock = threading.Lock()  # the model (main) thread and the reader thread both send
        self.generations: dict[int, Generation] = {}  # by the server's number, until finished
        self.calls: dict[int, CoreCall] = {}  # model calls by the server's number, until answered

    def __call__(self, records: list[CoreRecord]) -> None:
        steps = [r for r in records if not isinstance(r, CallResult)]
        for r in steps:
            if isinstance(r, FinishRecord):
                self.generations.pop(r.generation.number, None)
        if steps or not records:  # an empty hand-over is a heartbeat
            core = self.core
            counters = Counters(core.step_seconds, core.errors, core.cancelled, core.cache_held)
            self.send(("step", counters, encode_records(steps)))
        for record in records:
            if isinstance(record, CallResult):
                self._result(record)

    def _result(self, r: CallResult) -> None:
        self.calls.pop(r.call.number, None)
        try:
            data = dumps(("result", r.call.number, r.error is None, r.value if r.error is None else r.error))
        except Exception as e:
            log.error("a model call's answer does not pickle: %s", e)
            data = dumps(("result", r.call.number, False, RuntimeError(MODEL_CALL_FAILED)))
        self.send_bytes(data)

    def send(self, message: tuple) -> None:
        self.send_bytes(dumps(message))

    def send_bytes(self, data: bytes) -> None:
        with self._send_lock:
            try:
                self._records.send_bytes(data)
            except OSError:  # the server is gone; its end of the pipe closed
                pass


def main(spec: EngineSpec, commands: Connection, records: Connection) -> None:
    """The engine process: runs until ("close",) or until the server goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it closes us
    logging.basicConfig(level=spec.log_level.upper() if spec.log_level != "trace" else "DEBUG", stream=sys.stderr,
                        format="%(levelname)s:     [engine %(process)d] %(name)s: %(message)s")
    from attnlens.model.placement import load_for_serving

    retain_freed_memory(spec.malloc_retain_bytes)
    try:
        checkpoint = load_for_serving(spec.model_dir, spec.device, spec.dtype)
        core = EngineCore(checkpoint, **spec.engine)
    except Exception as e:
        send(records, ("failed", f"{type(e).__name__}: {e}"))
        return
    sink = core.sink = PipeSink(core, records)
    gc.freeze()  # the model and core live as long as the process: out of the collector's full walks
    sink.send(("ready", {"device": str(core.device), "dtype": str(core.dtype).removeprefix("torch."),
                         "cache_bytes": core.cache_bytes, "cuda_graphs": core.graphs is not None}))
    reader = threading.Thread(target=_read_commands, args=(core, sink, commands), name="attnlens-commands",
                              daemon=True)
    reader.start()
    try:
        core.run()  # until the reader closes it
    finally:
        records.close()


def _read_commands(core: EngineCore, sink: PipeSink, commands: Connection) -> None:
    try:
        _serve(core, sink, commands)
    finally:
        core.close()


def _serve(core: EngineCore, sink: PipeSink, commands: Connection) -> None:
    while True:
        try:
            message = receive(commands)
        except (EOFError, OSError):  # the server went away without saying so
            return
        kind = message[0]
        if kind == "add":
            _, number, params = message
            g = Generation(params)
            g.number = number
            g.t_submit = time.perf_counter()
            sink.generations[number] = g
            try:
                core.add_generation(g)
            except Exception as e:  # the server hands over only into free slots: this is a bug, but g's own
                sink([FinishRecord(g, "error", f"the engine process refused it: {e}")])
        elif kind in ("cancel", "stop"):
            running = sink.generations.get(message[1])
            if running is not None:
                core.cancel(running) if kind == "cancel" else core.stop(running)
        elif kind == "cancel_call":  # its caller went away: it stops at its next report point
            call = sink.calls.get(message[1])
            if call is not None:
                core.cancel_call(call)
        elif kind == "call":
            _, number, operation = message
            call = sink.calls[number] = CoreCall(number, operation)
            core.add_call(call)
        elif kind == "close":
            return

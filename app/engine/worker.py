"""The engine process's main: load the model, run the engine core, talk over two pipes.

The same `Engine` runs here as in-process, with two changes: its generations have no output
stage (the server's make the events), and a hand-over of records goes down the pipe (wire.py)
instead of to an event loop. This process's main thread runs the model (Engine.run: on the
CPU, OpenMP's workers serve the main thread's parallel regions without a wake-up each, twice
as fast a decode step as from a second thread); a reader thread takes the server's commands.
The model never shares the interpreter (and its GIL) with the server's event loop, so turning
tokens into events, stop strings and socket writes run beside the model's step instead of
between its kernels.
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

from .core import Engine, Generation
from .front import MODEL_CALL_FAILED
from .outputs import FinishRecord, Record
from .wire import Counters, dumps, encode_records, receive, send


@dataclass
class EngineSpec:
    """What the engine process loads and how it runs (picklable)."""

    model_dir: Path
    device: str = "auto"
    dtype: str = "auto"
    engine: dict = field(default_factory=dict)  # Engine's keyword arguments
    log_level: str = "info"


class _PipedEngine(Engine):
    """Engine whose hand-overs go down a pipe to the server."""

    def __init__(self, checkpoint, records: Connection, **kw):
        self._records = records
        self._send_lock = threading.Lock()  # the model (main) thread and the reader thread both send
        self.generations: dict[int, Generation] = {}  # by the server's number, until finished
        self.calls: dict[int, _PipedCall] = {}  # model calls by the server's number, until answered
        super().__init__(checkpoint, **kw)

    def _emit(self, records: list[Record]) -> None:
        for r in records:
            if isinstance(r, FinishRecord):
                self.generations.pop(r.generation.number, None)
        counters = Counters(self.scheduler.drain.step_seconds, self.errors, self.cancelled, self.cache_held)
        self.send(("step", counters, encode_records(records)))

    def send(self, message: tuple) -> None:
        self.send_bytes(dumps(message))

    def send_bytes(self, data: bytes) -> None:
        with self._send_lock:
            try:
                self._records.send_bytes(data)
            except OSError:  # the server is gone; its end of the pipe closed
                pass


class _PipedCall:
    """A model call from the server: its result goes back down the pipe."""

    def __init__(self, engine: _PipedEngine, number: int, operation):
        self.engine, self.number, self.operation = engine, number, operation
        self.cancelled = False

    def settle(self, result=None, error: BaseException | None = None) -> None:
        self.engine.calls.pop(self.number, None)
        try:
            data = dumps(("result", self.number, error is None, result if error is None else error))
        except Exception as e:
            logging.getLogger("attnlens.engine").error("a model call's answer does not pickle: %s", e)
            data = dumps(("result", self.number, False,
                          RuntimeError(MODEL_CALL_FAILED)))
        self.engine.send_bytes(data)


def main(spec: EngineSpec, commands: Connection, records: Connection) -> None:
    """The engine process: runs until ("close",) or until the server goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it closes us
    logging.basicConfig(level=spec.log_level.upper() if spec.log_level != "trace" else "DEBUG", stream=sys.stderr,
                        format="%(levelname)s:     [engine %(process)d] %(name)s: %(message)s")
    from ..loader import load_for_serving

    try:
        checkpoint = load_for_serving(spec.model_dir, spec.device, spec.dtype)
        engine = _PipedEngine(checkpoint, records, own_thread=False, **spec.engine)
    except Exception as e:
        send(records, ("failed", f"{type(e).__name__}: {e}"))
        return
    gc.freeze()  # the model and engine live as long as the process: out of the collector's full walks
    engine.send(("ready", {"device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
                           "cache_bytes": engine.cache_bytes, "cuda_graphs": engine.graphs is not None}))
    reader = threading.Thread(target=_read_commands, args=(engine, commands), name="attnlens-commands", daemon=True)
    reader.start()
    try:
        engine.run()  # until the reader closes it
    finally:
        records.close()


def _read_commands(engine: _PipedEngine, commands: Connection) -> None:
    try:
        _serve(engine, commands)
    finally:
        engine.close()


def _serve(engine: _PipedEngine, commands: Connection) -> None:
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
            engine.generations[number] = g
            try:
                engine.admit([g])
            except Exception as e:  # the server admits only into free slots: this is a bug, but g's own
                engine._emit([FinishRecord(g, "error", f"the engine process refused it: {e}")])
        elif kind in ("cancel", "stop"):
            g = engine.generations.get(message[1])
            if g is not None:
                g.cancel() if kind == "cancel" else g.stop()
        elif kind == "cancel_call":  # its caller went away: it stops at its next report point
            call = engine.calls.get(message[1])
            if call is not None:
                call.cancelled = True
        elif kind == "call":
            _, number, operation = message
            call = engine.calls[number] = _PipedCall(engine, number, operation)
            try:
                engine.admit_call(call)
            except Exception as e:
                call.settle(error=e)
        elif kind == "close":
            return


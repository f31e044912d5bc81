"""The engine core in a process of its own (vLLM V1's EngineCore process), and its front here.

Why: in one process the model thread and the event loop share Python's GIL, so per token
their CPU times add up (bench/README.md). In its own process the model steps while this
process turns the previous step's tokens into events and writes them to sockets.

This process keeps admission (the scheduler's lines: QueueFull, Retry-After, a cancelled
waiter leaving at once), the generations' output stages and the model-call futures. A
generation is sent to the engine process only when it has a slot there; the engine
process's final record for it frees the slot here, and the next waiting one is sent. A reader
thread turns each hand-over (wire.py) into records for the output stage. If the engine
process dies, every generation and call it held ends with an error and /readyz says so.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

import torch

import attnlens
from attnlens.model import Checkpoint

from . import worker
from .core import Generation
from .front import MODEL_CALL_FAILED, EngineFront, ModelCall
from .outputs import FinishRecord
from .wire import Counters, decode_record, receive, send

log = logging.getLogger("attnlens.engine")


def _spawn(spec: worker.EngineSpec) -> tuple[subprocess.Popen, Connection, Connection]:
    """Start `python -m attnlens.app.engine` with two inherited pipes and send it its spec: a fresh
    interpreter (never a fork of one that holds threads or CUDA) that imports this package and
    nothing of the server's __main__. Returns the process, our command end, our record end."""
    their_commands, commands = os.pipe()
    records, their_records = os.pipe()
    package_root = str(Path(attnlens.__file__).resolve().parents[1])  # the folder holding the attnlens package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    process = subprocess.Popen([sys.executable, "-m", "attnlens.app.engine", str(their_commands), str(their_records)],
                               pass_fds=(their_commands, their_records), env=env)
    os.close(their_commands)
    os.close(their_records)
    commands_end = Connection(commands, readable=False)
    send(commands_end, ("spec", spec))
    return process, commands_end, Connection(records, writable=False)


class EngineProcess(EngineFront):
    """The front of one engine process (the module docstring): the same interface as Engine."""

    def __init__(self, checkpoint: Checkpoint, *, model_dir: Path | None = None, device: str = "auto",
                 dtype: str = "auto", max_concurrent: int = 32, max_queue: int = 64,
                 max_attention_concurrent: int = 4, cuda_graphs: bool = True,
                 max_stream_backlog_bytes: int = 64_000_000, overlap_outputs: bool | None = None,
                 log_level: str = "info", start_timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(checkpoint, max_concurrent=max_concurrent, max_queue=max_queue,
                         max_attention_concurrent=max_attention_concurrent,
                         max_stream_backlog_bytes=max_stream_backlog_bytes, clock=clock)
        model_dir = model_dir or checkpoint.path
        if model_dir is None:
            raise ValueError("an engine process loads its model from a checkpoint directory; this one has none")
        spec = worker.EngineSpec(Path(model_dir), device, dtype, dict(
            max_concurrent=max_concurrent, max_queue=max_concurrent, max_attention_concurrent=max_attention_concurrent,
            cuda_graphs=cuda_graphs, overlap_outputs=overlap_outputs), log_level)
        self.process, self._commands, self._records = _spawn(spec)
        self._send_lock = threading.Lock()
        self._closing = False
        try:
            info = self._wait_until_ready(start_timeout_s)
        except BaseException:
            self.process.kill()
            raise
        self.device = torch.device(info["device"])
        self.dtype = getattr(torch, info["dtype"])
        self.cache_bytes: int = info["cache_bytes"]  # the KV cache in the engine process
        self.cuda_graphs: bool = info["cuda_graphs"]
        self.counters = Counters(0.0, 0, 0)
        self._generations: dict[int, Generation] = {}  # by number: sent to the engine process, not finished
        self._calls: dict[int, ModelCall] = {}
        self._call_numbers = itertools.count(1)
        self._reader = threading.Thread(target=self._read, name="attnlens-engine-reader", daemon=True)
        self._reader.start()

    def _wait_until_ready(self, timeout: float) -> dict:
        if not self._records.poll(timeout):
            raise RuntimeError(f"the engine process did not load the model in {timeout:.0f} s")
        try:
            message = receive(self._records)
        except EOFError:
            raise RuntimeError(f"the engine process exited while loading the model (exit code "
                               f"{self.process.wait(5)}); see the log above") from None
        if message[0] == "failed":
            raise RuntimeError(message[1])
        return message[1]

    # --- introspection -----------------------------------------------------
    @property
    def errors(self) -> int:
        return self.counters.errors

    @property
    def cancelled(self) -> int:
        return self.waiting_cancelled + self.counters.cancelled

    @property
    def alive(self) -> bool:
        return self._reader.is_alive() and self.process.poll() is None

    # --- to the engine process ---------------------------------------------
    def _send(self, message: tuple) -> None:
        with self._send_lock:
            send(self._commands, message)

    def _admitted(self) -> None:
        """Under the lock: send every generation that has a slot, and the next model call."""
        try:
            for g in self.scheduler.generations.take():
                self._generations[g.number] = g
                self._send(("add", g.number, g.params))
            while self.scheduler.calls.waiting and not self.scheduler.calls.running:
                work = self.scheduler.calls.take()[0]
                if work.cancelled:  # its caller left while it waited
                    self.scheduler.call_finished(work, 0.0)
                    continue
                number = next(self._call_numbers)
                self._calls[number] = work
                work.t_start = time.perf_counter()
                try:
                    self._send(("call", number, work.fn))
                except OSError:
                    raise
                except Exception as e:  # fn does not pickle: a bug in the route that made it
                    del self._calls[number]
                    self.scheduler.call_finished(work, 0.0)
                    log.error("a model call cannot be sent to the engine process: %s", e)
                    work.settle(error=RuntimeError(MODEL_CALL_FAILED))
        except OSError:  # the engine process is gone: the reader ends everything it held
            pass

    def _cancel_running(self, g) -> None:
        if g.number in self._generations:
            self._send_quietly(("cancel", g.number))

    def _stop(self, g) -> None:
        if g.number in self._generations:
            self._send_quietly(("stop", g.number))

    def _send_quietly(self, message: tuple) -> None:
        try:
            self._send(message)
        except OSError:
            pass

    def close(self, timeout: float = 10.0) -> None:
        """End every generation ("the server is shutting down"), then the engine process."""
        self._closing = True
        with self._lock:
            self.scheduler.closed = True
        self._send_quietly(("close",))
        self._reader.join(timeout)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout)
        self._commands.close()

    # --- from the engine process (the reader thread) -------------------------
    def _read(self) -> None:
        try:
            while True:
                try:
                    message = receive(self._records)
                except (EOFError, OSError):
                    break
                if message[0] == "step":
                    self._on_step(message[1], message[2])
                elif message[0] == "result":
                    self._on_result(*message[1:])
        except Exception:  # a bug here must not leave requests waiting for records nobody reads
            log.exception("cannot take the engine process's hand-over; stopping the engine process")
            self.process.kill()
        finally:
            self._engine_gone()

    def _on_step(self, counters: Counters, items: list[tuple]) -> None:
        records, finished = [], False
        with self._lock:
            self.counters = counters
            self.scheduler.drain.step_seconds = counters.step_seconds
            for item in items:
                g = self._generations.get(item[1])
                if g is None:
                    continue
                record = decode_record(item, g)
                if isinstance(record, FinishRecord):
                    del self._generations[g.number]
                    self.scheduler.generation_finished(g)
                    finished = True
                records.append(record)
            if finished:
                self._admitted()  # their slots are free in the engine process now
        self._emit(records)

    def _on_result(self, number: int, ok: bool, value) -> None:
        with self._lock:
            work = self._calls.pop(number, None)
            if work is None:
                return
            self.scheduler.call_finished(work, time.perf_counter() - work.t_start)
            self._admitted()
        if ok:
            work.settle(result=value)
        else:
            work.settle(error=value if isinstance(value, BaseException) else RuntimeError(str(value)))

    def _engine_gone(self) -> None:
        """The engine process ended: whatever it (or the line here) still held ends with an error."""
        if self._closing:
            message = "the server is shutting down"
        else:
            try:
                code = self.process.wait(1)
            except subprocess.TimeoutExpired:
                code = None
            message = "the engine process stopped; see the server log"
            log.error("the engine process for %s exited (exit code %s); generation stops here",
                      self.checkpoint.path, code)
        with self._lock:  # what was sent is in the scheduler's running lines too
            self._generations.clear()
            self._calls.clear()
        self._end_everything(message)

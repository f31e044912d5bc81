"""The engine core in a process of its own (vLLM V1's EngineCore process), and its front here.

Why: in one process the model thread and the event loop share Python's GIL, so per token
their CPU times add up (bench/README.md). In its own process the model steps while this
process turns the previous step's tokens into events and writes them to sockets.

This process keeps admission (the scheduler's lines: QueueFull, Retry-After, a cancelled
waiter leaving at once), the generations' output stages and the model-call futures. A
generation is sent to the engine process only when it has a slot there; the engine
process's final record for it frees the slot here, and the next waiting one is sent. A reader
thread turns each hand-over (wire.py) into records for the output stage.

Nothing here waits on the engine process from the event loop: commands are pickled where
they are made and written to the pipe by a writer thread of their own, so an engine process
that stops reading (stopped, or stuck) fills the pipe without freezing the server.

If the engine process dies, what it held (the generations sent to it, the model call it ran)
ends with an error. Unsupervised, admission then closes and the waiting requests end too. An
EngineSupervisor (supervisor.py) instead keeps the waiting ones in line and calls restart():
a new engine process from the same spec, which takes the line from where it was.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
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
from .scheduler import EngineClosed, EngineFailed, EngineRestarting
from .wire import Counters, decode_record, dumps, receive, send

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
    send(commands_end, ("spec", spec))  # a few hundred bytes: the empty pipe takes them at once
    return process, commands_end, Connection(records, writable=False)


def _wait_until_ready(process: subprocess.Popen, records: Connection, timeout: float) -> dict:
    if not records.poll(timeout):
        raise RuntimeError(f"the engine process did not load the model in {timeout:.0f} s")
    try:
        message = receive(records)
    except EOFError:
        raise RuntimeError(f"the engine process exited while loading the model (exit code "
                           f"{process.wait(5)}); see the log above") from None
    if message[0] == "failed":
        raise RuntimeError(message[1])
    return message[1]


class _Writer:
    """Writes pickled commands to one engine process's pipe, on a thread of its own: a full
    pipe (an engine process that does not read) blocks this thread, never the caller's."""

    def __init__(self, conn: Connection, name: str):
        self.conn = conn
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, data: bytes) -> None:
        self.outbox.put(data)

    def stop(self) -> None:
        """Write what is queued, then close the pipe (the engine process reads EOF after it)."""
        self.outbox.put(None)

    def _run(self) -> None:
        try:
            while (data := self.outbox.get()) is not None:
                self.conn.send_bytes(data)
        except OSError:  # the engine process is gone: its reader ends everything it held
            pass
        finally:
            self.conn.close()


class EngineProcess(EngineFront):
    """The front of one engine process (the module docstring): the same interface as Engine."""

    def __init__(self, checkpoint: Checkpoint, *, model_dir: Path | None = None, device: str = "auto",
                 dtype: str = "auto", max_concurrent: int = 32, max_queue: int = 64,
                 max_attention_concurrent: int = 4, cuda_graphs: bool = True,
                 max_stream_backlog_bytes: int = 64_000_000, overlap_outputs: bool | None = None,
                 kv_cache_bytes: int | None = None, prefill_chunk: int = 256, log_level: str = "info", start_timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(checkpoint, max_concurrent=max_concurrent, max_queue=max_queue,
                         max_attention_concurrent=max_attention_concurrent,
                         max_stream_backlog_bytes=max_stream_backlog_bytes, clock=clock)
        model_dir = model_dir or checkpoint.path
        if model_dir is None:
            raise ValueError("an engine process loads its model from a checkpoint directory; this one has none")
        self.spec = worker.EngineSpec(Path(model_dir), device, dtype, dict(
            max_concurrent=max_concurrent, max_queue=max_concurrent, max_attention_concurrent=max_attention_concurrent,
            cuda_graphs=cuda_graphs, overlap_outputs=overlap_outputs, kv_cache_bytes=kv_cache_bytes,
            prefill_chunk=prefill_chunk), log_level)
        self.start_timeout_s = start_timeout_s
        self.clock = clock
        self.state = "starting"
        self.supervised = False  # set by an EngineSupervisor: a death keeps the line for restart()
        self.exit_code: int | None = None  # of the last engine process that died
        self.kill_reason: str | None = None  # why we killed it (the watchdog), if we did
        self.start_seconds = 0.0  # how long the last engine process took to be ready
        self._closing = False
        self._epoch = 0  # which engine process the reader and writer belong to
        self._writer: _Writer | None = None
        self._generations: dict[int, Generation] = {}  # by number: sent to the engine process, not finished
        self._calls: dict[int, ModelCall] = {}
        self._call_numbers = itertools.count(1)
        self.counters = Counters(0.0, 0, 0)
        self._earlier = Counters(0.0, 0, 0)  # the counts of engine processes that died before this one
        self.last_progress = clock()  # the last record from the engine process, or when it was given work
        info = self._start()
        self.device = torch.device(info["device"])
        self.dtype = getattr(torch, info["dtype"])
        self.cache_bytes: int = info["cache_bytes"]  # the KV cache in the engine process
        self.cuda_graphs: bool = info["cuda_graphs"]

    # --- the engine process's life -------------------------------------------------
    def _start(self) -> dict:
        """Spawn an engine process, wait until it has loaded the model, then run its reader and
        writer and send it the work waiting in line. Blocks: call it off the event loop."""
        t0 = time.perf_counter()
        process, commands, records = _spawn(self.spec)
        try:
            info = _wait_until_ready(process, records, self.start_timeout_s)
        except BaseException:
            process.kill()
            process.wait()
            commands.close()
            records.close()
            raise
        self.start_seconds = time.perf_counter() - t0
        with self._lock:
            if self._closing:  # close() came while it started: nothing more to run
                process.kill()
                commands.close()
                records.close()
                raise EngineClosed("the server is shutting down")
            self._epoch += 1
            self.process = process
            self._records = records
            self._writer = _Writer(commands, f"attnlens-engine-writer-{process.pid}")
            self._reader = threading.Thread(target=self._read, args=(self._epoch, process, records),
                                            name=f"attnlens-engine-reader-{process.pid}", daemon=True)
            self.state, self.detail, self.kill_reason = "running", None, None
            self.last_progress = self.clock()
            self._reader.start()
            if self.scheduler.closed_as is EngineRestarting:  # refused while it was down: takes work again
                self.scheduler.reopen()
            self._admitted()  # what waited for the restart
        return info

    def restart(self) -> None:
        """Start a new engine process for this front (after the last one died; the state stays
        "restarting" until it runs). Blocks: call it off the event loop."""
        if self.state == "running" or self._closing:
            return
        self._start()

    def kill(self, reason: str) -> None:
        """Kill the engine process (SIGKILL works on a stopped one too); the reader then sees it die."""
        self.kill_reason = reason
        try:
            os.kill(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def refuse_while_down(self, message: str, retry_after: int) -> None:
        """The restart takes longer than requests may wait: those waiting end with `message`
        (EngineRestarting) and new ones are refused with it until the engine process runs."""
        with self._lock:
            if self.state == "running" or self._closing:
                return
            self.scheduler.close(message, EngineRestarting, retry_after)
            generations, calls = self.scheduler.take_waiting()
        self._end_with(generations, calls, EngineRestarting(message, retry_after))

    def give_up(self, message: str, kind: type[EngineClosed]) -> None:
        """No more restarts: everything waiting ends, and admission answers `kind(message)`."""
        self.state, self.detail = "failed", message
        self._end_everything(message, kind)

    # --- introspection -----------------------------------------------------
    @property
    def errors(self) -> int:
        return self._earlier.errors + self.counters.errors

    @property
    def cancelled(self) -> int:
        return self.waiting_cancelled + self._earlier.cancelled + self.counters.cancelled

    @property
    def cache_held(self) -> int:
        """Bytes the engine process's KV cache holds, as of its last hand-over."""
        return self.counters.cache_held

    @property
    def alive(self) -> bool:
        return self.state == "running" and self._reader.is_alive() and self.process.poll() is None

    def stalled_for(self, now: float) -> float:
        """Seconds since the engine process last showed progress while it holds work (0 when idle)."""
        if self.state != "running" or not (self._generations or self._calls):
            return 0.0
        return max(0.0, now - self.last_progress)

    # --- to the engine process ---------------------------------------------
    def _send(self, message: tuple) -> None:
        """Pickle here (a message that cannot pickle raises here), write on the writer thread."""
        if not (self._generations or self._calls):
            self.last_progress = self.clock()  # idle until now: the watchdog counts from here
        self._writer.put(dumps(message))

    def _admitted(self) -> None:
        """Under the lock: send every generation that has a slot, and the next model call (only to
        a running engine process: while one restarts, the work waits in line)."""
        if self.state != "running":
            return
        for g in self.scheduler.generations.take():
            self._send(("add", g.number, g.params))
            self._generations[g.number] = g
        while self.scheduler.calls.waiting and not self.scheduler.calls.running:
            work = self.scheduler.calls.take()[0]
            if work.cancelled:  # its caller left while it waited
                self.scheduler.call_finished(work, 0.0)
                continue
            number = next(self._call_numbers)
            work.t_start = time.perf_counter()
            try:
                self._send(("call", number, work.operation))
            except Exception as e:  # the operation does not pickle: a bug in the route that made it
                self.scheduler.call_finished(work, 0.0)
                log.error("a model call cannot be sent to the engine process: %s", e)
                work.settle(error=RuntimeError(MODEL_CALL_FAILED))
                continue
            self._calls[number] = work
            work.number = number

    def _call_abandoned(self, work) -> None:
        """The engine process holds its own copy of the call: tell it to stop at its next report point."""
        with self._lock:
            number = getattr(work, "number", None)
            if number is not None and self._calls.get(number) is work and self.state == "running":
                self._send(("cancel_call", number))

    def _cancel_running(self, g) -> None:
        with self._lock:
            if g.number in self._generations:
                self._send(("cancel", g.number))

    def _stop(self, g) -> None:
        with self._lock:
            if g.number in self._generations:
                self._send(("stop", g.number))

    def close(self, timeout: float = 10.0) -> None:
        """End every generation ("the server is shutting down"), then the engine process."""
        with self._lock:
            self._closing = True
            self.scheduler.closed = True
            running = self.state == "running"
            if running:
                self._writer.put(dumps(("close",)))
                self._writer.stop()
        if running:
            self._reader.join(timeout)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        else:  # between engine processes: what waits for the next one ends here
            self._end_everything("the server is shutting down")
        self.state = "stopped"

    # --- from the engine process (the reader thread) -------------------------
    def _read(self, epoch: int, process: subprocess.Popen, records: Connection) -> None:
        try:
            while True:
                try:
                    message = receive(records)
                except (EOFError, OSError):
                    break
                self.last_progress = self.clock()
                if message[0] == "step":
                    self._on_step(message[1], message[2])
                elif message[0] == "result":
                    self._on_result(*message[1:])
        except Exception:  # a bug here must not leave requests waiting for records nobody reads
            log.exception("cannot take the engine process's hand-over; stopping the engine process")
            process.kill()
        finally:
            records.close()
            self._engine_gone(epoch, process)

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

    def _engine_gone(self, epoch: int, process: subprocess.Popen) -> None:
        """The engine process ended: what it held ends with an error; unsupervised (or closing),
        so does everything waiting, and admission closes. Supervised, the line waits for restart()."""
        try:
            code = process.wait(1)
        except subprocess.TimeoutExpired:
            code = None
        with self._lock:
            if epoch != self._epoch:
                return
            self._writer.stop()
            self._generations.clear()
            self._calls.clear()
            self._earlier = Counters(0.0, self._earlier.errors + self.counters.errors,
                                     self._earlier.cancelled + self.counters.cancelled)
            self.counters = Counters(self.counters.step_seconds, 0, 0)
            self.exit_code = code
            closing, supervised = self._closing, self.supervised
            if not closing:
                self.state = "restarting" if supervised else "failed"
                why = self.kill_reason or f"exit code {code}"
                self.detail = f"the engine process stopped ({why})"
            running = [] if closing or not supervised else self.scheduler.take_running()
        if closing:
            self._end_everything("the server is shutting down")
            return
        log.error("the engine process for %s exited (%s); %s", self.checkpoint.path,
                  self.kill_reason or f"exit code {code}",
                  "restarting it" if supervised else "generation stops here")
        if not supervised:
            self._end_everything("the engine process stopped; see the server log", EngineFailed)
            return
        generations, calls = running
        self._end_with(generations, calls, EngineRestarting(
            "the engine process stopped while this request ran; it is being restarted: retry shortly",
            retry_after=max(1, round(self.start_seconds))))

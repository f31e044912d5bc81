"""The engine core in a process of its own (vLLM V1's EngineCore process): `ProcessClient`, the
front's CoreClient (client.py) for it.

Why: in one process the model thread and the event loop share Python's GIL, so per token
their CPU times add up (bench/README.md). In its own process the model steps while this
process turns the previous step's tokens into events and writes them to sockets.

This process keeps the front (admission, the generations' output stages, the model-call
futures). A generation is sent to the engine process only when it has a slot there; the engine
process's final record for it frees the slot here, and the next waiting one is sent. A reader
thread turns each hand-over (a Step of messages.py) into records for the front.

Nothing here waits on the engine process from the event loop: commands are pickled where
they are made and written to the pipe by a writer thread of their own, so an engine process
that stops reading (stopped, or stuck) fills the pipe without freezing the server.

If the engine process dies, the client tells the front (`on_lost`), which ends what it held
with an error; restart() starts a new engine process from the same spec (supervisor.py).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import threading
import time
from multiprocessing.connection import Connection
from typing import Callable

import torch

from attnlens.app.engine.client import CoreClient, FrontSink
from attnlens.app.engine.front import EngineClosed
from attnlens.app.engine.messages import (
    AddCall,
    AddGeneration,
    CallDone,
    CancelCall,
    CancelGeneration,
    Close,
    Counters,
    EngineInfo,
    EngineSpec,
    Failed,
    FinishOut,
    PromptOut,
    Ready,
    RecordOut,
    Start,
    Step,
    StopGeneration,
    ToEngine,
    TokenOut,
    decode_from_engine,
    encode,
    pickled,
    send,
    unpickled,
)
from attnlens.app.engine.prestart import ProcessHandle, take_engine_process
from attnlens.app.engine.records import CallResult, CoreRecord, FinishRecord, PromptRecord, Record, TokenRecord
from attnlens.app.engine.request import CoreCall, Generation
from attnlens.model.decoding import GeneratedToken

log = logging.getLogger("attnlens.engine")


def _spawn(spec: EngineSpec) -> tuple[ProcessHandle, Connection, Connection]:
    """An engine process with two pipes (one `attnlens serve` started early, else a fresh
    `python -m attnlens.app.engine`: app/engine/prestart.py), sent its spec. Returns the
    process, our command end, our record end."""
    bare = take_engine_process()
    commands_end = Connection(bare.commands, readable=False)
    send(commands_end, Start(spec))  # a few hundred bytes: the empty pipe takes them at once
    return bare.process, commands_end, Connection(bare.records, writable=False)


def _wait_until_ready(process: ProcessHandle, records: Connection, timeout: float) -> EngineInfo:
    if not records.poll(timeout):
        raise RuntimeError(f"the engine process did not load the model in {timeout:.0f} s")
    try:
        message = decode_from_engine(records.recv_bytes())
    except EOFError:
        raise RuntimeError(f"the engine process exited while loading the model (exit code "
                           f"{process.wait(5)}); see the log above") from None
    if isinstance(message, Failed):
        raise RuntimeError(message.message)
    if not isinstance(message, Ready):
        raise RuntimeError(f"the engine process said {type(message).__name__} before it was ready")
    return message.info


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


class ProcessClient(CoreClient):
    """The front's client of one engine process at a time (the module docstring)."""

    restartable = True

    def __init__(self, spec: EngineSpec, *, start_timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self.clock = clock
        self.sink: FrontSink | None = None
        self._lock = threading.Lock()  # the engine process's life: start, death, close
        self.process: ProcessHandle | None = None
        self.exit_code: int | None = None  # of the last engine process that died
        self.kill_reason: str | None = None  # why we killed it (the watchdog), if we did
        self.start_seconds = 0.0  # how long the last engine process took to be ready
        self._running = False  # an engine process runs and takes work
        self._closing = False
        self._epoch = 0  # which engine process the reader and writer belong to
        self._writer: _Writer | None = None
        self._reader: threading.Thread | None = None
        self.counters = Counters()
        self._earlier = Counters()  # the counts of engine processes that died before this one
        self.last_progress = clock()  # the last message from the engine process, or when it was given work
        self._info = EngineInfo("cpu", "float32", 0, False)

    # --- the engine process's life -------------------------------------------------
    def start(self, sink: FrontSink) -> None:
        self.sink = sink
        self._info = self._start()
        self.device = torch.device(self._info.device)
        self.dtype = getattr(torch, self._info.dtype)

    def _start(self) -> EngineInfo:
        """Spawn an engine process, wait until it has loaded the model, then run its reader and
        writer and tell the front (which sends it the work waiting in line). Blocks."""
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
            self._writer = _Writer(commands, f"attnlens-engine-writer-{process.pid}")
            self._reader = threading.Thread(target=self._read, args=(self._epoch, process, records),
                                            name=f"attnlens-engine-reader-{process.pid}", daemon=True)
            self._running, self.kill_reason = True, None
            self.last_progress = self.clock()
            self._reader.start()
            self._sink().on_started()  # (the front's lock inside ours: the front never takes ours)
        return info

    def _sink(self) -> FrontSink:
        assert self.sink is not None, "start() is given the sink before any engine process runs"
        return self.sink

    def restart(self) -> None:
        """Start a new engine process (after the last one died). Blocks."""
        if self._running or self._closing:
            return
        self._start()

    def kill(self, reason: str) -> None:
        """Kill the engine process (SIGKILL works on a stopped one too); the reader then sees it die."""
        self.kill_reason = reason
        assert self.process is not None, "kill() is for an engine process that was started"
        try:
            os.kill(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self, timeout: float = 10.0) -> None:
        """Tell the engine process to stop (it hands over what it holds first), and wait for it."""
        with self._lock:
            self._closing = True
            running = self._running
            if running:
                assert self._writer is not None  # set whenever an engine process runs
                self._writer.put(encode(Close()))
                self._writer.stop()
        if running:
            assert self._reader is not None and self.process is not None  # set whenever one runs
            self._reader.join(timeout)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)

    # --- counters and health -----------------------------------------------
    @property
    def errors(self) -> int:
        return self._earlier.errors + self.counters.errors

    @property
    def cancelled(self) -> int:
        return self._earlier.cancelled + self.counters.cancelled

    @property
    def cache_bytes(self) -> int:
        """The KV cache in the engine process."""
        return self._info.cache_bytes

    @property
    def cache_held(self) -> int:
        """Bytes the engine process's KV cache holds, as of its last hand-over."""
        return self.counters.cache_held

    @property
    def step_seconds(self) -> float:
        return self.counters.step_seconds

    @property
    def cuda_graphs(self) -> bool:
        return self._info.cuda_graphs

    @property
    def pid(self) -> int | None:  # type: ignore[override]  # the base's attribute, here the process's
        return self.process.pid if self.process is not None else None

    @property
    def alive(self) -> bool:
        if not self._running:
            return False
        assert self._reader is not None and self.process is not None  # set whenever one runs
        return self._reader.is_alive() and self.process.poll() is None

    def silent_for(self, now: float) -> float:
        """Seconds since the engine process last handed anything over (its heartbeats included)."""
        return max(0.0, now - self.last_progress) if self._running else 0.0

    # --- to the engine process ---------------------------------------------
    def _send(self, message: ToEngine) -> None:
        """Encode here (a message that cannot be encoded raises here), write on the writer thread."""
        data = encode(message)
        assert self._writer is not None, "work is sent only once an engine process was started"
        self._writer.put(data)

    # (the front sends only what it holds running: the generations and calls are its to track)
    def add_generation(self, g: Generation) -> None:
        self._send(AddGeneration(g.number, g.params))

    def cancel(self, g: Generation) -> None:
        self._send(CancelGeneration(g.number))

    def stop(self, g: Generation) -> None:
        self._send(StopGeneration(g.number))

    def add_call(self, call: CoreCall) -> None:
        """Its operation travels pickled (raises here when it cannot)."""
        self._send(AddCall(call.number, pickled(call.operation)))

    def cancel_call(self, call: CoreCall) -> None:
        """The engine process holds its own copy of the call: tell it to stop at its next report point."""
        self._send(CancelCall(call.number))

    # --- from the engine process (the reader thread) -------------------------
    def _read(self, epoch: int, process: ProcessHandle, records: Connection) -> None:
        try:
            while True:
                try:
                    data = records.recv_bytes()
                except (EOFError, OSError):
                    break
                message = decode_from_engine(data)
                self.last_progress = self.clock()
                if isinstance(message, Step):
                    self._on_step(message.counters, message.records)
                elif isinstance(message, CallDone):
                    self._on_result(message)
        except Exception:  # a bug here must not leave requests waiting for records nobody reads
            log.exception("cannot take the engine process's hand-over; stopping the engine process")
            process.kill()
        finally:
            records.close()
            self._engine_gone(epoch, process)

    def _on_step(self, counters: Counters, items: list[RecordOut]) -> None:
        self.counters = counters
        sink = self._sink()
        records: list[CoreRecord] = []
        for item in items:
            g = sink.generation(item.number)  # the front's registry
            if g is not None:  # else it has ended already
                records.append(_record(item, g))
        sink.on_records(records)

    def _on_result(self, done: CallDone) -> None:
        work = self._sink().running_call(done.number)
        if work is None:  # ended already
            return
        value = unpickled(done.payload)
        if done.ok:
            self._sink().on_records([CallResult(work, value=value)])
        else:
            self._sink().on_records([CallResult(work, error=value if isinstance(value, BaseException)
                                              else RuntimeError(str(value)))])

    def _engine_gone(self, epoch: int, process: ProcessHandle) -> None:
        """The engine process ended: the front ends what it held (and more, unsupervised)."""
        try:
            code = process.wait(1)
        except subprocess.TimeoutExpired:
            code = None
        with self._lock:
            if epoch != self._epoch:
                return
            self._running = False
            assert self._writer is not None  # the epoch's engine process had its writer
            self._writer.stop()
            self._earlier = Counters(0.0, self._earlier.errors + self.counters.errors,
                                     self._earlier.cancelled + self.counters.cancelled)
            self.counters = Counters(self.counters.step_seconds)
            self.exit_code = code
        self._sink().on_lost(f"the engine process stopped ({self.kill_reason or f'exit code {code}'})")


def _record(item: RecordOut, generation: Generation) -> Record:
    """A record as it came up the pipe -> the record for its generation (whose counters it updates)."""
    if isinstance(item, TokenOut):
        generation.produced += 1
        return TokenRecord(generation, GeneratedToken(item.id, item.logprob, item.top_ids, item.top_logprobs,
                                                      _tensors(item.attention), _tensors(item.cross_attention)))
    if isinstance(item, PromptOut):
        return PromptRecord(generation, item.logprobs, item.top_ids, item.top_logprobs)
    assert isinstance(item, FinishOut)
    generation.produced, generation.t_start = item.produced, item.t_start
    generation.t_first, generation.t_end = item.t_first, item.t_end
    return FinishRecord(generation, item.reason, item.message)


def _tensors(rows: list | None) -> list[torch.Tensor] | None:
    return None if rows is None else [torch.from_numpy(r) for r in rows]

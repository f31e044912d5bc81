"""The engine process's main: load the model, run the engine core, talk over two pipes.

The very EngineCore that runs on a thread of the server (client.py's InprocClient) runs here,
with a sink that sends its records down the pipe (messages.py: typed messages) instead of to the front; the server's
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
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec

from attnlens.app.engine.allocator import retain_freed_memory
from attnlens.app.engine.core import EngineCore
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
    FromEngine,
    PromptOut,
    Ready,
    RecordOut,
    Start,
    Step,
    StopGeneration,
    TokenOut,
    decode_to_engine,
    encode,
    pickled,
    send,
    unpickled,
)
from attnlens.app.engine.records import (
    MODEL_CALL_FAILED,
    CallResult,
    CoreRecord,
    FinishRecord,
    PromptRecord,
    TokenRecord,
)
from attnlens.app.engine.request import CoreCall, Generation
from attnlens.model.analysis.operations import Operation

__all__ = ["EngineSpec", "main"]

log = logging.getLogger("attnlens.engine")


def _record_out(r: CoreRecord) -> RecordOut:
    """A generation's record as it travels (keyed by the generation's number in the server)."""
    g = r.generation  # type: ignore[union-attr]  # a CallResult goes as a message of its own
    if isinstance(r, TokenRecord):
        t = r.token
        return TokenOut(g.number, t.id, t.logprob, t.top_ids, t.top_logprobs,
                        None if t.attention is None else [a.numpy() for a in t.attention],
                        None if t.cross_attention is None else [a.numpy() for a in t.cross_attention])
    if isinstance(r, PromptRecord):
        return PromptOut(g.number, r.logprobs, r.top_ids, r.top_logprobs)
    assert isinstance(r, FinishRecord)
    return FinishOut(g.number, r.reason, r.message, g.produced, g.t_start, g.t_first, g.t_end)


class PipeSink:
    """The core's output sink in an engine process: each hand-over goes down the pipe as a Step,
    with the core's counters; a model call's result goes as a CallDone of its own."""

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
            self.send(Step(counters, [_record_out(r) for r in steps]))
        for record in records:
            if isinstance(record, CallResult):
                self._result(record)

    def _result(self, r: CallResult) -> None:
        number = r.call.number
        assert number is not None  # the engine process's calls are numbered by the server
        self.calls.pop(number, None)
        try:
            done = CallDone(number, r.error is None, pickled(r.value if r.error is None else r.error))
        except Exception as e:
            log.error("a model call's answer does not pickle: %s", e)
            done = CallDone(number, False, pickled(RuntimeError(MODEL_CALL_FAILED)))
        self.send(done)

    def send(self, message: FromEngine) -> None:
        data = encode(message)
        with self._send_lock:
            try:
                self._records.send_bytes(data)
            except OSError:  # the server is gone; its end of the pipe closed
                pass


def _name_process(name: bytes) -> None:
    """What `ps -e` and `top` call this process (/proc/self/comm, 15 bytes at most), on Linux: the
    same whether it was started afresh (python) or forked from `attnlens serve`."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def run_from_pipes(commands_fd: int, records_fd: int) -> None:
    """An engine process over the two pipes it was given: its spec first (it may have been started
    before its model was known: app/engine/prestart.py), then `main`. A server that goes
    before sending it (or never needs this process) closes the pipe: nothing to do."""
    _name_process(b"attnlens-engine")
    commands = Connection(commands_fd, writable=False)
    records = Connection(records_fd, readable=False)
    try:
        first = commands.recv_bytes()
    except EOFError:
        return
    start = decode_to_engine(first)
    assert isinstance(start, Start), f"an engine process starts with its spec, not {start!r}"
    main(start.spec, commands, records)


def main(spec: EngineSpec, commands: Connection, records: Connection) -> None:
    """The engine process: runs until Close or until the server goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle: it closes us
    logging.basicConfig(level=spec.log_level.upper() if spec.log_level != "trace" else "DEBUG", stream=sys.stderr,
                        format="%(levelname)s:     [engine %(process)d] %(name)s: %(message)s")
    from attnlens.model.placement import load_for_serving

    retain_freed_memory(spec.malloc_retain_bytes)
    try:
        checkpoint = load_for_serving(Path(spec.model_dir), spec.device, spec.dtype)
        core = EngineCore(checkpoint, **spec.engine)
    except Exception as e:
        send(records, Failed(f"{type(e).__name__}: {e}"))
        return
    sink = PipeSink(core, records)
    core.sink = sink
    gc.freeze()  # the model and core live as long as the process: out of the collector's full walks
    sink.send(Ready(EngineInfo(str(core.device), str(core.dtype).removeprefix("torch."), core.cache_bytes,
                               core.graphs is not None)))
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
            data = commands.recv_bytes()
        except (EOFError, OSError):  # the server went away without saying so
            return
        try:
            message = decode_to_engine(data)
        except msgspec.DecodeError as e:  # not one of ToEngine's messages: a bug on the server's side
            log.error("ignored a message from the server that is not a command: %s", e)
            continue
        match message:
            case AddGeneration(number=number, params=params):
                g = Generation(params)
                g.number = number
                g.t_submit = time.perf_counter()
                sink.generations[number] = g
                try:
                    core.add_generation(g)
                except Exception as e:  # the server hands over only into free slots: this is a bug, but g's own
                    sink([FinishRecord(g, "error", f"the engine process refused it: {e}")])
            case CancelGeneration(number=number) | StopGeneration(number=number):
                running = sink.generations.get(number)
                if running is not None:
                    core.cancel(running) if isinstance(message, CancelGeneration) else core.stop(running)
            case CancelCall(number=number):  # its caller went away: it stops at its next report point
                call = sink.calls.get(number)
                if call is not None:
                    core.cancel_call(call)
            case AddCall(number=number, payload=payload):
                operation = unpickled(payload)
                assert isinstance(operation, Operation), f"a model call is an Operation, not {type(operation)}"
                call = sink.calls[number] = CoreCall(operation, number)
                core.add_call(call)
            case Close():
                return
            case Start():
                log.warning("an engine process is started once; a second spec is ignored")

"""The engine's front, on the server's side of every engine: admission, each request's output
state, and the engine's life as the server sees it.

A request is admitted here, into the bounded lines of admission.py (QueueFull with Retry-After,
RequestTooLarge, EngineClosed); each generation gets its server-side RequestState (outputs.py),
which the route reads, and joins the stream budget. When a generation gets a slot (and a model
call its turn) the front hands it to the core through its CoreClient (client.py); the core's
records come back through the same client (`on_records`): a generation's go to its state's
output stage, a finish frees its slot (and the next waiting one is handed over), a model call's
result answers its caller. A waiting generation that is cancelled leaves the line at once, here.

If the core is lost (an engine process died: `on_lost`), what it held ends with an error.
Unsupervised, admission then closes and the waiting requests end too. An EngineSupervisor
(supervisor.py) instead keeps the waiting ones in line and calls restart(): the client starts a
new core, which takes the line from where it was.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable

from attnlens.app.engine.admission import Admission, EngineClosed, EngineFailed, EngineRestarting
from attnlens.app.engine.client import CoreClient
from attnlens.app.engine.outputs import RequestState, call_soon, hand_over
from attnlens.app.engine.records import MODEL_CALL_FAILED, CallResult, CoreRecord, FinishRecord, Record
from attnlens.app.engine.request import CoreCall, Generation, GenerationParams
from attnlens.app.engine.stream_budget import StreamBudget
from attnlens.model import Checkpoint
from attnlens.model.analysis.operations import Operation, R

__all__ = ["MODEL_CALL_FAILED", "EngineFront", "ModelCall"]

log = logging.getLogger("attnlens.engine")


class ModelCall(CoreCall):
    """Run a model operation once on the model's side (e.g. one attention forward): `operation` is
    one of model/analysis/operations.py's calls, plain data that travels pickled to an engine
    process. Besides what the core reads (CoreCall), its caller's event loop and future."""

    def __init__(self, loop: asyncio.AbstractEventLoop, operation: Operation[Any]):
        super().__init__(operation)
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.t_start = 0.0  # when the core was given it

    def settle(self, result: object = None, error: BaseException | None = None) -> None:
        def apply():
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(result)

        call_soon(self.loop, apply)


class EngineFront:
    """Admission, output state and the counters /metrics reads, over a core reached through
    `client` (see the module docstring). Build one with Engine(...) or EngineProcess(...)
    (engines.py)."""

    def __init__(self, checkpoint: Checkpoint, client: CoreClient, *, max_concurrent: int, max_queue: int,
                 max_attention_concurrent: int, max_stream_backlog_bytes: int,
                 calls_limit: str = "ATTNLENS_MAX_ATTENTION_CONCURRENT", clock: Callable[[], float] = time.monotonic):
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.config = checkpoint.config
        self.client = client
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.max_stream_backlog_bytes = max_stream_backlog_bytes  # per generation, unread events
        self.admission = Admission(max_concurrent, max_queue, max_attention_concurrent, calls_limit=calls_limit,
                                   clock=clock)
        self._lock = threading.Lock()
        self.waiting_cancelled = 0  # generations that left the line before they ran
        # what every stream's unread events may hold between them, shared by all engines (main.py)
        self.stream_budget: StreamBudget | None = None
        # the one registry of generations: each admitted one's server-side state, by number, until
        # its last record (the client finds a record's generation here)
        self._states: dict[int, RequestState] = {}
        self._state = "starting"  # see `state`
        self.detail: str | None = None  # why it is not running, when it is not
        self._supervised = False  # an EngineSupervisor watches: a lost core keeps the line for restart()
        self._closing = False
        self._busy_since = clock()  # when the core was last given work while it held none (the watchdog)
        self.clock = clock
        client.start(self)

    # --- introspection (metrics, supervision) -------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.admission.generations.running)

    @property
    def waiting(self) -> int:
        return len(self.admission.generations.waiting)

    @property
    def attention_in_flight(self) -> int:
        return self.admission.calls.held

    @property
    def device(self):
        return self.client.device

    @property
    def dtype(self):
        return self.client.dtype

    @property
    def cache_bytes(self) -> int:
        return self.client.cache_bytes

    @property
    def cache_held(self) -> int:
        return self.client.cache_held

    @property
    def cuda_graphs(self) -> bool:
        return self.client.cuda_graphs

    @property
    def errors(self) -> int:
        return self.client.errors

    @property
    def cancelled(self) -> int:
        """Generations cancelled because their client went away (waiting or running)."""
        return self.waiting_cancelled + self.client.cancelled

    @property
    def alive(self) -> bool:
        return self.client.alive

    @property
    def restartable(self) -> bool:
        """Whether the core can be killed and started again (an engine process)."""
        return self.client.restartable

    @property
    def start_seconds(self) -> float:
        return self.client.start_seconds

    @property
    def core_pid(self) -> int | None:
        """The engine process's pid (None in-process)."""
        return self.client.pid

    @property
    def state(self) -> str:
        """starting | running | restarting | failed | stopped: the one place it is derived (the
        supervisor, /models and /readyz read it here). A core that cannot be restarted has failed
        once its thread is gone."""
        if self._state == "running" and not self.client.restartable and not self.client.alive:
            return "failed"
        return self._state

    def supervise(self) -> None:
        """An EngineSupervisor watches this engine: a lost core keeps the line for restart()."""
        self._supervised = True

    def stalled_for(self, now: float) -> float:
        """Seconds the core has held work without a sign of progress (0: idle or progressing)."""
        if self.state != "running" or not self._holds_work():
            return 0.0
        return max(0.0, min(self.client.silent_for(now), now - self._busy_since))

    def _holds_work(self) -> bool:
        return bool(self.admission.generations.running or self.admission.calls.running)

    # --- the registry, for the client (its reader thread) ------------------------------
    def generation(self, number: int) -> Generation | None:
        state = self._states.get(number)
        return state.generation if state is not None else None

    def running_call(self, number: int) -> ModelCall | None:
        with self._lock:
            return next((c for c in self.admission.calls.running if c.number == number), None)

    # --- event loop side ---------------------------------------------------
    def submit(self, params: GenerationParams) -> RequestState:
        """Admit one generation (raises QueueFull / EngineClosed); read it with .events()."""
        return self.submit_all([params])[0]

    def submit_all(self, params: list[GenerationParams], *, param: str | None = None) -> list[RequestState]:
        """Admit all of these generations or none (QueueFull, RequestTooLarge, EngineClosed): each
        an engine-side Generation, and its server-side RequestState, which the caller reads."""
        loop = asyncio.get_running_loop()
        generations = [Generation(p) for p in params]
        states = [RequestState(g, loop, self.tokenizer, p.stop, backlog_limit=self.max_stream_backlog_bytes)
                  for g, p in zip(generations, params)]
        if self.stream_budget is not None:
            for state in states:
                self.stream_budget.join(state)
        for g, state in zip(generations, states):
            self._states[g.number] = state
        try:
            self.admit(generations, param=param)
        except BaseException:
            for g in generations:
                self._states.pop(g.number, None)
            raise
        return states

    def admit(self, generations: list[Generation], *, param: str | None = None) -> None:
        for g in generations:
            g.owner = self
        with self._lock:
            self.admission.admit_generations(generations, param=param)
            self._dispatch()

    async def call(self, operation: Operation[R]) -> R:
        """Run a model operation on the model's side between decode steps, on the model-call line."""
        work = ModelCall(asyncio.get_running_loop(), operation)
        self.admit_call(work)
        try:
            return await work.future
        except asyncio.CancelledError:  # the caller went away (its future is cancelled with it)
            self._call_abandoned(work)
            raise
        finally:
            work.cancelled = True  # if we were interrupted, a call still waiting is skipped

    def admit_call(self, work: ModelCall) -> None:
        with self._lock:
            self.admission.admit_call(work)
            self._dispatch()

    def _call_abandoned(self, work: ModelCall) -> None:
        """Its caller left while `work` waited or ran: a running call stops at its next report point
        (app/engine/progress.py)."""
        with self._lock:
            if work in self.admission.calls.running and self.state == "running":
                self.client.cancel_call(work)

    def cancel_generation(self, g: Generation) -> None:
        """g was cancelled: a waiting generation leaves the line at once, and ends; a running
        one is the core's to stop."""
        with self._lock:
            removed = self.admission.generations.remove_waiting(g)
            if removed:
                self.waiting_cancelled += 1
            elif g in self.admission.generations.running and self.state == "running":
                self.client.cancel(g)
        if removed:
            g.t_end = time.perf_counter()
            self._deliver([FinishRecord(g, "cancelled")])

    def stop_generation(self, g: Generation) -> None:
        """The output stage asks the core to end g at its next step."""
        with self._lock:
            if g in self.admission.generations.running and self.state == "running":
                self.client.stop(g)

    def _dispatch(self) -> None:
        """Under the lock: hand the core every generation that has a slot, and the next model call
        (only to a running core: while one restarts, the work waits in line)."""
        if self.state != "running" or self._closing:
            return
        idle = not self._holds_work()
        for g in self.admission.generations.take():
            self.client.add_generation(g)
        calls = self.admission.calls
        while calls.waiting and not calls.running:
            work = calls.take()[0]
            if work.cancelled:  # its caller left while it waited
                self.admission.call_finished(work, 0.0)
                continue
            work.t_start = time.perf_counter()
            try:
                self.client.add_call(work)
            except Exception as e:  # it cannot be handed over (does not pickle): a bug in the route that made it
                self.admission.call_finished(work, 0.0)
                log.error("a model call cannot be sent to the engine's core: %s", e)
                work.settle(error=RuntimeError(MODEL_CALL_FAILED))
        if idle and self._holds_work():
            self._busy_since = self.clock()  # the watchdog counts from here, not from the core's last word

    def _deliver(self, records: list[Record]) -> None:
        """From any thread: records to their requests' output stages (a finished one's state leaves here)."""
        hand_over(records, self._states)

    # --- from the client (its thread) ---------------------------------------
    def on_records(self, records: list[CoreRecord]) -> None:
        """One hand-over from the core: a finish frees its slot (and the next waiting generation
        is handed over) before its record goes to the output stage; a call's result answers it."""
        outputs: list[Record] = []
        results: list[tuple[ModelCall, CallResult]] = []
        with self._lock:
            self.admission.drain.step_seconds = self.client.step_seconds
            freed = False
            for r in records:
                if isinstance(r, CallResult):
                    work = r.call
                    assert isinstance(work, ModelCall)  # the calls this front hands over
                    if work in self.admission.calls.running:  # else it was ended already
                        self.admission.call_finished(work, time.perf_counter() - work.t_start)
                        results.append((work, r))
                        freed = True
                    continue
                if isinstance(r, FinishRecord) and r.generation in self.admission.generations.running:
                    self.admission.generation_finished(r.generation)
                    freed = True
                outputs.append(r)
            if freed:
                self._dispatch()
        if outputs:
            self._deliver(outputs)
        for work, r in results:
            work.settle(result=r.value, error=r.error)

    def on_started(self) -> None:
        with self._lock:
            self._state, self.detail = "running", None
            if self.admission.closed_as is EngineRestarting:  # refused while it was down: takes work again
                self.admission.reopen()
            self._dispatch()  # what waited for the (re)start

    def on_lost(self, detail: str) -> None:
        """The core went away: what it held ends with an error; unsupervised (or closing), so does
        everything waiting, and admission closes. Supervised, the line waits for restart()."""
        with self._lock:
            closing, supervised = self._closing, self._supervised
            if not closing:
                self._state = "restarting" if supervised else "failed"
                self.detail = detail
            running = ([], []) if closing or not supervised else self.admission.take_running()
        if closing:
            self._end_everything("the server is shutting down")
            return
        log.error("%s, for %s; %s", detail, self.checkpoint.path,
                  "restarting it" if supervised else "generation stops here")
        if not supervised:
            self._end_everything("the engine process stopped; see the server log", EngineFailed)
            return
        generations, calls = running
        self._end_with(generations, calls, EngineRestarting(
            "the engine process stopped while this request ran; it is being restarted: retry shortly",
            retry_after=max(1, round(self.client.start_seconds))))

    # --- the engine's life ----------------------------------------------------
    def restart(self) -> None:
        """Start a new core (after the last one was lost; the state stays "restarting" until it
        runs). Blocks: call it off the event loop."""
        if self.state == "running" or self._closing:
            return
        try:
            self.client.restart()
        except Exception as e:
            self.detail = f"the engine process could not be started again ({type(e).__name__}: {e})"
            raise

    def kill(self, reason: str) -> None:
        """Kill the core (the watchdog): on_lost follows."""
        self.client.kill(reason)

    def refuse_while_down(self, message: str, retry_after: int) -> None:
        """The restart takes longer than requests may wait: those waiting end with `message`
        (EngineRestarting) and new ones are refused with it until the core runs."""
        with self._lock:
            if self.state == "running" or self._closing:
                return
            self.admission.close(message, EngineRestarting, retry_after)
            generations, calls = self.admission.take_waiting()
        self._end_with(generations, calls, EngineRestarting(message, retry_after))

    def update_retry_after(self, seconds: int) -> None:
        """While refusing during a restart: the Retry-After new refusals carry."""
        with self._lock:
            if self.admission.closed_as is EngineRestarting:
                self.admission.closed_retry_after = seconds

    def give_up(self, message: str, kind: type[EngineClosed]) -> None:
        """No more restarts: everything waiting ends, and admission answers `kind(message)`."""
        self._state, self.detail = "failed", message
        self._end_everything(message, kind)

    def close(self, timeout: float = 10.0) -> None:
        """Close admission, stop the core (it hands over what it held first), then end every
        generation and model call still held with "the server is shutting down"."""
        with self._lock:
            self._closing = True
            self.admission.closed = True
        self.client.close(timeout)
        self._end_everything("the server is shutting down")
        self._state = "stopped"

    def _end_everything(self, message: str, kind: type[EngineClosed] = EngineClosed,
                        retry_after: int | None = None) -> None:
        """Close admission (`kind` with `message`); every generation and model call still
        held, waiting or running, ends with `message`."""
        with self._lock:
            self.admission.close(message, kind, retry_after)
            generations, calls = self.admission.take_everything()
        self._end_with(generations, calls, kind(message, retry_after))

    def _end_with(self, generations: list[Generation], calls: list[ModelCall], error: EngineClosed) -> None:
        """These generations end with an error event saying `error` (its code too); these calls raise it."""
        now = time.perf_counter()
        for g in generations:
            g.t_end = now
        self._deliver([FinishRecord(g, "error", str(error), code=error.code, retry_after=error.retry_after)
                       for g in generations])
        for work in calls:
            work.settle(error=error)

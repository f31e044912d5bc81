"""The engine's front, on the server's side of every engine: admission, each request's output
state, and the engine's life as the server sees it.

A request is admitted here, into two bounded lines (below: QueueFull with Retry-After,
RequestTooLarge, EngineClosed); each generation gets its server-side RequestState (outputs.py),
which the route reads, and joins the stream budget. When a generation gets a slot (and a model
call its turn) the front hands it to the core through its CoreClient (client.py); the core's
records come back through the front's inbox, read on a thread of the front's own (`on_records`;
an engine process's reader thread calls it the same way): a generation's go to its state's
output stage, a finish frees its slot (and the next waiting one is handed over), a model call's
result answers its caller. A waiting generation that is cancelled leaves the line at once, here.

If the core is lost (an engine process died: `on_lost`), what it held ends with an error.
Unsupervised, admission then closes and the waiting requests end too. An EngineSupervisor
(supervisor.py) instead keeps the waiting ones in line and calls restart(): the client starts a
new core, which takes the line from where it was.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import queue
import threading
import time
import uuid
from typing import Callable, Generic, TypeVar

from attnlens.app.engine.client import CoreClient
from attnlens.app.engine.outputs import RequestState, StreamBudget, hand_over
from attnlens.app.engine.records import MODEL_CALL_FAILED, CallResult, CoreRecord, FinishRecord, Record
from attnlens.app.engine.request import CoreCall, Generation, GenerationParams
from attnlens.model import Checkpoint
from attnlens.model.analysis.operations import Operation, R

__all__ = ["MODEL_CALL_FAILED", "Admission", "DrainRate", "EngineClosed", "EngineFailed", "EngineFront",
           "EngineRestarting", "ModelCall", "QueueFull", "RequestTooLarge"]

log = logging.getLogger("attnlens.engine")

# --- admission and back-pressure: who may wait, who gets a slot, and when to come back ---------
# Two bounded lines, each with its own limit:
# * generations: at most `max_concurrent` in slots (decoding) plus `max_queue` waiting;
# * model calls (one /attention forward each): at most `max_calls` running or waiting, so a
#   burst of full-context attention requests can neither exhaust memory nor starve generation.
# A request of several generations (a /v1 prompt list times n) is admitted whole or not at all;
# one that could never fit, even on an idle server, is RequestTooLarge (a 400), not "busy". A full
# line answers QueueFull with a Retry-After derived from the measured drain rate (generations
# finished per second, over the recent ones) and the queue ahead: it grows with the queue and
# shrinks when generations finish fast. It all runs under the front's lock; the clock is injectable.

T = TypeVar("T")

RETRY_AFTER_MAX_S = 3600
DRAIN_WINDOW = 32  # finished generations the drain rate is measured over
DRAIN_HORIZON_S = 300.0  # older finishes no longer count


class QueueFull(Exception):
    """No slot and no room in the waiting line: retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class RequestTooLarge(Exception):
    """The request asks for more generations than the server can ever hold at once."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineClosed(Exception):
    """The engine takes no work: the server is shutting down (or, subclasses, its engine is
    being restarted or has failed). `code` is what the client's 503 says; `retry_after` (s),
    when known, goes in its Retry-After header."""

    code = "shutting_down"

    def __init__(self, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class EngineRestarting(EngineClosed):
    """The engine process stopped and a new one is starting: come back in `retry_after` seconds."""

    code = "engine_restarting"


class EngineFailed(EngineClosed):
    """The engine stopped and will not be restarted (restarts are off, or it kept failing)."""

    code = "engine_failed"


class DrainRate:
    """Generations finished per second, measured over the last DRAIN_WINDOW finishes.

    rate = finishes / (now - oldest counted finish): it falls while nothing finishes, so a
    stalled server asks clients to wait longer. Before anything has finished, it is estimated
    from the measured decode step time and the tokens the running generations still owe.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, measured_step: Callable[[], float] = float):
        self.clock = clock
        self.finished: collections.deque[float] = collections.deque(maxlen=DRAIN_WINDOW)
        self.step_seconds = 0.0  # moving average of one decode step (0 = not noted here: measured_step())
        self.measured_step = measured_step  # the core's own average, read only when a refusal needs it

    def note_finished(self) -> None:
        self.finished.append(self.clock())

    def note_step(self, seconds: float) -> None:
        self.step_seconds = seconds if self.step_seconds == 0 else 0.9 * self.step_seconds + 0.1 * seconds

    def per_second(self, running: int, tokens_owed: int) -> float | None:
        """The measured rate, or an estimate; None when nothing is known at all."""
        now = self.clock()
        while self.finished and now - self.finished[0] > DRAIN_HORIZON_S:
            self.finished.popleft()
        if self.finished:
            return len(self.finished) / max(now - self.finished[0], 1e-3)
        step = self.step_seconds or self.measured_step()
        if running and tokens_owed and step > 0:
            # each step advances every running generation by one token
            return running / (tokens_owed / running * step)
        return None

    def retry_after(self, ahead: int, running: int, tokens_owed: int) -> int:
        """Seconds until `ahead` more generations have finished, at the current rate."""
        rate = self.per_second(running, tokens_owed)
        if rate is None:
            return 1
        return int(min(RETRY_AFTER_MAX_S, max(1, math.ceil(ahead / rate))))


class Line(Generic[T]):
    """A bounded line: items in service (`running`) and items waiting, oldest first."""

    def __init__(self, slots: int, queue: int):
        self.slots = slots
        self.queue = queue
        self.waiting: collections.deque[T] = collections.deque()
        self.running: list[T] = []

    @property
    def capacity(self) -> int:
        return self.slots + self.queue

    @property
    def held(self) -> int:
        return len(self.waiting) + len(self.running)

    def room(self) -> int:
        return self.capacity - self.held

    def remove_waiting(self, item: T) -> bool:
        try:
            self.waiting.remove(item)
            return True
        except ValueError:
            return False

    def take(self) -> list[T]:
        """Move waiting items into free slots; return them."""
        moved = []
        while self.waiting and len(self.running) < self.slots:
            item = self.waiting.popleft()
            self.running.append(item)
            moved.append(item)
        return moved


class Admission:
    """Admission for generations and model calls (see the comment above)."""

    def __init__(self, max_concurrent: int, max_queue: int, max_calls: int, *,
                 calls_limit: str = "ATTNLENS_MAX_ATTENTION_CONCURRENT", clock: Callable[[], float] = time.monotonic,
                 measured_step: Callable[[], float] = float):
        self.generations: Line = Line(max_concurrent, max_queue)
        self.calls: Line = Line(1, max(0, max_calls - 1))
        self.calls_limit = calls_limit  # the setting(s) a full call line names
        self.drain = DrainRate(clock, measured_step)
        self.call_seconds = 0.0  # moving average of one model call
        self.closed = False
        self.closed_reason = "the server is shutting down"  # what admission answers once closed
        self.closed_as: type[EngineClosed] = EngineClosed  # ... and as which error
        self.closed_retry_after: int | None = None

    def close(self, reason: str, kind: type[EngineClosed] = EngineClosed, retry_after: int | None = None) -> None:
        """Admission answers `kind(reason, retry_after)` until reopen()."""
        self.closed, self.closed_reason, self.closed_as, self.closed_retry_after = True, reason, kind, retry_after

    def reopen(self) -> None:
        self.closed, self.closed_as, self.closed_retry_after = False, EngineClosed, None

    def _refuse(self) -> EngineClosed:
        return self.closed_as(self.closed_reason, self.closed_retry_after)

    def tokens_owed(self) -> int:
        return sum(max(0, g.params.max_new_tokens - g.produced) for g in self.generations.running)

    def retry_after(self, needed: int = 1) -> int:
        """Seconds for the generations waiting (and `needed` more) to get through."""
        line = self.generations
        ahead = len(line.waiting) + needed
        return self.drain.retry_after(ahead, len(line.running), self.tokens_owed())

    def admit_generations(self, items: list, *, param: str | None = None) -> None:
        """Queue all of `items` or none of them."""
        if self.closed:
            raise self._refuse()
        line, n = self.generations, len(items)
        if n > line.capacity:
            raise RequestTooLarge(
                f"this request needs {n} generations at once, more than the server can ever hold: "
                f"{line.slots} running + {line.queue} waiting (ATTNLENS_MAX_CONCURRENT + ATTNLENS_MAX_QUEUE); "
                "send fewer prompts or a smaller n per request", param=param)
        if n > line.room():
            held = line.held
            raise QueueFull(
                f"server busy: {held} generations already running or waiting (limit {line.capacity})"
                + (f", no room for {n} more" if n > 1 else "") + "; retry later",
                self.retry_after(n))
        line.waiting.extend(items)

    def admit_call(self, item) -> None:
        if self.closed:
            raise self._refuse()
        line = self.calls
        if line.room() < 1:
            wait = math.ceil(max(self.call_seconds, 0.1) * (line.held + 1))
            raise QueueFull(
                f"server busy: {line.held} model calls already running or waiting (limit "
                f"{line.capacity}, {self.calls_limit}); retry later",
                int(min(RETRY_AFTER_MAX_S, max(1, wait))))
        line.waiting.append(item)

    def take_running(self) -> tuple[list, list]:
        """Empty the running places of both lines (an engine process died with them): the waiting stay."""
        taken = []
        for line in (self.generations, self.calls):
            taken.append(list(line.running))
            line.running.clear()
        return taken[0], taken[1]

    def take_waiting(self) -> tuple[list, list]:
        """Empty the waiting places of both lines."""
        taken = []
        for line in (self.generations, self.calls):
            taken.append(list(line.waiting))
            line.waiting.clear()
        return taken[0], taken[1]

    def take_everything(self) -> tuple[list, list]:
        """Empty both lines (the engine is stopping): every generation and model call, waiting or running."""
        taken = []
        for line in (self.generations, self.calls):
            taken.append([*line.waiting, *line.running])
            line.waiting.clear()
            line.running.clear()
        return taken[0], taken[1]

    def call_finished(self, item, seconds: float) -> None:
        self.calls.running.remove(item)
        self.call_seconds = seconds if self.call_seconds == 0 else 0.8 * self.call_seconds + 0.2 * seconds

    def generation_finished(self, item) -> None:
        self.generations.running.remove(item)
        self.drain.note_finished()


# --- the front ---------------------------------------------------------------------------------


class ModelCall(CoreCall):
    """Run a model operation once on the model's side (e.g. one attention forward): `operation` is
    one of model/analysis/operations.py's calls, plain data that travels pickled to an engine
    process. Besides what the core reads (CoreCall), its caller's event loop and future."""

    def __init__(self, loop: asyncio.AbstractEventLoop, operation: Operation[object]):
        CoreCall.__init__(self, operation)
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

        try:
            self.loop.call_soon_threadsafe(apply)
        except RuntimeError:  # the loop is closed: nobody waits for the answer
            pass


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
                                   clock=clock, measured_step=lambda: client.step_seconds)
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
        # an in-process core's hand-overs, read here on a thread of their own (None ends it)
        self.inbox: queue.SimpleQueue[list[CoreRecord] | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read_inbox, name="attnlens-front", daemon=True)
        self._reader.start()
        client.start(self)

    def _read_inbox(self) -> None:
        while (records := self.inbox.get()) is not None:
            self.on_records(records)

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
        generations = [Generation(p, id=f"gen-{uuid.uuid4().hex[:24]}") for p in params]
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
        (core.py's SteppedCall)."""
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
        self.inbox.put(None)  # what the core handed over before it stopped is read first
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)
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

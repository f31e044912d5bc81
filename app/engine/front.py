"""The event-loop side every engine shares: admission, cancellation, model calls, counters.

An engine is this front plus a core that runs the model: `Engine` (core.py) steps it on a
thread of this process, `EngineProcess` (process.py) in a process of its own. Either way a
request is admitted here, into the scheduler's bounded lines (QueueFull with Retry-After,
RequestTooLarge), and read back as events from its Generation; a waiting generation that is
cancelled leaves the line at once, here, without waiting for the core.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from attnlens.model import Checkpoint

from .outputs import FinishRecord, Record, RequestState, call_soon, hand_over
from .scheduler import EngineClosed, Scheduler
from .stream_budget import StreamBudget

if TYPE_CHECKING:
    from .core import Generation


# What a model call's caller is told when it fails (the details stay in the server's log)
MODEL_CALL_FAILED = "internal error in a model call; see the server log"


class ModelCall:
    """Run a model operation once on the model's side (e.g. one attention forward): `operation` is
    one of model/analysis/operations.py's calls, plain data that travels by pickle to an engine
    process."""

    def __init__(self, loop: asyncio.AbstractEventLoop, operation: Any):
        self.loop = loop
        self.operation = operation
        self.future: asyncio.Future = loop.create_future()
        self.cancelled = False
        self.t_start = 0.0  # when the core was given it

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        def apply():
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(result)

        call_soon(self.loop, apply)


class EngineFront:
    """Admission and the counters /metrics reads; subclasses run the model (see the module docstring)."""

    def __init__(self, checkpoint: Checkpoint, *, max_concurrent: int, max_queue: int, max_attention_concurrent: int,
                 max_stream_backlog_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.config = checkpoint.config
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.max_stream_backlog_bytes = max_stream_backlog_bytes  # per generation, unread events
        self.scheduler = Scheduler(max_concurrent, max_queue, max_attention_concurrent, clock=clock)
        self._lock = threading.Lock()
        self.waiting_cancelled = 0  # generations that left the line before they ran
        # what every stream's unread events may hold between them, shared by all engines (main.py)
        self.stream_budget: StreamBudget | None = None
        # each admitted generation's server-side state, by number, until its last record
        self._states: dict[int, RequestState] = {}
        # starting | running | restarting | failed | stopped (an EngineSupervisor reports it)
        self.state = "running"
        self.detail: str | None = None  # why it is not running, when it is not

    def stalled_for(self, now: float) -> float:
        """Seconds the core has held work without a sign of progress (0: idle or progressing)."""
        return 0.0

    # --- introspection (metrics) -------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self.scheduler.generations.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.generations.waiting)

    @property
    def attention_in_flight(self) -> int:
        return self.scheduler.calls.held

    # --- event loop side ---------------------------------------------------
    def submit(self, params) -> RequestState:
        """Admit one generation (raises QueueFull / EngineClosed); read it with .events()."""
        return self.submit_all([params])[0]

    def submit_all(self, params: list, *, param: str | None = None) -> list[RequestState]:
        """Admit all of these generations or none (QueueFull, RequestTooLarge, EngineClosed): each
        an engine-side Generation, and its server-side RequestState, which the caller reads."""
        from .core import Generation

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

    def admit(self, generations: list, *, param: str | None = None) -> None:
        for g in generations:
            g.engine = self
        with self._lock:
            self.scheduler.admit_generations(generations, param=param)
            self._admitted()

    async def call(self, operation: Any) -> Any:
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

    def _call_abandoned(self, work) -> None:
        """Its caller left while `work` waited or ran: a running call stops at its next report point
        (app/engine/progress.py), where the core reads `cancelled`."""

    def admit_call(self, work) -> None:
        with self._lock:
            self.scheduler.admit_call(work)
            self._admitted()

    def _cancel(self, g) -> None:
        """g was cancelled: a waiting generation leaves the line at once, and ends; a running
        one is the core's to stop (`_cancel_running`)."""
        with self._lock:
            removed = self.scheduler.generations.remove_waiting(g)
            if removed:
                self.waiting_cancelled += 1
        if removed:
            g.t_end = time.perf_counter()
            self._emit([FinishRecord(g, "cancelled")])
        else:
            self._cancel_running(g)

    def _end_everything(self, message: str, kind: type[EngineClosed] = EngineClosed,
                        retry_after: int | None = None) -> None:
        """Close admission (`kind` with `message`); every generation and model call still
        held, waiting or running, ends with `message`."""
        with self._lock:
            self.scheduler.close(message, kind, retry_after)
            generations, calls = self.scheduler.take_everything()
        self._end_with(generations, calls, kind(message, retry_after))

    def _end_with(self, generations: list, calls: list, error: EngineClosed) -> None:
        """These generations end with an error event saying `error` (its code too); these calls raise it."""
        now = time.perf_counter()
        for g in generations:
            g.t_end = now
        self._emit([FinishRecord(g, "error", str(error), code=error.code, retry_after=error.retry_after)
                    for g in generations])
        for work in calls:
            work.settle(error=error)

    # --- what a core provides ----------------------------------------------
    def _admitted(self) -> None:
        """Under the lock: new work is in the scheduler's lines."""
        raise NotImplementedError

    def _cancel_running(self, g) -> None:
        """g was cancelled while in a slot (or already finished)."""

    def _stop(self, g) -> None:
        """The output stage asks the core to end g at its next step."""

    def _emit(self, records: list[Record]) -> None:
        hand_over(records, self._states)

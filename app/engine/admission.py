"""Admission and back-pressure: who may wait, who gets a slot, and when to come back.

Two bounded lines, each with its own limit:
* generations: at most `max_concurrent` in slots (decoding) plus `max_queue` waiting;
* model calls (one /attention forward each): at most `max_calls` running or waiting, so a
  burst of full-context attention requests can neither exhaust memory nor starve generation.

A request of several generations (a /v1 prompt list times n) is admitted whole or not at
all; one that could never fit, even on an idle server, is RequestTooLarge (a 400), not
"busy". A full line answers QueueFull with a Retry-After derived from the measured drain
rate (generations finished per second, over the recent ones) and the queue ahead: it grows
with the queue and shrinks when generations finish fast.

Everything here runs under the engine's lock; the clock is injectable for tests.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Callable, Generic, TypeVar

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

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.finished: collections.deque[float] = collections.deque(maxlen=DRAIN_WINDOW)
        self.step_seconds = 0.0  # moving average of one decode step (0 = not measured yet)

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
        if running and tokens_owed and self.step_seconds > 0:
            # each step advances every running generation by one token
            return running / (tokens_owed / running * self.step_seconds)
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
    """Admission for generations and model calls (see the module docstring)."""

    def __init__(self, max_concurrent: int, max_queue: int, max_calls: int, *,
                 calls_limit: str = "ATTNLENS_MAX_ATTENTION_CONCURRENT", clock: Callable[[], float] = time.monotonic):
        self.generations: Line = Line(max_concurrent, max_queue)
        self.calls: Line = Line(1, max(0, max_calls - 1))
        self.calls_limit = calls_limit  # the setting(s) a full call line names
        self.drain = DrainRate(clock)
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

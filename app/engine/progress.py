"""A long model call's heartbeat (an /attention analysis of a long prompt): the function the engine
runs calls `report()` as it works, and the engine hands an empty step over (at most one a second),
which an engine process's watchdog (ATTNLENS_ENGINE_STALL_S) counts as progress. Outside a model
call, `report()` does nothing."""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Callable, Iterator

_reporter: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("attnlens_call_progress",
                                                                                      default=None)


def report() -> None:
    """The running model call is still working."""
    fn = _reporter.get()
    if fn is not None:
        fn()


@contextlib.contextmanager
def reporting(heartbeat: Callable[[], None], every_s: float = 1.0, clock=time.monotonic) -> Iterator[None]:
    """Within this block report() calls `heartbeat`, at most once every `every_s` seconds."""
    last = [clock()]

    def throttled() -> None:
        now = clock()
        if now - last[0] >= every_s:
            last[0] = now
            heartbeat()

    token = _reporter.set(throttled)
    try:
        yield
    finally:
        _reporter.reset(token)

"""A long model call's report points (an /attention analysis of a long prompt): the function the
engine runs calls `report()` after each block of its work. In the engine's core a report point
ends one slice of the call (stepped_call.py): the core hands over a heartbeat for the watchdog
(ATTNLENS_ENGINE_STALL_S), gives the generations decoding beside it their step, and resumes the
call, or stops it there once its caller has gone (report() raises CallCancelled).

Outside a model call, `report()` does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator


class CallCancelled(Exception):
    """The caller of a model call went away: the call stopped at its next report point."""


_reporter: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("attnlens_call_progress",
                                                                                      default=None)


def report() -> None:
    """The running model call is still working (and may be paused or stopped here)."""
    fn = _reporter.get()
    if fn is not None:
        fn()


@contextlib.contextmanager
def reporting(*, cancelled: Callable[[], bool] | None = None,
              at_report: Callable[[], None] | None = None) -> Iterator[None]:
    """Within this block report() raises CallCancelled once `cancelled()` is true, else calls
    `at_report()` (the stepped call's pause: the core's turn)."""

    def on_report() -> None:
        if cancelled is not None and cancelled():
            raise CallCancelled("the caller went away")
        if at_report is not None:
            at_report()

    token = _reporter.set(on_report)
    try:
        yield
    finally:
        _reporter.reset(token)

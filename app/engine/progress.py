"""A long model call's report points (an /attention analysis of a long prompt): the function the
engine runs calls `report()` after each block of its work, and the engine uses each one to

- hand over an empty step (at most one a second), which an engine process's watchdog
  (ATTNLENS_ENGINE_STALL_S) counts as progress;
- stop the call once its caller has gone (`cancelled`): report() raises CallCancelled;
- give the generations decoding beside it a turn (`turn`): a long analysis takes turns with the
  decode steps instead of holding them up until it ends.

Outside a model call, `report()` does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from typing import Callable, Iterator


class CallCancelled(Exception):
    """The caller of a model call went away: the call stopped at its next report point."""


_reporter: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("attnlens_call_progress",
                                                                                      default=None)


def report() -> None:
    """The running model call is still working (and may be stopped or paused here)."""
    fn = _reporter.get()
    if fn is not None:
        fn()


@contextlib.contextmanager
def reporting(heartbeat: Callable[[], None] | None = None, every_s: float = 1.0, clock=time.monotonic, *,
              cancelled: Callable[[], bool] | None = None, turn: Callable[[], None] | None = None) -> Iterator[None]:
    """Within this block report() raises CallCancelled once `cancelled()` is true, calls
    `heartbeat` at most once every `every_s` seconds, then `turn()` (other work's turn, run in a
    context of its own: it sees neither this call's reporter nor its hooks)."""
    last = [clock()]

    def at_report() -> None:
        if cancelled is not None and cancelled():
            raise CallCancelled("the caller went away")
        now = clock()
        if heartbeat is not None and now - last[0] >= every_s:
            last[0] = now
            heartbeat()
        if turn is not None:
            contextvars.Context().run(turn)

    token = _reporter.set(at_report)
    try:
        yield
    finally:
        _reporter.reset(token)

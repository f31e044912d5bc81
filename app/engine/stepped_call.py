"""A model call that the core steps: it runs until its next report point, then hands control back
to the core, which runs the generations' step and resumes it (vLLM's core loop, with a long
operation as one more kind of work in it).

The operation is ordinary code (model/analysis/), whose report points lie deep inside forwards
and hook points. It runs on a greenlet of its own: a stack that it leaves at each report point
and that the core re-enters at the next step, on the core's own thread. So the core's loop stays
flat (schedule, a slice of the call, a prefill piece, a decode step), nothing calls step() from
inside a call, and every kernel still runs on the one thread that OpenMP serves (a second thread
would get a team of workers of its own). Each greenlet has its own context: the call's hooks and
reporter (contextvars) stay with the call, and the generations' steps never see them.

    call = SteppedCall(lambda: run_operation(model, op, report=progress.report))
    while not call.advance():    # one slice: to the next report point, or the end
        ...                      # the generations' step, a heartbeat
    call.value / call.error
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import greenlet

from attnlens.app.engine import progress

__all__ = ["SteppedCall"]


class SteppedCall:
    """`fn()` run a slice at a time by advance(); its value or exception is kept when it ends.
    `progress.report()` inside it ends the slice; once stop() was asked, it raises CallCancelled."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn = fn
        self._greenlet = greenlet.greenlet(self._body)
        # the call runs in a copy of its creator's context, as a plain call would
        self._greenlet.gr_context = contextvars.copy_context()
        self.stop_asked = False
        self.slices = 0  # slices run (report points reached, plus the last one)
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None

    def _body(self) -> Any:
        with progress.reporting(at_report=self._pause):
            return self._fn()

    def _pause(self) -> None:
        """At a report point (on the call's stack): back to the core until the next slice."""
        parent = self._greenlet.parent
        assert parent is not None  # the greenlet that started the call: the core's
        parent.switch()
        if self.stop_asked:
            raise progress.CallCancelled("the caller went away")

    def advance(self) -> bool:
        """Run one slice of the call (on the caller's thread, which must be the one that made it).
        True once it has ended; then `value` or `error` holds what it gave."""
        if self.done:
            return True
        if self.stop_asked and not self._greenlet:  # stopped before it started: it never runs
            return self._end(error=progress.CallCancelled("the caller went away"))
        self.slices += 1
        try:
            value = self._greenlet.switch()
        except BaseException as e:  # the call's exception (CallCancelled at a report point too)
            return self._end(error=e)
        if self._greenlet.dead:
            return self._end(value=value)
        return False

    def stop(self) -> None:
        """Its caller went away: the call raises CallCancelled at its next report point."""
        self.stop_asked = True

    def abandon(self) -> None:
        """The core is closing: unwind the call's stack now (its `finally` blocks run here)."""
        if not self.done and self._greenlet:
            self.stop_asked = True
            self.advance()

    def _end(self, value: Any = None, error: BaseException | None = None) -> bool:
        self.done, self.value, self.error = True, value, error
        self._fn = _ended  # what it held is released with the call's frames
        return True


def _ended() -> None:
    return None

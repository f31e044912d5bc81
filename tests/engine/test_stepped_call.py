"""A model call stepped by the core (app/engine/core.py's SteppedCall): it runs a slice at a time, each
ending at a report point, on the core's own thread; its context (hooks) stays its own;
a stopped call raises at its next report point and unwinds its stack."""

from __future__ import annotations

import contextvars
import threading

import pytest

from attnlens.app.engine.core import CallCancelled, SteppedCall

marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="none")


def test_a_call_runs_a_slice_per_report_point_and_keeps_its_value():
    trail = []

    def work(report):
        for i in range(3):
            trail.append(i)
            report()
        return "done"

    call = SteppedCall(work)
    assert trail == []  # nothing runs until the core advances it
    for expected in ([0], [0, 1], [0, 1, 2]):
        assert call.advance() is False and trail == expected
    assert call.advance() is True and call.value == "done" and call.error is None
    assert call.slices == 4 and call.advance() is True  # an ended call stays ended


def test_each_slice_runs_on_the_callers_thread_between_the_callers_own_work():
    """The core's work between slices runs on the core's stack, not inside the call's: nothing
    re-enters the core from a report point."""
    import traceback

    threads, stacks = [], []

    def work(report):
        threads.append(threading.get_ident())
        report()
        threads.append(threading.get_ident())

    call = SteppedCall(work)
    while not call.advance():
        stacks.append([f.name for f in traceback.extract_stack()])
    assert threads == [threading.get_ident()] * 2
    assert stacks and all("work" not in names and "report" not in names for names in stacks)


def test_the_call_sees_its_creators_context_and_keeps_its_own_settings_to_itself():
    marker.set("core")
    seen = []

    def work(report):
        seen.append(marker.get())
        marker.set("call")
        report()
        seen.append(marker.get())

    call = SteppedCall(work)
    call.advance()
    assert marker.get() == "core"  # the call's setting is not the core's
    call.advance()
    assert seen == ["core", "call"]
    

def test_an_exception_is_the_calls_own():
    def work(report):
        report()
        raise ValueError("bad input")

    call = SteppedCall(work)
    assert call.advance() is False
    assert call.advance() is True and isinstance(call.error, ValueError)


def test_a_stopped_call_raises_at_its_next_report_point_and_unwinds():
    unwound = []

    def work(report):
        try:
            while True:
                report()
        finally:
            unwound.append(True)

    call = SteppedCall(work)
    assert call.advance() is False and call.advance() is False
    call.stop()
    assert call.advance() is True
    assert isinstance(call.error, CallCancelled) and unwound == [True]


def test_a_call_stopped_before_it_starts_never_runs():
    ran = []
    call = SteppedCall(lambda report: ran.append(1))
    call.stop()
    assert call.advance() is True and isinstance(call.error, CallCancelled) and ran == []


def test_abandon_unwinds_a_paused_call_on_the_spot():
    unwound = []

    def work(report):
        try:
            report()
            pytest.fail("resumed after abandon")
        finally:
            unwound.append(True)

    call = SteppedCall(work)
    call.advance()
    call.abandon()
    assert unwound == [True] and call.done

"""One budget for what every stream's client has left unread (ATTNLENS_MAX_STREAM_BACKLOG_TOTAL_BYTES).

Each stream's unread events are bounded on their own (ATTNLENS_MAX_STREAM_BACKLOG_BYTES, in
outputs.py), but many clients that each stay under that bound could still hold any amount
between them. This budget counts the estimated bytes of every stream's queued events, across
all models. When an event would take the total past the limit, the stream holding the most
(the client furthest behind, usually one that does not read at all) is shed: its unread
events are dropped, which gives their memory back at once, and it ends with an error event
saying why; its generation stops at the next step. The others go on.

A stream's events leave the count when its client takes them, when it is cancelled (its
client went away while it ran), and when its output is freed (its client went away after the
end: the route lets go of the generation, and its output has no reference cycle to wait for).

Freed memory goes back to the allocator, which keeps it for later unless told otherwise: when
every stream's backlog is gone after more than TRIM_AFTER_BYTES (estimated) were held, glibc's
malloc_trim gives the free pages back to the system, so the server's RSS comes back down.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Protocol

from attnlens.app.engine import heap

log = logging.getLogger("attnlens.engine")

TRIM_AFTER_BYTES = 16_000_000


class Held:
    """The bytes one stream holds: shared by its output and the finaliser that returns them."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0


class Stream(Protocol):
    """A stream's output as the budget sees it (outputs.RequestState is one)."""

    held: Held
    shed: bool
    budget: "StreamBudget | None"

    def shed_backlog(self, limit: int) -> None:
        """Drop the unread events and end the stream with an error saying why."""


class StreamBudget:
    """Estimated bytes of unread stream events, all streams together (see the module docstring).
    Used on the event loop only."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_use = 0
        self.shed = 0  # streams ended to keep within the limit
        self._lock = threading.Lock()  # a finaliser may run on whichever thread collects garbage
        self.high_water = 0  # the most held since the backlogs were last all gone
        self._outputs: weakref.WeakSet[Stream] = weakref.WeakSet()

    def join(self, output: Stream) -> None:
        """Count `output`'s queued events from now on."""
        output.budget = self
        self._outputs.add(output)
        weakref.finalize(output, self._collected, output.held)

    def add(self, n: int) -> None:
        with self._lock:
            self.in_use += n
            self.high_water = max(self.high_water, self.in_use)
        if n < 0:
            self._maybe_trim()

    def _maybe_trim(self) -> None:
        """Every backlog is gone after a large one: give the free memory back to the system."""
        with self._lock:
            if self.in_use > 0 or self.high_water < TRIM_AFTER_BYTES:
                return
            self.high_water = 0
        heap.trim()

    def over(self) -> bool:
        return self.in_use > self.limit

    def shed_largest(self) -> None:
        """Shed streams, the one holding most first, until the total is within the limit."""
        while self.in_use > self.limit:
            victim = max((o for o in self._outputs if o.held.bytes > 0 and not o.shed),
                         key=lambda o: o.held.bytes, default=None)
            if victim is None:
                return
            self.shed += 1
            log.warning("stream backlogs hold %.1f MB (limit %.1f MB, ATTNLENS_MAX_STREAM_BACKLOG_TOTAL_BYTES): "
                        "ending the stream whose client left the most unread (%.1f MB)", self.in_use / 1e6,
                        self.limit / 1e6, victim.held.bytes / 1e6)
            victim.shed_backlog(self.limit)

    def _collected(self, held: Held) -> None:
        with self._lock:
            self.in_use -= held.bytes
            held.bytes = 0
        self._maybe_trim()

"""The output stage: typed records from the model thread -> each request's events.

The engine core (model thread) only produces records (records.py) about its engine-side
requests (`Generation`, request.py): a generated token (ids, log-probs, attention rows as tensors), a
prompt's scores, the end of a generation. Everything else happens here, in the request's
server-side state (`RequestState`: its event loop, its output stage, what its client has not
read yet), on the event loop that submitted it: ids -> display text, stop strings
(TextStream), log-prob alternatives, attention rows -> rounded arrays, and the events
`TokenEvent` / `DoneEvent` / `ErrorEvent`. These are the engine's own dataclasses: the
engine does not know the API's schemas, and the serving layer (app/serving/generation_streams.py) turns
them into the responses the routes send.

When a stop string completes, the output stage asks the core to stop the generation; the
core retires it at its next step and sends the final record, so a client that sees `done`
also sees the generation's slot free again.

A token's event is built when its client takes it, not when its record arrives: until then
the queue holds the record's compact tensors (4 bytes a probability). The event's attention
stays arrays (float64, rounded) that the route writes to JSON as they are (generation_streams.py):
never a Python float per probability, whose memory Python's small-object arenas keep after a
burst of streams (the arenas stay mapped while any object in them lives). What a stream's
client leaves unread is bounded per stream (ATTNLENS_MAX_STREAM_BACKLOG_BYTES) and for all
streams together (StreamBudget, below).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, Union

import numpy as np
import torch

from attnlens.app.engine import heap
from attnlens.app.engine.records import FinishRecord, PromptRecord, Record, TokenRecord
from attnlens.app.engine.textstream import Released, TextStream
from attnlens.model.decoding import GeneratedToken
from attnlens.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from attnlens.app.engine.request import Generation

__all__ = ["Alternative", "DoneEvent", "ErrorEvent", "Event", "FinishRecord", "GenerationCancelled", "PromptRecord",
           "Record", "RequestState", "ScoredToken", "StreamBudget", "Timing", "TokenEvent", "TokenRecord", "hand_over"]


# Estimated memory of an event held for a stream's client: a token event, and each attention
# probability in it (32: what a Python float in a list took; its float64 and JSON text take
# about 8 + 10, so the estimate is generous). Bounded per stream by ATTNLENS_MAX_STREAM_BACKLOG_BYTES.
EVENT_BYTES = 512
FLOAT_BYTES = 32
BATCH_BYTES = 1_000_000  # at most this much (estimated) is built into events for one write


# --- the stream budget: what every stream's client has left unread, together -------------------
# ATTNLENS_MAX_STREAM_BACKLOG_TOTAL_BYTES.
# Each stream's unread events are bounded on their own (ATTNLENS_MAX_STREAM_BACKLOG_BYTES,
# RequestState), but many clients that each stay under that bound could still hold any amount
# between them. This budget counts the estimated bytes of every stream's queued events, across
# all models. When an event would take the total past the limit, the stream holding the most
# (the client furthest behind, usually one that does not read at all) is shed: its unread
# events are dropped, which gives their memory back at once, and it ends with an error event
# saying why; its generation stops at the next step. The others go on.
#
# A stream's events leave the count when its client takes them, when it is cancelled (its
# client went away while it ran), and when its output is freed (its client went away after the
# end: the route lets go of the generation, and its output has no reference cycle to wait for).
#
# Freed memory goes back to the allocator, which keeps it for later unless told otherwise: when
# every stream's backlog is gone after more than TRIM_AFTER_BYTES (estimated) were held, glibc's
# malloc_trim gives the free pages back to the system, so the server's RSS comes back down.

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
    """Estimated bytes of unread stream events, all streams together (see the comment above).
    Used on the event loop, but for the finalisers of collected outputs.

    A finaliser runs wherever the garbage collector runs, which is inside any allocation, on any
    thread: inside add()'s own locked sums too. So it takes no lock and counts nothing itself: it
    leaves the bytes it returns in a deque, and the budget counts them the next time it is read
    or added to (and the event loop is asked to do that soon). A finaliser that took the lock
    deadlocked the event loop when the collection ran inside add() (a 20-minute soak)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._in_use = 0
        self.shed = 0  # streams ended to keep within the limit
        self._lock = threading.Lock()  # the sums: add() on the loop, a reading of in_use on any thread
        self._returned: collections.deque[int] = collections.deque()  # by finalisers, not yet counted
        self._loop: asyncio.AbstractEventLoop | None = None  # where the finalisers ask for the count
        self.high_water = 0  # the most held since the backlogs were last all gone
        self._outputs: weakref.WeakSet[Stream] = weakref.WeakSet()

    @property
    def in_use(self) -> int:
        self._count_returned()
        return self._in_use

    def join(self, output: Stream) -> None:
        """Count `output`'s queued events from now on."""
        output.budget = self
        self._outputs.add(output)
        if self._loop is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
        weakref.finalize(output, self._collected, output.held)

    def add(self, n: int) -> None:
        with self._lock:
            self._in_use += n
            self.high_water = max(self.high_water, self._in_use)
        if n < 0:
            self._maybe_trim()

    def _count_returned(self) -> None:
        """Count the bytes the finalisers returned since the last count."""
        freed = 0
        while self._returned:  # most readings find it empty: no exception raised on the hot path
            try:
                freed += self._returned.popleft()
            except IndexError:  # another thread's reading took the last one
                break
        if freed:
            self.add(-freed)

    def _maybe_trim(self) -> None:
        """Every backlog is gone after a large one: give the free memory back to the system."""
        with self._lock:
            if self._in_use > 0 or self.high_water < TRIM_AFTER_BYTES:
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
        """An output was collected: its bytes go back (the class docstring: no lock, no sums here)."""
        self._returned.append(held.bytes)
        held.bytes = 0
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._count_returned)  # the trim, when nothing reads the budget
            except RuntimeError:  # the loop is closed: the next reading counts them
                pass


class GenerationCancelled(Exception):
    """The generation was cancelled (its client went away) before it finished."""


# --- events: what a request's reader gets ------------------------------------------
@dataclass
class Alternative:
    id: int
    text: str
    logprob: float


@dataclass
class ScoredToken:
    """A token with its log-probability and the top alternatives at its step."""

    id: int
    text: str
    logprob: float
    top_logprobs: list[Alternative]


@dataclass
class TokenEvent(ScoredToken):
    """A generated token the client sees: its place, its text and the exact text it adds."""

    index: int = 0
    delta: str = ""
    attention: list[np.ndarray] | None = None  # per layer (heads, keys) float64, rounded to 6 places
    cross_attention: list[np.ndarray] | None = None


@dataclass
class Timing:
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    tokens_per_second: float
    time_to_first_token_ms: float


@dataclass
class DoneEvent:
    """The end of a generation that ran to its end (length, EOS or a stop string)."""

    id: str
    finish_reason: str
    prompt_tokens: list[tuple[int, str]]  # (id, display text) of each prompt token
    text: str  # the whole generated text
    delta: str  # text no token event carried (a final partial character, usually empty)
    completion_tokens: int
    timings: Timing


@dataclass
class ErrorEvent:
    message: str
    code: str
    retry_after: int | None = None


Event = Union[TokenEvent, DoneEvent, ErrorEvent]


def dispatch(records: list[Record], states: list["RequestState"]) -> None:
    """Deliver one step's records to their requests' states, in order (on their event loop)."""
    for record, state in zip(records, states):
        state.handle(record)


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """From any thread: run fn(*args) on `loop`, unless the loop is closed (nobody listens)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed
        pass


def hand_over(records: list[Record], states: dict[int, "RequestState"]) -> None:
    """From any thread: hand records to their requests' states (`states`, by generation number),
    one call per event loop. A finished generation's state leaves `states` here."""
    by_loop: dict[asyncio.AbstractEventLoop, tuple[list[Record], list[RequestState]]] = {}
    for r in records:
        number = r.generation.number
        state = states.pop(number, None) if isinstance(r, FinishRecord) else states.get(number)
        if state is None:  # nobody reads it (its state has ended)
            continue
        rs, ss = by_loop.setdefault(state.loop, ([], []))
        rs.append(r)
        ss.append(state)
    for loop, (rs, ss) in by_loop.items():
        call_soon(loop, dispatch, rs, ss)


def event_bytes(token: GeneratedToken) -> int:
    """Estimated memory of a token's event: its attention rows dominate when it has them."""
    if token.attention is None and token.cross_attention is None:
        return EVENT_BYTES
    floats = sum(a.numel() for a in token.attention or ()) + sum(c.numel() for c in token.cross_attention or ())
    return EVENT_BYTES + FLOAT_BYTES * floats


def attention_rows(rows: list[torch.Tensor]) -> list[np.ndarray]:
    """Per layer (H, S) tensors -> (H, S) float64 arrays rounded to 6 places (the JSON's values)."""
    return [np.round(r.numpy().astype(np.float64), 6) for r in rows]


@dataclass(eq=False)  # identity: it is kept in a WeakSet (StreamBudget)
class RequestState:
    """A generation's server-side state: the event loop it was submitted on, its output stage
    (text stream, events, finished answer) and what its client has not read yet. The engine-side
    request (`generation`) holds only what the engine needs; routes hold this."""

    generation: "Generation"
    loop: asyncio.AbstractEventLoop
    tokenizer: Tokenizer
    stop: list[str]
    text: TextStream[GeneratedToken] = field(init=False)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_scores: list[dict] | None = None  # OpenAI echo: each prompt token with its logprob
    seen: int = 0  # generated tokens processed (the EOS included), none after a stop string
    eos_token: ScoredToken | None = None  # a final EOS (no text, but scored: /v1 logprobs list it)
    closed: bool = False
    backlog_limit: int = 0  # estimated bytes of events a client may leave unread (0: no limit)
    held: Held = field(default_factory=Held)  # estimated bytes of the events queued and not yet taken
    overflowed: bool = False  # the client fell behind by more than backlog_limit: the generation ends
    budget: StreamBudget | None = None  # every stream's backlog together (StreamBudget.join)
    shed: bool = False  # ended by the budget: its unread events were dropped

    def __post_init__(self) -> None:
        self.text = TextStream(self.tokenizer, self.stop)
        # the generation does not point back here (the engine finds this state by number in its
        # front's table until the generation ends): once a route lets go of this state, it and its
        # unread events are freed at once, not at the next cycle collection

    @property
    def id(self) -> str:
        return self.generation.id

    @property
    def backlog(self) -> int:
        return self.held.bytes

    def cancel(self) -> None:
        """The client went away: stop the generation (a waiting one leaves the line now); once it
        has ended there is nothing to stop."""
        if not self.closed:
            self.generation.cancel()

    # --- consumer side -------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        """TokenEvents, then exactly one DoneEvent or ErrorEvent; raises
        GenerationCancelled instead when the generation was cancelled."""
        async for batch in self.event_batches():
            for event in batch:
                yield event
            del batch, event  # nothing held while the next batch is awaited (event_batches)

    async def event_batches(self) -> AsyncIterator[list[Event]]:
        """The same events in order, each time every one already waiting: a stream writer that
        falls behind the engine (many streams, a fast device) sends them in one write.

        A batch stays in the stream's count (and the budget's) until its writer asks for the next
        one or stops: a client that does not read holds it in a write that waits. Nothing of it
        stays referenced here meanwhile: a wait cancelled when the client leaves has this frame in
        its traceback, which anyio's task group keeps in a reference cycle until the cyclic GC runs."""
        sending = 0  # estimated bytes of the batch its writer holds
        try:
            while True:
                batch, sending = self._take_batch(await self.queue.get())
                if isinstance(batch[-1], GenerationCancelled):  # the events before it, then the exception
                    batch.pop()
                    if batch:
                        yield batch
                    del batch
                    raise GenerationCancelled("the generation was cancelled")
                ended = not isinstance(batch[-1], TokenEvent)
                yield batch
                del batch
                self._count(-sending)
                sending = 0
                if ended:
                    return
        finally:
            self._count(-sending)

    def _take_batch(self, item: tuple[Any, int]) -> tuple[list, int]:
        """The item's event and every one waiting after it (up to BATCH_BYTES), with their bytes."""
        size, batch = item[1], [self._take(item)]
        while isinstance(batch[-1], TokenEvent) and not self.queue.empty() and size < BATCH_BYTES:
            item = self.queue.get_nowait()
            size += item[1]
            batch.append(self._take(item))
        return batch, size

    def _take(self, item: tuple[Any, int]):
        """The queued item's event (a token's is built now); its bytes stay counted while it is sent."""
        event = item[0]
        return self._event(event) if isinstance(event, Released) else event

    def _put(self, event, size: int = EVENT_BYTES) -> None:
        """Queue an event (or a Released token, made into its event when taken)."""
        self.queue.put_nowait((event, size))
        self._count(size)
        if self.budget is not None and self.budget.over():
            self.budget.shed_largest()

    def _count(self, n: int) -> None:
        self.held.bytes += n
        if self.budget is not None:
            self.budget.add(n)

    def _drop_queued(self) -> None:
        """Forget every event not taken yet (nobody will read them): their memory comes back now."""
        while not self.queue.empty():
            self._count(-self.queue.get_nowait()[1])

    def shed_backlog(self, limit: int) -> None:
        """Called by the budget: drop this stream's unread events and end it with an error."""
        self.shed = True
        self._drop_queued()
        self.queue.put_nowait((ErrorEvent(
            message=f"the server holds more than {limit} bytes of stream events that clients have not read "
                    "(ATTNLENS_MAX_STREAM_BACKLOG_TOTAL_BYTES), and this stream held the most: it was ended",
            code="stream_backlog_exceeded"), 0))
        if not self.closed:
            self.generation.stop()

    # --- records -------------------------------------------------------------
    def handle(self, record: Record) -> None:
        if self.closed:
            return
        if isinstance(record, TokenRecord):
            self._token(record.token)
        elif isinstance(record, PromptRecord):
            self._prompt(record)
        else:
            self._finish(record)

    def _alternatives(self, ids: list[int], logprobs: list[float]) -> list[Alternative]:
        if not ids:
            return []
        tok = self.tokenizer
        return [Alternative(id=i, text=tok.display_text(i), logprob=lp) for i, lp in zip(ids, logprobs)]

    def _token(self, token: GeneratedToken) -> None:
        if self.text.stopped or self.overflowed or self.shed:
            return  # after a stop string (or an overflow): the core stops when told; these do not count
        self.seen += 1
        if token.id in self.tokenizer.eos_ids and not self.generation.params.ignore_eos:  # the end: no text, scored
            self.eos_token = ScoredToken(id=token.id, text=self.tokenizer.display_text(token.id),
                                               logprob=token.logprob,
                                               top_logprobs=self._alternatives(token.top_ids, token.top_logprobs))
            return
        for r in self.text.push(self.seen - 1, token.id, token):
            if self.shed:  # the budget ended this stream while it queued these
                return
            self._put(r, event_bytes(r.extra))
        if self.text.stopped:
            self.generation.stop()
        elif self.backlog_limit and self.backlog > self.backlog_limit:
            self.overflowed = True  # the client is not keeping up: end it, free its row
            self.generation.stop()

    def _event(self, r) -> TokenEvent:
        token: GeneratedToken = r.extra
        return TokenEvent(
            id=r.id, text=r.text, logprob=token.logprob,
            top_logprobs=self._alternatives(token.top_ids, token.top_logprobs), index=r.index, delta=r.delta,
            attention=attention_rows(token.attention) if token.attention is not None else None,
            cross_attention=attention_rows(token.cross_attention) if token.cross_attention is not None else None,
        )

    def _prompt(self, record: PromptRecord) -> None:
        tok, ids = self.tokenizer, self.generation.params.prompt_ids
        k = self.generation.params.prompt_logprobs or 0
        items = [{"id": ids[0], "text": tok.display_text(ids[0]), "logprob": None, "top_logprobs": None}]
        for i in range(1, len(ids)):
            top = None
            if k > 0:
                top = [vars(a) for a in self._alternatives(record.top_ids[i - 1], record.top_logprobs[i - 1])]
            items.append({"id": ids[i], "text": tok.display_text(ids[i]), "logprob": record.logprobs[i - 1],
                          "top_logprobs": top})
        self.prompt_scores = items

    def _finish(self, record: FinishRecord) -> None:
        self.closed = True
        if self.shed:  # its error is queued already
            return
        if record.reason == "cancelled":  # its client went away: nobody reads what is queued
            self._drop_queued()
            self._put(GenerationCancelled("the generation was cancelled"))
            return
        if record.reason == "error" or self.overflowed:
            if record.reason == "error":
                error = ErrorEvent(message=record.message, code=record.code or "generation_failed",
                                   retry_after=record.retry_after)
            else:
                error = ErrorEvent(message=f"the client left more than {self.backlog_limit} bytes of this stream "
                                            "unread (ATTNLENS_MAX_STREAM_BACKLOG_BYTES); the generation was ended",
                                    code="stream_backlog_exceeded")
            self._put(error)
            return
        reason = "stop" if self.text.stopped else record.reason
        if reason != "stop":
            for r in self.text.finish():
                self._put(r, event_bytes(r.extra))
        self._put(self._done(reason))

    def _done(self, reason: str) -> DoneEvent:
        g, tok = self.generation, self.tokenizer
        produced = self.seen if reason == "stop" else g.produced  # tokens after a stop string do not count
        now = g.t_end or time.perf_counter()
        t_start = g.t_start or now
        t_first = g.t_first or now
        return DoneEvent(
            id=g.id,
            finish_reason=reason,
            prompt_tokens=[(i, tok.display_text(i)) for i in g.params.prompt_ids],
            text=self.text.text,
            delta=self.text.unsent,
            completion_tokens=produced,
            timings=Timing(
                queue_ms=round((t_start - g.t_submit) * 1000, 3),
                prefill_ms=round((t_first - t_start) * 1000, 3),
                decode_ms=round((now - t_first) * 1000, 3),
                tokens_per_second=round(produced / max(now - t_start, 1e-9), 3),
                time_to_first_token_ms=round((t_first - g.t_submit) * 1000, 3),
            ),
        )

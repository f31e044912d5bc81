"""The output stage: typed records from the model thread -> the pydantic events clients get.

The engine core (model thread) only produces records: a generated token (ids, log-probs,
attention rows as tensors), a prompt's scores, the end of a generation. Everything else
happens here, on the event loop that submitted the generation: ids -> display text, stop
strings (TextStream), log-prob alternatives, attention rows -> rounded lists, and the
StreamToken / StreamDone / StreamError events that the routes send as they are.

When a stop string completes, the output stage asks the core to stop the generation; the
core retires it at its next step and sends the final record, so a client that sees `done`
also sees the generation's slot free again.

A token's event is built when its client takes it, not when its record arrives: until then
the queue holds the record's compact tensors (4 bytes a probability) rather than the event's
Python floats (about 32 each), and the allocator gets that memory back as one block. What a
stream's client leaves unread is bounded per stream (ATTNLENS_MAX_STREAM_BACKLOG_BYTES) and
for all streams together (stream_budget.py).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Union

import numpy as np
import torch

from attnlens.model.decoding import GeneratedToken

from ..schemas import (Alternative, GeneratedTokenOut, StreamDone, StreamError, StreamToken, Timings, TokenText,
                       Usage)
from .stream_budget import Held, StreamBudget
from .textstream import Released, TextStream

if TYPE_CHECKING:
    from .core import Generation


# Estimated memory of an event held for a stream's client, as Python objects: a token event,
# and each attention probability in it (a float in a list). Bounded per stream by
# ATTNLENS_MAX_STREAM_BACKLOG_BYTES.
EVENT_BYTES = 512
FLOAT_BYTES = 32
BATCH_BYTES = 1_000_000  # at most this much (estimated) is built into events for one write


class GenerationCancelled(Exception):
    """The generation was cancelled (its client went away) before it finished."""


# --- records: what the model thread hands over ------------------------------------
@dataclass
class TokenRecord:
    generation: "Generation"
    token: GeneratedToken  # id, logprob, top alternatives, attention rows (tensors)


@dataclass
class PromptRecord:
    """log p(prompt token i | tokens < i) for i >= 1, with the top-k alternatives of each."""

    generation: "Generation"
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class FinishRecord:
    generation: "Generation"
    reason: str  # "length" | "eos" | "stop" | "cancelled" | "error"
    message: str = ""  # for "error"
    code: str | None = None  # for "error": machine-readable, e.g. engine_restarting
    retry_after: int | None = None  # for "error": seconds after which a retry may work


Record = Union[TokenRecord, PromptRecord, FinishRecord]
Event = Union[StreamToken, StreamDone, StreamError]


def dispatch(records: list[Record]) -> None:
    """Deliver one step's records, in order (runs on the generations' event loop)."""
    for record in records:
        record.generation.output.handle(record)


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """From any thread: run fn(*args) on `loop`, unless the loop is closed (nobody listens)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed
        pass


def hand_over(records: list[Record]) -> None:
    """From any thread: hand records to the output stage, one call per event loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Record]] = {}
    for r in records:
        by_loop.setdefault(r.generation.loop, []).append(r)
    for loop, rs in by_loop.items():
        call_soon(loop, dispatch, rs)


def event_bytes(token: GeneratedToken) -> int:
    """Estimated memory of a token's event: its attention rows dominate when it has them."""
    if token.attention is None and token.cross_attention is None:
        return EVENT_BYTES
    floats = sum(a.numel() for a in token.attention or ()) + sum(c.numel() for c in token.cross_attention or ())
    return EVENT_BYTES + FLOAT_BYTES * floats


def attention_lists(rows: list[torch.Tensor]) -> list[list[list[float]]]:
    """Per layer (H, S) tensors -> [layer][head][position] floats rounded to 6 places."""
    return [np.round(r.numpy().astype(np.float64), 6).tolist() for r in rows]


@dataclass(eq=False)  # identity: it is kept in a WeakSet (StreamBudget)
class GenerationOutput:
    """One generation's output stage: its text stream, its events, its finished answer."""

    generation: "Generation"
    tokenizer: Any
    stop: list[str]
    text: TextStream = field(init=False)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_scores: list[dict] | None = None  # OpenAI echo: each prompt token with its logprob
    seen: int = 0  # generated tokens processed (the EOS included), none after a stop string
    eos_token: GeneratedTokenOut | None = None  # a final EOS (no text, but scored: /v1 logprobs list it)
    closed: bool = False
    backlog_limit: int = 0  # estimated bytes of events a client may leave unread (0: no limit)
    held: Held = field(default_factory=Held)  # estimated bytes of the events queued and not yet taken
    overflowed: bool = False  # the client fell behind by more than backlog_limit: the generation ends
    budget: StreamBudget | None = None  # every stream's backlog together (StreamBudget.join)
    shed: bool = False  # ended by the budget: its unread events were dropped

    def __post_init__(self) -> None:
        self.text = TextStream(self.tokenizer, self.stop)
        # no reference cycle with its generation: once a route lets go of the generation, this
        # output (and its unread events) is freed at once, not at the next cycle collection; it
        # only reaches the generation while the engine holds that
        self.generation = weakref.proxy(self.generation)

    @property
    def backlog(self) -> int:
        return self.held.bytes

    # --- consumer side -------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        """StreamToken events, then exactly one StreamDone or StreamError; raises
        GenerationCancelled instead when the generation was cancelled."""
        async for batch in self.event_batches():
            for event in batch:
                yield event

    async def event_batches(self) -> AsyncIterator[list[Event]]:
        """The same events in order, each time every one already waiting: a stream writer that
        falls behind the engine (many streams, a fast device) sends them in one write."""
        while True:
            item = await self.queue.get()
            size = item[1]
            batch = [self._take(item)]
            while isinstance(batch[-1], StreamToken) and not self.queue.empty() and size < BATCH_BYTES:
                item = self.queue.get_nowait()
                size += item[1]
                batch.append(self._take(item))
            last = batch[-1]
            if isinstance(last, GenerationCancelled):
                if len(batch) > 1:
                    yield batch[:-1]
                raise last
            yield batch
            if not isinstance(last, StreamToken):
                return

    def _take(self, item: tuple[Any, int]):
        event, size = item
        self._count(-size)
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
        self.queue.put_nowait((StreamError(
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
        if token.id in self.tokenizer.eos_ids:  # the end: no text, but its score is kept
            self.eos_token = GeneratedTokenOut(id=token.id, text=self.tokenizer.display_text(token.id),
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

    def _event(self, r) -> StreamToken:
        token: GeneratedToken = r.extra
        fields = dict(index=r.index, id=r.id, text=r.text, delta=r.delta, logprob=token.logprob,
                      top_logprobs=self._alternatives(token.top_ids, token.top_logprobs))
        if token.attention is None and token.cross_attention is None:
            # validated in pydantic's core: for these few fields faster than model_construct's Python
            return StreamToken(**fields)
        return StreamToken.model_construct(  # thousands of attention floats: not validated one by one
            **fields,
            attention=attention_lists(token.attention) if token.attention is not None else None,
            cross_attention=attention_lists(token.cross_attention) if token.cross_attention is not None else None,
        )

    def _prompt(self, record: PromptRecord) -> None:
        tok, ids = self.tokenizer, self.generation.params.prompt_ids
        k = self.generation.params.prompt_logprobs or 0
        items = [{"id": ids[0], "text": tok.display_text(ids[0]), "logprob": None, "top_logprobs": None}]
        for i in range(1, len(ids)):
            top = None
            if k > 0:
                top = [a.model_dump() for a in self._alternatives(record.top_ids[i - 1], record.top_logprobs[i - 1])]
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
                error = StreamError(message=record.message, code=record.code or "generation_failed",
                                    retry_after=record.retry_after)
            else:
                error = StreamError(message=f"the client left more than {self.backlog_limit} bytes of this stream "
                                            "unread (ATTNLENS_MAX_STREAM_BACKLOG_BYTES); the generation was ended",
                                    code="stream_backlog_exceeded")
            self._put(error)
            return
        reason = "stop" if self.text.stopped else record.reason
        if reason != "stop":
            for r in self.text.finish():
                self._put(r, event_bytes(r.extra))
        self._put(self._done(reason))

    def _done(self, reason: str) -> StreamDone:
        g, tok = self.generation, self.tokenizer
        produced = self.seen if reason == "stop" else g.produced  # tokens after a stop string do not count
        now = g.t_end or time.perf_counter()
        t_start = g.t_start or now
        t_first = g.t_first or now
        n_prompt = len(g.params.prompt_ids)
        return StreamDone(
            id=g.id,
            finish_reason=reason,
            prompt_tokens=[TokenText(id=i, text=tok.display_text(i)) for i in g.params.prompt_ids],
            text=self.text.text,
            delta=self.text.unsent,
            usage=Usage(prompt_tokens=n_prompt, completion_tokens=produced, total_tokens=n_prompt + produced),
            timings=Timings(
                queue_ms=round((t_start - g.t_submit) * 1000, 3),
                prefill_ms=round((t_first - t_start) * 1000, 3),
                decode_ms=round((now - t_first) * 1000, 3),
                tokens_per_second=round(produced / max(now - t_start, 1e-9), 3),
                time_to_first_token_ms=round((t_first - g.t_submit) * 1000, 3),
            ),
        )

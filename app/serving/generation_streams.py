"""Running generations for a route: a generation's events as the API sends them, watching the
client, gathering an answer, SSE framing.

The engine's output stage (app/engine/outputs.py) yields TokenEvent, DoneEvent and ErrorEvent,
which know nothing of the API. Routes read a request's events through `events` and
`event_batches` here and get StreamToken, StreamDone and StreamError, which they send as they are.
A StreamToken's attention rows stay the output stage's arrays (per layer (heads, keys), rounded):
`token_json` writes them with orjson, the same text pydantic writes for their floats, and
`attention_lists` makes them lists for a whole answer's schema.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np
import orjson
from fastapi import Request
from pydantic import BaseModel

from attnlens.app.api.generate_schemas import (
    Alternative,
    GeneratedTokenOut,
    StreamDone,
    StreamError,
    StreamToken,
    Timings,
    TokenText,
    Usage,
)
from attnlens.app.engine import GenerationCancelled
from attnlens.app.engine.outputs import DoneEvent, ErrorEvent, RequestState, ScoredToken, TokenEvent
from attnlens.app.server.api_errors import ApiError
from attnlens.app.server.middleware import Metrics
from attnlens.app.serving.answer_budget import CLIENT_CLOSED_REQUEST, disconnected

ApiEvent = StreamToken | StreamDone | StreamError


def _alternatives(token: ScoredToken) -> list[Alternative]:
    return [Alternative(id=a.id, text=a.text, logprob=a.logprob) for a in token.top_logprobs]


def scored_token(token: ScoredToken | None) -> GeneratedTokenOut | None:
    """A token with its log-probability and alternatives (e.g. a generation's final EOS)."""
    if token is None:
        return None
    return GeneratedTokenOut(id=token.id, text=token.text, logprob=token.logprob, top_logprobs=_alternatives(token))


def token_event(e: TokenEvent) -> StreamToken:
    fields: dict[str, Any] = dict(index=e.index, id=e.id, text=e.text, delta=e.delta, logprob=e.logprob,
                  top_logprobs=_alternatives(e))
    if e.attention is None and e.cross_attention is None:
        # validated in pydantic's core: for these few fields faster than model_construct's Python
        return StreamToken(**fields)
    # thousands of attention probabilities, arrays from the output stage: not validated one by one
    # (written by token_json; the schema's lists are what the client gets)
    return StreamToken.model_construct(**fields, attention=e.attention,  # type: ignore[arg-type]
                                       cross_attention=e.cross_attention)  # type: ignore[arg-type]


ROWS_FIELDS = ("attention", "cross_attention")  # StreamToken's last fields, in this order


def token_json(token: StreamToken) -> str:
    """A token event's JSON (None fields left out), as pydantic writes it: its attention arrays are
    written by orjson straight from them (no Python float each) after the other fields."""
    text = token.model_dump_json(exclude_none=True, exclude=set(ROWS_FIELDS))
    rows = "".join(f',"{name}":{rows_json(getattr(token, name))}' for name in ROWS_FIELDS
                   if getattr(token, name) is not None)
    return text[:-1] + rows + "}" if rows else text


def rows_json(rows: list[np.ndarray]) -> str:
    """[layer][head][key] JSON of per-layer (heads, keys) arrays."""
    return "[" + ",".join(orjson.dumps(r, option=orjson.OPT_SERIALIZE_NUMPY).decode() for r in rows) + "]"


def attention_lists(rows: list[Any] | None) -> list[list[list[float]]] | None:
    """A StreamToken's attention arrays (token_event) as nested lists, for a whole answer's schema."""
    return None if rows is None else [r.tolist() for r in rows]


def done_event(e: DoneEvent) -> StreamDone:
    n_prompt = len(e.prompt_tokens)
    return StreamDone(
        id=e.id, finish_reason=e.finish_reason,
        prompt_tokens=[TokenText(id=i, text=text) for i, text in e.prompt_tokens],
        text=e.text, delta=e.delta,
        usage=Usage(prompt_tokens=n_prompt, completion_tokens=e.completion_tokens,
                    total_tokens=n_prompt + e.completion_tokens),
        timings=Timings(**vars(e.timings)),
    )


def api_event(event: TokenEvent | DoneEvent | ErrorEvent) -> ApiEvent:
    if isinstance(event, TokenEvent):
        return token_event(event)
    if isinstance(event, DoneEvent):
        return done_event(event)
    return StreamError(message=event.message, code=event.code, retry_after=event.retry_after)


async def events(state: RequestState) -> AsyncIterator[ApiEvent]:
    """StreamToken events, then exactly one StreamDone or StreamError (GenerationCancelled is raised
    instead when the generation was cancelled)."""
    async for event in state.events():
        yield api_event(event)


async def event_batches(state: RequestState) -> AsyncIterator[list[ApiEvent]]:
    """The same events, every one already waiting at once (one write for a stream that fell behind)."""
    async for batch in state.event_batches():
        events = [api_event(event) for event in batch]
        del batch  # nothing held while the next batch is awaited (RequestState.event_batches)
        yield events
        del events


# --- watching the client, gathering an answer, SSE framing ---------------------

@dataclass
class Outcome:
    """A finished generation, gathered from its events."""

    tokens: list[StreamToken]
    done: StreamDone


async def _cancel_on_disconnect(request: Request, generations: list[RequestState]) -> None:
    await disconnected(request)
    for g in generations:
        g.cancel()


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request, generations: list[RequestState]):
    """While the block runs, a client that goes away cancels these generations (for
    non-streamed answers; a cancelled stream cancels its own generation). Each cancelled
    generation then ends, so the handler ends too (collect raises a 499 ApiError)."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, generations))
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
        for g in generations:
            g.cancel()  # a no-op once finished; stops the work if we were interrupted


# errors of the engine rather than of the request: a 503 (with Retry-After when known), not a 500
UNAVAILABLE_CODES = ("engine_restarting", "engine_failed", "shutting_down")


def error_status(error: StreamError) -> ApiError:
    """The HTTP error for a generation that ended with `error` (a plain answer's status)."""
    if error.code in UNAVAILABLE_CODES:
        headers = {"Retry-After": str(error.retry_after)} if error.retry_after else None
        return ApiError(503, error.message, code=error.code, headers=headers)
    return ApiError(500, error.message, code=error.code or "generation_failed")


def note_unfinished(metrics: Metrics, reason: str, n: int = 1) -> None:
    """Count generations that ended without a `done` (reason "cancelled" or "error") in
    attnlens_generations_total, beside the finish reasons of those that did."""
    if n:
        metrics.generations.labels(metrics.request_model(), reason).inc(n)


async def collect(generation: RequestState, metrics: Metrics) -> Outcome:
    """Run a generation to its end; an engine error becomes a 500 (a 503 when the engine is
    restarting or gone), a cancellation a 499."""
    tokens: list[StreamToken] = []
    done: StreamDone | None = None
    try:
        async for event in events(generation):
            if isinstance(event, StreamToken):
                tokens.append(event)
            elif isinstance(event, StreamDone):
                done = event
                metrics.observe_generation(event)
            else:
                note_unfinished(metrics, "error")
                raise error_status(event)
    except GenerationCancelled:
        note_unfinished(metrics, "cancelled")
        raise ApiError(CLIENT_CLOSED_REQUEST, "the client closed the request", code="client_closed") from None
    assert done is not None, "events() ends with one done or error event"
    return Outcome(tokens, done)


def sse(event: str | None, data: BaseModel | dict | str) -> str:
    """One server-sent event; `data` is a schema object, a dict (JSON-encoded) or a ready string."""
    if isinstance(data, StreamToken):
        payload = token_json(data)  # its attention rows are arrays
    elif isinstance(data, BaseModel):
        # `ablate` is echoed only by a request that ablates: an answer without it is as it always was
        absent = {"ablate"} if getattr(data, "ablate", True) is None else None
        payload = data.model_dump_json(exclude=absent)
    elif isinstance(data, str):
        payload = data
    else:
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

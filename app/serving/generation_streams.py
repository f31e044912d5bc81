"""Running generations for a route: watching the client, gathering an answer, SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Awaitable, TypeVar

from fastapi import Request
from pydantic import BaseModel

from attnlens.app.api.generate_schemas import StreamDone, StreamError, StreamToken
from attnlens.app.engine import GenerationCancelled, RequestState
from attnlens.app.server.api_errors import ApiError
from attnlens.app.server.metrics import Metrics
from attnlens.app.serving.stream_events import events, token_json

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first": logged and counted, never sent


@dataclass
class Outcome:
    """A finished generation, gathered from its events."""

    tokens: list[StreamToken]
    done: StreamDone


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the request's body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel_on_disconnect(request: Request, generations: list[RequestState]) -> None:
    await _disconnected(request)
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


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` (a model call); a client that goes away first cancels it (the call stops at its
    next report point, app/engine/progress.py) and the handler ends with a 499 that is never sent."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():  # the client went first
        raise ApiError(CLIENT_CLOSED_REQUEST, "the client closed the request", code="client_closed")
    return task.result()


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

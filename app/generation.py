"""What the native and OpenAI routes share: length checks, running a job, SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from .engine import Engine, GenerationRequest
from .errors import ApiError, field_error
from .metrics import Metrics
from .settings import Settings


def check_new_token_limit(settings: Settings, value: int, field: str) -> None:
    """A 422 on `field` when more new tokens are asked for than ATTNLENS_MAX_NEW_TOKENS allows."""
    if value > settings.max_new_tokens:
        raise field_error(field, f"Input should be less than or equal to {settings.max_new_tokens}",
                          "less_than_equal")


def check_lengths(engine: Engine, settings: Settings, prompt_ids: list[int], max_new_tokens: int, *,
                  prompt_field: str = "prompt", max_field: str = "max_new_tokens") -> None:
    """A clear 400 naming the numbers when a prompt cannot be served."""
    n = len(prompt_ids)
    ctx = engine.config.context_length
    if n == 0:
        raise ApiError(400, f"{prompt_field} encodes to no tokens", param=prompt_field, code="empty_prompt")
    if n > settings.max_prompt_tokens:
        raise ApiError(400, f"{prompt_field} has {n} tokens, more than the limit of "
                            f"{settings.max_prompt_tokens} (ATTNLENS_MAX_PROMPT_TOKENS)",
                       param=prompt_field, code="prompt_too_long")
    if n + max_new_tokens > ctx:
        raise ApiError(400, f"{prompt_field} ({n} tokens) + {max_field} ({max_new_tokens}) = "
                            f"{n + max_new_tokens} tokens exceeds the model's context length of {ctx}",
                       param=max_field, code="context_length_exceeded")


@dataclass
class Outcome:
    """A finished generation, gathered from its events."""

    tokens: list[dict] = field(default_factory=list)
    done: dict[str, Any] = field(default_factory=dict)


async def _cancel_on_disconnect(request: Request, handles: list[GenerationRequest]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for handle in handles:
                handle.cancel()
            return


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request, handles: list[GenerationRequest]):
    """While the block runs, a client that goes away cancels these generations (for
    non-streaming answers; a cancelled stream cancels its own generation)."""
    watcher = asyncio.create_task(_cancel_on_disconnect(request, handles))
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
        for handle in handles:
            handle.cancel()  # a no-op once finished; stops the work if we were interrupted


async def collect(handle: GenerationRequest, metrics: Metrics) -> Outcome:
    """Run a generation to its end; an engine error becomes a 500."""
    out = Outcome()
    async for event in handle.events():
        if event.kind == "token":
            out.tokens.append(event.data)
        elif event.kind == "done":
            out.done = event.data
            metrics.observe_generation(event.data)
        else:
            raise ApiError(500, event.data["message"], code="generation_failed")
    return out


def sse(event: str | None, data: Any) -> str:
    """One server-sent event; `data` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

"""What the OpenAI-compatible routes share (/v1/completions, /v1/chat/completions): the 404 for a
model /v1 does not list, what a request's choices would claim, each choice's sampling, and running
the choices' generations, as one answer or as one stream of `data:` chunks ending `[DONE]`.

A route says only how its chunks and choices look: `stream_choices` takes a `ChunkWriter`
(the first chunks, one per token, one per end, the usage chunk) and runs the rest: the
generations' events merged as they come (every event already waiting goes out in one write),
an engine error as OpenAI's error object, a client that goes away cancelling every choice.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from attnlens.app.api.generate_schemas import StreamDone, StreamToken
from attnlens.app.api.openai_schemas import OPENAI_SAMPLING, OpenAIErrorResponse, SamplingRequest
from attnlens.app.engine import EngineFront, RequestState, RequestTooLarge
from attnlens.app.registry.model_registry import COMPLETIONS, ModelRegistry, ServedModel
from attnlens.app.server.api_errors import ApiError, public_message
from attnlens.app.server.metrics import Metrics
from attnlens.app.serving.generation_streams import (
    SSE_HEADERS,
    Outcome,
    cancel_on_disconnect,
    collect,
    note_unfinished,
    sse,
)
from attnlens.app.serving.stream_events import events as request_events
from attnlens.model import SamplingParams

log = logging.getLogger("attnlens.routers")

ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": OpenAIErrorResponse} for code in (400, 401, 404, 408, 413, 422, 429, 503)}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def not_found(registry: ModelRegistry, name: str) -> ApiError:
    """OpenAI's 404 for a model: it names only the models GET /v1/models lists."""
    listed = [m.name for m in registry.models.values() if COMPLETIONS in m.tasks]
    return ApiError(404, f"the model {name!r} does not exist; the models here are: {', '.join(listed)} "
                         f"(GET /v1/models)", param="model", code="model_not_found")


def check_logit_bias(body: SamplingRequest, tok) -> None:
    for key in body.logit_bias or {}:
        if int(key) >= tok.vocab_size:
            raise ApiError(400, f"logit_bias names token {key}, which is not in the vocabulary: ids run "
                                f"0..{tok.vocab_size - 1}", param="logit_bias", code="invalid_value")


def check_capacity(engine: EngineFront, prompts: int, choices: int, param: str) -> None:
    """Prompts x choices the server can never hold at once: a 400 before anything is tokenised."""
    needed = prompts * choices
    capacity = engine.max_concurrent + engine.max_queue
    if needed > capacity:
        raise RequestTooLarge(
            f"this request needs {needed} generations at once ({prompts} prompt(s) x {choices} choices), more "
            f"than the server can ever hold: {engine.max_concurrent} running + {engine.max_queue} waiting "
            "(ATTNLENS_MAX_CONCURRENT + ATTNLENS_MAX_QUEUE); send fewer prompts or fewer choices per request",
            param=param)


def sampling(body: SamplingRequest, k: int, served: ServedModel) -> SamplingParams:
    """Choice k's sampling: the fields the request leaves unset are the model's recommended ones, else
    OpenAI's defaults; with a seed, choice k uses seed + k (the choices differ, yet repeat)."""
    bias = {int(key): v for key, v in body.logit_bias.items()} if body.logit_bias else None
    seed = None if body.seed is None else (body.seed + k) % 2**63
    return SamplingParams(**served.sampling_for(body.sampling, OPENAI_SAMPLING), seed=seed, logit_bias=bias,
                          presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def collect_choices(request: Request, generations: list[RequestState], metrics: Metrics) -> list[Outcome]:
    """Every choice run to its end (a client that goes away cancels them all)."""
    async with cancel_on_disconnect(request, generations):
        return list(await asyncio.gather(*(collect(g, metrics) for g in generations)))


class ChunkWriter(Protocol):
    """How one route's stream looks: each method returns the SSE text to send (sse(None, chunk))."""

    def first(self) -> str: ...  # before any token ("" for none)

    def token(self, index: int, event: StreamToken) -> str: ...

    def done(self, index: int, event: StreamDone) -> str: ...

    def usage(self, completion_tokens: int) -> str: ...  # after every choice ended (include_usage)


def _error_chunk(message: str, code: str) -> str:
    return sse(None, {"error": {"message": message, "type": "server_error", "param": None, "code": code}})


async def _stream(generations: list[RequestState], metrics: Metrics, writer: ChunkWriter,
                  include_usage: bool) -> AsyncIterator[str]:
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(i: int, g: RequestState):
        async for ev in request_events(g):
            await merged.put((i, ev))

    tasks = [asyncio.create_task(forward(i, g)) for i, g in enumerate(generations)]
    completion_tokens, ended = 0, 0
    try:
        if first := writer.first():
            yield first
        remaining = len(generations)
        while remaining:
            waiting = [await merged.get()]  # and every event already waiting: one write
            while not merged.empty():
                waiting.append(merged.get_nowait())
            out = []
            for i, ev in waiting:
                if isinstance(ev, StreamToken):
                    out.append(writer.token(i, ev))
                elif isinstance(ev, StreamDone):
                    remaining -= 1
                    ended += 1
                    completion_tokens += ev.usage.completion_tokens
                    metrics.observe_generation(ev)
                    out.append(writer.done(i, ev))
                else:
                    ended += 1
                    note_unfinished(metrics, "error")
                    out.append(_error_chunk(public_message(ev.message), ev.code or "generation_failed"))
                    yield "".join(out)
                    return
            yield "".join(out)
        if include_usage:
            yield writer.usage(completion_tokens)
        yield "data: [DONE]\n\n"
    except Exception:
        log.exception("stream failed")
        yield _error_chunk("internal error (see the server log)", "internal_error")
    finally:
        note_unfinished(metrics, "cancelled", len(generations) - ended)  # their client went away
        for t in tasks:
            t.cancel()
        for g in generations:
            g.cancel()


def stream_choices(generations: list[RequestState], metrics: Metrics, writer: ChunkWriter, *,
                   include_usage: bool) -> StreamingResponse:
    """OpenAI's stream of the choices' chunks, as `writer` writes them, then `data: [DONE]`."""
    return StreamingResponse(_stream(generations, metrics, writer, include_usage), media_type="text/event-stream",
                             headers=SSE_HEADERS)


def stream_description(what: str, chunk: str) -> dict:
    """The OpenAPI description of a 200 that is JSON, or with stream=true OpenAI's SSE chunks."""
    return {"description": f"a {what}, or with stream=true OpenAI's stream: `data:` events each holding a JSON "
                           f"chunk ({chunk}), or an `error` object, then `data: [DONE]`",
            "content": {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
                "data": {"type": "string", "description": f"a JSON chunk ({chunk}), an error object, or [DONE]"}}}}}}

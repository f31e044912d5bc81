"""POST /generate: continue a prompt (text, or token `ids` as they are; or a chat model's
conversation, `messages`), as one JSON answer or as server-sent events."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from attnlens.app.api.common_schemas import stop_list
from attnlens.app.api.deps import GeneratingModel, StateDep
from attnlens.app.api.generate_schemas import GenerateResponse, StreamDone, StreamError, StreamToken
from attnlens.app.engine import EngineFront, GenerationParams
from attnlens.app.server.api_errors import field_error, public_message
from attnlens.app.serving.ablation_edits import resolve_ablate
from attnlens.app.serving.answer_budget import off_loop
from attnlens.app.serving.chat_serving import conversation_ids
from attnlens.app.serving.generation_streams import SSE_HEADERS, cancel_on_disconnect, collect, note_unfinished, sse
from attnlens.app.serving.prompts import check_token_ids, tokenize_text
from attnlens.app.serving.request_limits import check_lengths, check_new_token_limit
from attnlens.app.serving.stream_events import event_batches
from attnlens.model import SamplingParams

log = logging.getLogger("attnlens.routers")

router = APIRouter(tags=["generate"])

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "prompt too long for the limit or the context (the message gives the numbers), "
                         "or a model that does not generate"},
    404: {"description": "unknown model (the message lists the loaded ones)"},
    413: {"description": "request body over the size limit"},
    429: {"description": "queue full; see Retry-After"},
    503: {"description": "model not loaded yet"},
}


@router.post(
    "/generate",
    response_model=GenerateResponse,
    responses={**ERRORS, 200: {"content": {"text/event-stream": {"schema": {
                                   # each event, as OpenAPI before 3.2 describes a stream's events
                                   "description": "each `event: token` carries a StreamToken, the last "
                                                  "`event: done` a StreamDone (or `event: error` a "
                                                  "StreamError)",
                                   "type": "object", "required": ["event", "data"],
                                   "oneOf": [{"properties": {"event": {"const": name}, "data": {
                                       "contentMediaType": "application/json",
                                       "contentSchema": {"$ref": f"#/components/schemas/{model}"}}}}
                                       for name, model in (("token", "StreamToken"), ("done", "StreamDone"),
                                                           ("error", "StreamError"))]}}},
                               "description": "JSON, or with stream=true a stream of `token` events, "
                                              "then one `done` (or `error`) event"}},
)
async def generate(asked: GeneratingModel, request: Request, state: StateDep):
    body, served = asked.body, asked.served
    engine: EngineFront = served.runner
    settings = state.settings
    check_new_token_limit(settings, body.max_new_tokens, "max_new_tokens")
    edits, echo = resolve_ablate(served, body.ablate, settings)
    tok = engine.tokenizer
    given = [name for name in ("prompt", "ids", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise field_error(given[1] if given else "prompt",
                          f"give one of prompt (text), ids (token ids) or messages (a conversation), not both "
                          f"{given[0]} and {given[1]}" if given else
                          "give prompt (text), ids (token ids) or messages (a conversation)",
                          "exclusive" if given else "missing")
    if body.messages is not None:
        prompt_field = "messages"
        prompt_ids = await conversation_ids(state, served, body.messages, settings.prompt_limit,
                                            limit_name="ATTNLENS_MAX_PROMPT_TOKENS")
    elif body.ids is not None:
        prompt_field = "ids"
        prompt_ids = check_token_ids(tok, body.ids, field="ids", limit=settings.max_prompt_tokens)
    else:
        prompt_field = "prompt"
        assert body.prompt is not None  # exactly one of prompt, ids, messages (checked above)
        prompt_ids = await tokenize_text(tok, body.prompt, settings.prompt_limit, field="prompt",
                                         limit_name="ATTNLENS_MAX_PROMPT_TOKENS", prompt=True)
    check_lengths(engine.config.context_length, settings, prompt_ids, body.max_new_tokens,
                  served.generation, prompt_field=prompt_field)
    params = GenerationParams(
        prompt_ids=prompt_ids,
        max_new_tokens=body.max_new_tokens,
        sampling=SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed),
        stop=stop_list(body.stop),  # already a list (GenerateRequest._stops)
        n_logprobs=body.logprobs,
        return_attention=body.return_attention,
        ablate=edits,
    )
    generation = engine.submit(params)
    metrics = state.metrics

    if body.stream:
        ended = []  # the done or error event, once sent

        def encode(event) -> str:
            if isinstance(event, StreamToken):
                return sse("token", event)
            ended.append(event)
            if isinstance(event, StreamDone):
                metrics.observe_generation(event)
                return sse("done", event if echo is None else event.model_copy(update={"ablate": echo}))
            note_unfinished(metrics, "error")
            return sse("error", event.model_copy(update={"message": public_message(event.message)}))

        async def events():
            try:
                async for batch in event_batches(generation):  # the events waiting go out in one write
                    yield "".join(encode(event) for event in batch)
            except Exception:  # anything on our side mid-stream: log it, tell the client
                log.exception("stream failed")
                ended.append(None)
                note_unfinished(metrics, "error")
                yield sse("error", StreamError(message="internal error (see the server log)", code="internal_error"))
            finally:
                if not ended:
                    note_unfinished(metrics, "cancelled")  # its client went away before the end
                generation.cancel()  # client gone (the stream was cancelled) or finished: free the slot

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async with cancel_on_disconnect(request, [generation]):
        out = await collect(generation, metrics)
    done = out.done
    streams_cross = any(served.family.group(g).is_cross for g in served.generation.step_groups)

    def answer() -> bytes:  # on a worker thread: with attention it can be megabytes of floats
        return GenerateResponse(
            id=done.id,
            model=served.name,
            text=done.text,
            prompt_tokens=done.prompt_tokens,
            tokens=out.tokens,
            finish_reason=done.finish_reason,
            usage=done.usage,
            timings=done.timings,
            attention=[t.attention for t in out.tokens] if body.return_attention else None,
            cross_attention=([t.cross_attention for t in out.tokens]
                             if body.return_attention and streams_cross else None),
            ablate=echo,
        ).model_dump_json(exclude={"ablate"} if echo is None else None).encode()

    return Response(await off_loop(answer), media_type="application/json")

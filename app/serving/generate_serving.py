"""POST /generate's serving side (app/api/generate_routes.py is the thin router): the prompt read
(text, token `ids` as they are, or a chat model's `messages`) and checked against the limits and
the model's context, its ablations resolved, one generation submitted to the model's engine, and
its events sent as one JSON answer (built on a worker thread: with attention it can be megabytes
of floats) or as server-sent events (`token`, then `done` or `error`)."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from attnlens.app.api.common_schemas import stop_list
from attnlens.app.api.generate_schemas import (
    GENERATE_SAMPLING,
    GenerateRequest,
    GenerateResponse,
    StreamDone,
    StreamError,
    StreamToken,
)
from attnlens.app.engine import EngineFront, GenerationParams, RequestState
from attnlens.app.registry.model_registry import ServedModel
from attnlens.app.server.api_errors import field_error, public_message
from attnlens.app.server.middleware import Metrics
from attnlens.app.server.state import AppState
from attnlens.app.serving.ablation_edits import resolve_ablate
from attnlens.app.serving.answer_budget import off_loop
from attnlens.app.serving.generation_streams import (
    SSE_HEADERS,
    attention_lists,
    cancel_on_disconnect,
    collect,
    event_batches,
    note_unfinished,
    sse,
)
from attnlens.app.serving.prompts import (
    check_lengths,
    check_new_token_limit,
    check_token_ids,
    conversation_ids,
    tokenize_text,
)
from attnlens.model import SamplingParams

log = logging.getLogger("attnlens.routers")


def _one_prompt(body: GenerateRequest) -> str:
    """The field that holds the prompt: exactly one of prompt, ids and messages (else a 422)."""
    given = [name for name in ("prompt", "ids", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise field_error(given[1] if given else "prompt",
                          f"give one of prompt (text), ids (token ids) or messages (a conversation), not both "
                          f"{given[0]} and {given[1]}" if given else
                          "give prompt (text), ids (token ids) or messages (a conversation)",
                          "exclusive" if given else "missing")
    return given[0]


def _stream(generation: RequestState, metrics: Metrics, echo) -> StreamingResponse:
    """The generation's events as SSE: each `token`, then one `done` (with the ablations' echo) or
    `error`; a client that goes away cancels the generation."""
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
                text = "".join(encode(event) for event in batch)
                del batch  # nothing held while the next batch is awaited (RequestState.event_batches)
                yield text
                del text
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


class GenerateServing:
    """Answers POST /generate for the models in `state`."""

    def __init__(self, state: AppState):
        self.state = state

    async def generate(self, body: GenerateRequest, served: ServedModel, request: Request):
        """`served` (a model that generates, found by the route's dependency) continues the prompt."""
        state = self.state
        engine: EngineFront = served.runner
        settings = state.settings
        check_new_token_limit(settings, body.max_new_tokens, "max_new_tokens")
        edits, echo = resolve_ablate(served, body.ablate, settings)
        prompt_field = _one_prompt(body)
        prompt_ids = await self._prompt_ids(body, served, prompt_field)
        check_lengths(engine.config.context_length, settings, prompt_ids, body.max_new_tokens,
                      served.generation, prompt_field=prompt_field)
        params = GenerationParams(
            prompt_ids=prompt_ids,
            max_new_tokens=body.max_new_tokens,
            sampling=SamplingParams(**served.sampling_for(body.sampling, GENERATE_SAMPLING), seed=body.seed),
            stop=stop_list(body.stop),  # already a list (GenerateRequest._stops)
            n_logprobs=body.logprobs,
            return_attention=body.return_attention,
            ablate=edits,
        )
        generation = engine.submit(params)
        if body.stream:
            return _stream(generation, state.metrics, echo)
        return await self._answer(body, served, generation, echo, request)

    async def _prompt_ids(self, body: GenerateRequest, served: ServedModel, field: str) -> list[int]:
        """The prompt's token ids: the conversation rendered by the model's template, the ids
        checked against the vocabulary, or the text tokenised off the event loop."""
        settings, tok = self.state.settings, served.runner.tokenizer
        if field == "messages":
            assert body.messages is not None
            return await conversation_ids(self.state, served, body.messages, settings.prompt_limit,
                                          limit_name="ATTNLENS_MAX_PROMPT_TOKENS")
        if field == "ids":
            assert body.ids is not None
            return check_token_ids(tok, body.ids, field="ids", limit=settings.max_prompt_tokens)
        assert body.prompt is not None
        return await tokenize_text(tok, body.prompt, settings.prompt_limit, field="prompt",
                                   limit_name="ATTNLENS_MAX_PROMPT_TOKENS", prompt=True)

    async def _answer(self, body: GenerateRequest, served: ServedModel, generation: RequestState, echo,
                      request: Request) -> Response:
        """The generation run to its end (a client that goes away cancels it), as one JSON answer."""
        async with cancel_on_disconnect(request, [generation]):
            out = await collect(generation, self.state.metrics)
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
                attention=[attention_lists(t.attention) for t in out.tokens] if body.return_attention else None,
                cross_attention=([attention_lists(t.cross_attention) for t in out.tokens]
                                 if body.return_attention and streams_cross else None),
                ablate=echo,
            ).model_dump_json(exclude={"ablate"} if echo is None else None).encode()

        return Response(await off_loop(answer), media_type="application/json")

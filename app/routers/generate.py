"""POST /generate: continue a prompt, as one JSON answer or as server-sent events."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from model import SamplingParams

from ..deps import get_state
from ..engine import Engine, GenerationJob
from ..generation import SSE_HEADERS, cancel_on_disconnect, check_lengths, check_new_token_limit, collect, sse
from ..schemas import GenerateRequest, GenerateResponse
from ..registry import GENERATE, lookup
from ..state import AppState

router = APIRouter(tags=["generate"])

ERRORS = {
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
                                   "description": "each `event: token` carries a StreamToken, the last "
                                                  "`event: done` a StreamDone (or `event: error` a "
                                                  "{message})",
                                   "oneOf": [{"$ref": "#/components/schemas/StreamToken"},
                                             {"$ref": "#/components/schemas/StreamDone"}]}}},
                               "description": "JSON, or with stream=true a stream of `token` events, "
                                              "then one `done` (or `error`) event"}},
)
async def generate(body: GenerateRequest, request: Request, state: AppState = Depends(get_state)):
    served = lookup(state, body.model, GENERATE)
    engine: Engine = served.runner
    settings = state.settings
    check_new_token_limit(settings, body.max_new_tokens, "max_new_tokens")
    tok = engine.tokenizer
    prompt_ids = tok.encode(body.prompt)
    check_lengths(engine, settings, prompt_ids, body.max_new_tokens)
    job = GenerationJob(
        prompt_ids=prompt_ids,
        max_new_tokens=body.max_new_tokens,
        sampling=SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, seed=body.seed),
        stop=body.stop,
        n_logprobs=body.logprobs,
        return_attention=body.return_attention,
    )
    handle = engine.submit(job)
    gen_id = f"gen-{uuid.uuid4().hex[:24]}"
    metrics = state.metrics
    prompt_tokens = [{"id": i, "text": tok.display_text(i)} for i in prompt_ids]

    if body.stream:
        async def events():
            try:
                async for event in handle.events():
                    if event.kind == "token":
                        t = event.data
                        # as documented (StreamToken) and as in the JSON answer: a list, [] without logprobs
                        yield sse("token", {**t, "top_logprobs": t["top_logprobs"] or []})
                    elif event.kind == "done":
                        d = event.data
                        metrics.observe_generation(d)
                        yield sse("done", {"id": gen_id, "finish_reason": d["finish_reason"],
                                           "prompt_tokens": prompt_tokens, "text": d["text"],
                                           "delta": d["delta"], "usage": d["usage"], "timings": d["timings"]})
                    else:
                        yield sse("error", {"message": event.data["message"]})
            except Exception as e:  # anything on our side mid-stream: tell the client
                yield sse("error", {"message": f"internal error: {type(e).__name__}"})
            finally:
                handle.cancel()  # client gone (the stream was cancelled) or finished: free the slot

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async with cancel_on_disconnect(request, [handle]):
        out = await collect(handle, metrics)
    tokens = [{"id": t["id"], "text": t["text"], "logprob": t["logprob"], "top_logprobs": t["top_logprobs"] or []}
              for t in out.tokens]
    return {
        "id": gen_id,
        "model": served.name,
        "text": out.done["text"],
        "prompt_tokens": prompt_tokens,
        "tokens": tokens,
        "finish_reason": out.done["finish_reason"],
        "usage": out.done["usage"],
        "timings": out.done["timings"],
        "attention": [t["attention"] for t in out.tokens] if body.return_attention else None,
    }

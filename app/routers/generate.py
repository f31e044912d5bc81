"""POST /generate: continue a prompt, as one JSON answer or as server-sent events."""

from __future__ import annotations

import logging
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from model import SamplingParams

from ..answers import encode_json, off_loop
from ..deps import get_engine, get_state
from ..engine import Engine, GenerationJob
from ..errors import public_message
from ..generation import SSE_HEADERS, cancel_on_disconnect, check_lengths, check_new_token_limit, collect, sse
from ..prompts import tokenize_text
from ..schemas import GenerateRequest, GenerateResponse
from ..state import AppState

log = logging.getLogger("attnlens.routers")

router = APIRouter(tags=["generate"])

ERRORS = {
    400: {"description": "prompt too long for the limit or the context (the message gives the numbers)"},
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
async def generate(body: GenerateRequest, request: Request, engine: Engine = Depends(get_engine),
                   state: AppState = Depends(get_state)):
    settings = state.settings
    check_new_token_limit(settings, body.max_new_tokens, "max_new_tokens")
    tok = engine.tokenizer
    prompt_ids = await tokenize_text(tok, body.prompt, settings.max_prompt_tokens, field="prompt",
                                     limit_name="ATTNLENS_MAX_PROMPT_TOKENS")
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
                        yield sse("error", {"message": public_message(event.data["message"])})
            except Exception:  # anything on our side mid-stream: log it, tell the client
                log.exception("stream failed")
                yield sse("error", {"message": "internal error (see the server log)"})
            finally:
                handle.cancel()  # client gone (the stream was cancelled) or finished: free the slot

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async with cancel_on_disconnect(request, [handle]):
        out = await collect(handle, metrics)
    tokens = [{"id": t["id"], "text": t["text"], "logprob": t["logprob"], "top_logprobs": t["top_logprobs"] or []}
              for t in out.tokens]
    content = {
        "id": gen_id,
        "model": state.model_name,
        "text": out.done["text"],
        "prompt_tokens": prompt_tokens,
        "tokens": tokens,
        "finish_reason": out.done["finish_reason"],
        "usage": out.done["usage"],
        "timings": out.done["timings"],
        "attention": [t["attention"] for t in out.tokens] if body.return_attention else None,
    }
    # GenerateResponse's shape; encoded on a worker thread (with attention it can be megabytes
    # of floats, which validating and encoding on the event loop would stall every client)
    return Response(await off_loop(encode_json, content), media_type="application/json")

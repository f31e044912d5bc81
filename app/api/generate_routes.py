"""POST /generate: continue a prompt (text, or token `ids` as they are; or a chat model's
conversation, `messages`), as one JSON answer or as server-sent events (the serving side is
app/serving/generate_serving.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from attnlens.app.api.deps import GeneratingModel, StateDep
from attnlens.app.api.generate_schemas import GenerateResponse
from attnlens.app.serving.generate_serving import GenerateServing

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
    return await GenerateServing(state).generate(asked.body, asked.served, request)

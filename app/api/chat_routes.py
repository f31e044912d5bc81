"""OpenAI's chat completions: POST /v1/chat/completions (the serving is app/serving/openai_serving.py).

`model` names a loaded model whose checkpoint has a chat template (GET /models lists `chat` in
its tasks); none = the default model, or the one loaded model with a template. `n`, `stop`,
`seed`, `logit_bias` and the penalties act as on /v1/completions; `logprobs` / `top_logprobs`
give OpenAI's chat form; `max_tokens` and `max_completion_tokens` are one limit (two
different values are a 400); without either, a choice may fill the context up to
ATTNLENS_MAX_NEW_TOKENS. Tools, images and audio are not supported (a 422 names the field).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from attnlens.app.api.chat_schemas import ChatCompletion
from attnlens.app.api.deps import ChatModel, StateDep
from attnlens.app.serving.openai_serving import ERRORS, chat_completion, stream_description

router = APIRouter(prefix="/v1", tags=["openai"])


STREAM = stream_description("ChatCompletion", "object chat.completion.chunk: the role, then each token's content, "
                                               "then the finish reason")


@router.post("/chat/completions", response_model=ChatCompletion, response_model_exclude_none=False,
             responses={**ERRORS, 200: STREAM})
async def chat_completions(asked: ChatModel, request: Request, state: StateDep):
    """The assistant's next turn in a conversation, rendered with the model's own chat template."""
    return await chat_completion(asked.body, asked.served, request, state)

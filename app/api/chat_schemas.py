"""Bodies of OpenAI's chat completions (POST /v1/chat/completions); the conversation itself
(`messages`, which /generate and /attention take too) is in schemas.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from attnlens.app.api.common_schemas import Messages
from attnlens.app.api.openai_schemas import CompletionUsage, SamplingRequest


class ChatCompletionRequest(SamplingRequest):
    messages: Messages
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (OpenAI's older name of "
                                   "max_completion_tokens; give one of the two); default: as many as fit in the "
                                   "context, up to ATTNLENS_MAX_NEW_TOKENS")
    max_completion_tokens: int | None = Field(None, ge=1, description="tokens to generate at most")
    logprobs: bool = Field(False, description="each generated token's log-probability and bytes")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: this many most likely "
                                     "tokens at each position")


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    system_fingerprint: str | None = None

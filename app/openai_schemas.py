"""Bodies of the OpenAI-compatible legacy completions API (/v1/completions, /v1/models)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .schemas import Text

TokenIds = list[int]
Prompt = Text | list[Text] | TokenIds | list[TokenIds]


class CompletionRequest(BaseModel):
    # Clients send fields we do not use (user, presence_penalty, ...): accept and ignore them.
    # Types are strict: "4" or true is no integer, "yes" no boolean.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text | None = Field(None, description="a model id from GET /v1/models (others: 404); "
                                                 "default: the default model")
    prompt: Prompt = Field(description="a string, a list of strings, a list of token ids, or a list of lists of "
                                       "token ids (one choice set per prompt), as in OpenAI's API")
    max_tokens: int = Field(16, ge=0, description="0 with echo scores the prompt only")
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1, description="extension (as vLLM)")
    n: int = Field(1, ge=1, le=16)
    stop: Text | list[Text] | None = None
    stream: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    seed: int | None = Field(None, ge=0, lt=2**63)
    echo: bool = False
    stream_options: dict[str, Any] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        if isinstance(v, str):
            items = [v]
        elif v and isinstance(v[0], int):
            items = [v]  # one prompt of token ids
        else:
            items = v
        if not items:
            raise ValueError("prompt must not be an empty list")
        if any(len(p) == 0 for p in items):
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in items):
            raise ValueError("stop sequences must not be empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text, or its token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class LogProbs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: LogProbs | None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "attnlens"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIError

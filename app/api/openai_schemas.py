"""Bodies of the OpenAI-compatible API: what completions and chat share (SamplingRequest), the legacy
completions (/v1/completions), the embeddings (/v1/embeddings), the model list (/v1/models) and the
error shape. Chat's own bodies are in chat_schemas.py."""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

from attnlens.app.api.common_schemas import ModelName, NonEmptyText, Stop, Text, count_stops
from attnlens.model.generation_config import SamplingDefaults

TokenIds = list[int]
Prompt = Text | list[Text] | TokenIds | list[TokenIds]
MAX_PROMPTS = 2048  # prompts in one request's list (the server's places bound it further, before tokenising)
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
# OpenAI's defaults, for a field neither the request nor the model (its generation_config.json,
# ATTNLENS_GENERATION_CONFIG=auto) sets; top_k unset is off
OPENAI_SAMPLING = SamplingDefaults(temperature=1.0, top_p=1.0)


class SamplingRequest(BaseModel):
    """What /v1/completions and /v1/chat/completions both take: the model, how to sample, how many
    choices, when to stop, whether to stream."""

    # Every field of OpenAI's API is declared; one that changes the answer does what OpenAI's
    # does, or is refused with a 400 naming it. Unknown fields are a 422, so a misspelt or
    # unsupported option never goes unnoticed. Types are strict: "4" or true is no integer,
    # "yes" no boolean.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: ModelName | None = Field(None, description="a model id from GET /v1/models (others: 404); "
                                                      "default: the default model")
    # sampling: a field left out (or null) is the model's recommended value (GET /models
    # sampling_defaults, as vLLM's --generation-config auto), else OpenAI's default; each field on its own
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False, description=(
        f"default: the model's (GET /models sampling_defaults), else {OPENAI_SAMPLING.temperature:g}"))
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description=(
        f"default: the model's (GET /models sampling_defaults), else {OPENAI_SAMPLING.top_p:g}"))
    top_k: int | None = Field(None, ge=-1, description="extension (as vLLM): 0 or -1 = off (every token); "
                                                        "default: the model's, else off")
    n: int = Field(1, ge=1, le=16)
    stop: Stop = None
    stream: bool = False
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False, description=(
        "subtracted from the logit of every token already generated in this choice (as vLLM and OpenAI)"))
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False, description=(
        "times the number of times a token was generated in this choice, subtracted from its logit"))
    logit_bias: dict[str, float] | None = Field(None, description=(
        f"token id (as a string) -> a bias in [-100, 100] added to its logit at every step (at most "
        f"{MAX_LOGIT_BIAS} tokens); log-probabilities stay the model's own"))
    user: Text | None = Field(None, description="accepted, not used")
    stream_options: dict[str, Any] | None = Field(None, description="with stream: {\"include_usage\": true} "
                                                                  "adds a last chunk with the usage")

    _count_stops = field_validator("stop", mode="before")(count_stops)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, v):
        if isinstance(v, dict) and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased (got {len(v)})")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_values(cls, v):
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys are token ids written as strings, e.g. \"50256\"; got {key[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"the bias of token {key} is {bias}: biases run from -100 to 100")
        return v


class CompletionRequest(SamplingRequest):
    prompt: Prompt = Field(description="a string, a list of strings, a list of token ids, or a list of lists of "
                                       f"token ids (one choice set per prompt, at most {MAX_PROMPTS}), as in "
                                       "OpenAI's API")
    max_tokens: int = Field(16, ge=0, description="0 with echo scores the prompt only")
    best_of: int | None = Field(None, ge=1, le=20, description="generate this many choices per prompt (at least n) "
                                "and return the n with the highest log-probability per token; not with stream")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: Text | None = Field(None, description="not supported (no model here fills in a middle): "
                                                  "anything but null or \"\" is a 400")

    @field_validator("prompt", mode="before")
    @classmethod
    def _count_prompts(cls, v):
        # counted before each prompt is validated: a list of a hundred thousand is refused at once
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request (got {len(v)})")
        return v

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

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text, or its token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(cast("list[str] | list[list[int]]", p))  # not one list of ids: that was returned above


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


# --- /v1/embeddings ------------------------------------------------------------
class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request. Every field of OpenAI's API is declared; unknown fields are a
    422, and types are strict, as on the other /v1 routes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: ModelName | None = Field(None, description="an encoder's id (GET /models lists `embeddings` in its tasks); "
                                                      "default: the default model if it is an encoder, else the one "
                                                      "loaded encoder")
    input: NonEmptyText | list[NonEmptyText] | TokenIds | list[TokenIds] = Field(description=(
        "a string or a list of strings (each embedded on its own, at most ATTNLENS_MAX_EMBEDDING_INPUTS); token ids "
        "are refused (400): the server's models use their own tokenizers, so send the text"))
    encoding_format: Literal["float", "base64"] = Field("float", description=(
        "float: each embedding a list of numbers; base64: the little-endian float32 bytes, base64-encoded"))
    dimensions: int | None = Field(None, ge=1, description="only the model's own width (d_model) is accepted: "
                                                           "an encoder's embeddings cannot be shortened")
    user: Text | None = Field(None, description="accepted, not used")

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be an empty list")
        return v

    @property
    def texts(self) -> list[str] | None:
        """The texts to embed, in order; None when the input is token ids."""
        v = self.input
        if isinstance(v, str):
            return [v]
        return cast("list[str]", v) if all(isinstance(x, str) for x in v) else None

    @property
    def many(self) -> bool:
        """A list of inputs (each one's errors name it as input.{index}), not one string."""
        return not isinstance(self.input, str)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="the unit-length vector, or with encoding_format base64 its "
                                                     "little-endian float32 bytes base64-encoded")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = Field(description="tokens the encoder read, [CLS] and [SEP] included")
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIError

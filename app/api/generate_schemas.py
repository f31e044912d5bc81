"""Request and response bodies of POST /generate, and its stream's events."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from attnlens.app.api.common_schemas import (
    ABLATE_DESCRIPTION,
    MODEL_FIELD,
    Ablate,
    Ablation,
    Messages,
    ModelName,
    Stop,
    Strict,
    Text,
    count_stops,
    stop_list,
)
from attnlens.model.generation_config import SamplingDefaults

# What /generate samples with when neither the request nor the model (its generation_config.json,
# ATTNLENS_GENERATION_CONFIG=auto) sets a field: top_k unset is off
GENERATE_SAMPLING = SamplingDefaults(temperature=0.8, top_p=1.0)


# --- /generate ---------------------------------------------------------------
class GenerateRequest(Strict):
    """Give exactly one of `prompt` (text to continue), `ids` (token ids to continue, as they are) or
    `messages` (a conversation, for a chat model)."""

    model_config = ConfigDict(**Strict.model_config,
                              json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["ids"]},
                                                           {"required": ["messages"]}]})

    model: ModelName | None = Field(None, description=MODEL_FIELD)
    prompt: Text | None = Field(None, min_length=1, description="text to continue")
    ids: list[int] | None = Field(None, min_length=1, description="token ids to continue, as they are (nothing "
                                  "added: a model whose tokenizer adds BOS to a text gets none here); at most "
                                  "ATTNLENS_MAX_PROMPT_TOKENS")
    messages: Messages | None = None
    max_new_tokens: int = Field(64, ge=1, description="1..ATTNLENS_MAX_NEW_TOKENS")
    # sampling: a field left out (or null) is the model's recommended value (GET /models
    # sampling_defaults), else GENERATE_SAMPLING's; each field on its own
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False, description=(
        f"0 = greedy; default: the model's (GET /models sampling_defaults), else {GENERATE_SAMPLING.temperature}"))
    top_k: int | None = Field(None, ge=0, description="0 = off (every token); default: the model's, else off")
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description=(
        f"1 = off; default: the model's, else {GENERATE_SAMPLING.top_p:g}"))
    seed: int | None = Field(None, ge=0, lt=2**63, description="same seed and parameters, same text")
    stop: Stop = None
    logprobs: int = Field(0, ge=0, le=20, description="alternatives per token")
    stream: bool = False
    return_attention: bool = False
    ablate: Ablate = Field(None, description=ABLATE_DESCRIPTION + "; only this generation's row is edited (it "
                           "shares its decode batch with other requests)")

    _count_stops = field_validator("stop", mode="before")(count_stops)

    @field_validator("stop", mode="after")
    @classmethod
    def _stops(cls, v):
        return stop_list(v)  # always a list from here on

    @property
    def sampling(self) -> SamplingDefaults:
        """The sampling fields this request sets (None: left to the model, then to GENERATE_SAMPLING)."""
        return SamplingDefaults(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


class TokenText(BaseModel):
    id: int
    text: str


class Alternative(TokenText):
    logprob: float


class GeneratedTokenOut(TokenText):
    logprob: float
    top_logprobs: list[Alternative] = []


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = Field(description="tokens the model generated, including a final EOS")
    total_tokens: int


class Timings(BaseModel):
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    tokens_per_second: float
    time_to_first_token_ms: float


FinishReason = Literal["length", "stop", "eos"]


class GenerateResponse(BaseModel):
    id: str
    model: str
    text: str
    prompt_tokens: list[TokenText]
    tokens: list[GeneratedTokenOut]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    attention: list[list[list[list[float]]]] | None = Field(
        None, description="[token][layer][head][position]: each generated token's attention row"
    )
    cross_attention: list[list[list[list[float]]]] | None = Field(
        None, description="encoder-decoder only, with return_attention: [token][layer][head][source position]: "
        "the cross-attention row over the source (the prompt's tokens) of the step that wrote each token"
    )
    ablate: list[Ablation] | None = Field(None, description="the request's ablations, groups resolved")


class StreamToken(GeneratedTokenOut):
    """`event: token` data when streaming."""

    index: int
    delta: str = Field(description="exact text this token adds (text joins these)")
    attention: list[list[list[float]]] | None = None
    cross_attention: list[list[list[float]]] | None = Field(
        None, description="encoder-decoder only: [layer][head][source position], this step's cross-attention "
        "row over the source (the prompt's tokens)")


class StreamDone(BaseModel):
    """`event: done` data when streaming."""

    id: str
    finish_reason: FinishReason
    prompt_tokens: list[TokenText] = Field(description="the prompt's tokens, as in the non-streamed answer: "
                                                       "their ids followed by the token events' ids are the "
                                                       "whole sequence (e.g. for /attention `ids`)")
    text: str = Field(description="the whole generated text")
    delta: str = Field(description="text no token event carried: usually empty, else a final partial "
                                   "character (U+FFFD); the token deltas plus this equal `text`")
    usage: Usage
    timings: Timings
    ablate: list[Ablation] | None = Field(None, description="the request's ablations, groups resolved")


class StreamError(BaseModel):
    """`event: error` data when streaming: the generation failed on the server."""

    message: str
    code: str | None = Field(None, description="why, e.g. engine_restarting (retry after `retry_after` s), "
                             "engine_failed, stream_backlog_exceeded, generation_failed")
    retry_after: int | None = Field(None, description="seconds after which the same request may succeed")



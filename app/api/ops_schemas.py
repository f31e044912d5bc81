"""Bodies of the operations routes: /healthz, /readyz, /model(s), and the error body."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from attnlens.model.generation_config import ModelSampling


# --- operations --------------------------------------------------------------
class Health(BaseModel):
    status: str


class ModelState(BaseModel):
    """How one model's engine is doing (app/engine/supervisor.py)."""

    state: Literal["starting", "running", "restarting", "failed", "stopped"]
    restarts: int = Field(0, description="engine processes started again after one stopped")
    detail: str | None = Field(None, description="why it does not run, when it does not")


class Readiness(BaseModel):
    ready: bool
    status: str
    detail: str | None = None
    models: dict[str, ModelState] | None = Field(None, description="each model's state, by name")


class SamplingDefaultsInfo(BaseModel):
    """The model's recommended sampling: what a generating request that leaves a field unset (or null)
    gets, each field on its own; null: the model recommends none, the API's default applies (/generate:
    temperature 0.8, top_p 1; /v1: OpenAI's temperature 1, top_p 1; top_k off)."""

    temperature: float | None = Field(None, description="0 = greedy")
    top_p: float | None = None
    top_k: int | None = Field(None, description="0 = off (every token)")
    source: str | None = Field(None, description="where they come from: generation_config.json (the checkpoint's), "
                               "or null for none (ATTNLENS_GENERATION_CONFIG=none, or a model that recommends none)")
    not_applied: dict[str, Any] = Field(default_factory=dict, description=(
        "fields of generation_config.json that change sampling but are not applied here (e.g. repetition_penalty)"))

    @classmethod
    def of(cls, sampling: ModelSampling) -> SamplingDefaultsInfo:
        """A served model's `sampling` as GET /models and /model show it."""
        given = not sampling.defaults.empty
        return cls(**sampling.defaults.as_dict(), source="generation_config.json" if given else None,
                   not_applied=sampling.not_applied)


class ModelInfo(BaseModel):
    name: str
    path: str = Field(description="the checkpoint directory's name (never the server's absolute path)")
    architecture: dict[str, Any]
    parameters: int
    parameters_without_embeddings: int
    device: str
    dtype: str
    weights: str = Field(description='how the weights are held: the dtype, or "packed: Q4_1 x120, Q8_0 x1" '
                                     "(ATTNLENS_DTYPE=packed: the GGUF file's blocks, float32 activations)")
    context_length: int
    vocab_size: int
    tokenizer_vocab_size: int
    training: dict[str, Any] | None
    limits: dict[str, int]
    sampling_defaults: SamplingDefaultsInfo


class ErrorBody(BaseModel):
    """A native error: `detail` is a message, or pydantic's list of {loc, msg, type} for a 422."""

    detail: Any
    param: str | None = Field(None, description="the request field to fix, when one is to blame")
    code: str | None = Field(None, description="machine-readable reason, e.g. context_length_exceeded")

"""Bodies of the operations routes: /healthz, /readyz, /model(s), and the error body."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


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


class ErrorBody(BaseModel):
    """A native error: `detail` is a message, or pydantic's list of {loc, msg, type} for a 422."""

    detail: Any
    param: str | None = Field(None, description="the request field to fix, when one is to blame")
    code: str | None = Field(None, description="machine-readable reason, e.g. context_length_exceeded")

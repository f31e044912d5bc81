"""Request and response bodies of the model list and the encoder's tasks
(/models, /fill-mask, /classify), shaped like Hugging Face's pipelines."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from .schemas import ModelName, Strict, Text

Family = Literal["decoder", "encoder", "encoder-decoder"]


class ModelSummary(BaseModel):
    name: str = Field(description="the value to pass as a request's `model`")
    family: Family
    default: bool = Field(description="used when a request names no model")
    n_layers: int
    n_heads: int
    d_model: int
    context_length: int
    vocab_size: int
    parameters: int
    tasks: list[str] = Field(description="the endpoints this model answers, e.g. generate, fill-mask, classify, attention")
    attention: Literal["causal", "bidirectional", "encoder-decoder"] = Field(
        description="causal (a decoder), bidirectional (an encoder), or encoder-decoder (bidirectional "
        "encoder, causal decoder, and cross-attention from the target to the source)")
    labels: list[str] | None = Field(None, description="a classifier's labels, in the head's order")
    pooling: str | None = Field(None, description="how the classification head pools the positions")
    state: Literal["starting", "running", "restarting", "failed", "stopped"] = Field(
        "running", description="its engine's state: a model that is not running answers 503 for now "
                               "(restarting) or for good (failed)")
    restarts: int = Field(0, description="engine processes started again after one stopped")
    detail: str | None = Field(None, description="why it is not running, when it is not")


class ModelsResponse(BaseModel):
    default: str
    models: list[ModelSummary]


# --- /fill-mask --------------------------------------------------------------
class FillMaskRequest(Strict):
    model: ModelName | None = Field(None, description="a name from GET /models; default: the default model, or "
                                                      "the one loaded model that can fill masks")
    text: Text = Field(min_length=1, description="text with one or more [MASK]")
    top_k: int = Field(5, ge=1, le=100, description="candidates per mask")


class FillMaskCandidate(BaseModel):
    score: float = Field(description="probability of this token at the mask (softmax over the whole vocabulary, "
                                     "as Hugging Face's pipeline gives it; special tokens are never candidates)")
    token: int = Field(description="token id")
    token_str: str = Field(description="the token's text as it would appear in place (leading space included)")
    sequence: str = Field(description="the input text with this candidate in place of its [MASK], decoded by the "
                                      "tokenizer as Hugging Face's fill-mask pipeline does")


class FillMaskResponse(BaseModel):
    model: str
    masks: list[list[FillMaskCandidate]] = Field(description="one list per [MASK], in text order, best first")


# --- /classify ---------------------------------------------------------------
class ClassifyRequest(Strict):
    model: ModelName | None = Field(None, description="a name from GET /models; default: the default model, or "
                                                      "the one loaded model that can classify")
    text: Text = Field(min_length=1, description="the passage to classify")


class LabelScore(BaseModel):
    label: str
    score: float


class ClassifyResponse(BaseModel):
    model: str
    labels: list[LabelScore] = Field(description="every label, highest score first")

"""Request and response bodies of the model list and the encoder's tasks
(/models, /fill-mask, /classify), shaped like Hugging Face's pipelines."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from attnlens.app.api.common_schemas import ModelName, NonEmptyText, Strict
from attnlens.app.api.ops_schemas import SamplingDefaultsInfo


class AttentionGroupInfo(BaseModel):
    name: str = Field(description="the group's key in answers, e.g. self, encoder, decoder, cross")
    queries: str = Field(description="the axis its rows run over: tokens, source or target")
    keys: str = Field(description="the axis its columns run over")
    causal: bool = Field(description="zero above the diagonal")
    cross: bool = Field(description="rows read another sequence than their own (queries != keys)")
    description: str


class GenerationInfo(BaseModel):
    prompt: str = Field(description="prefix: the output continues the prompt in one context; source: the "
                                    "prompt is read by an encoder and the output has a context of its own")
    step_groups: list[str] = Field(description="the groups each generated token's attention rows come from")


class LensInfo(BaseModel):
    stream: str = Field(description="the axis whose positions /logits and /lens score: tokens, or target")
    predicts: str = Field(description="next: a position's logits predict the next token; same: the token at the "
                                      "position (a masked-LM head)")
    head: str


class FamilyInfo(BaseModel):
    """A family's declaration (model/families/contract.py): what the page and clients read."""

    name: str
    description: str
    attention_kind: str
    framing: str = Field(description="how a text is framed for analysis: plain, or cls_sep ([CLS] text [SEP])")
    axes: list[str]
    groups: list[AttentionGroupInfo] = Field(description="the attention groups, the primary one first")
    generation: GenerationInfo | None = Field(description="null when the family does not generate")
    lens: LensInfo | None = Field(None, description="what /logits and /lens read; null: the family has no per-position "
                                  "logits")
    ablation_group: str | None = Field(None, description="the group an `ablate` entry without `group` edits")


class ModelMemory(BaseModel):
    weights_bytes: int = Field(description="the model's parameters and buffers")
    kv_cache_bytes: int = Field(description="its generation engine's KV cache (0 for a model that does not generate)")
    kv_cache_rows: int = Field(description="generations its engine decodes at once: ATTNLENS_MAX_CONCURRENT, or "
                                           "fewer when ATTNLENS_KV_CACHE_BYTES holds fewer rows")


class HeadFigure(BaseModel):
    figure: str = Field(description="what was measured, on held-out text")
    value: float
    baseline: float | None = Field(None, description="a simple baseline measured on the same examples")
    weak: bool = Field(description="fill-mask: top-1 under 0.30; classify: not above its bag-of-words baseline")


class ModelSummary(BaseModel):
    name: str = Field(description="the value to pass as a request's `model`")
    family: str = Field(description="the family's name; `family_info` is its declaration")
    family_info: FamilyInfo
    default: bool = Field(description="used when a request names no model")
    n_layers: int
    n_heads: int
    d_model: int
    context_length: int
    vocab_size: int
    parameters: int
    memory: ModelMemory
    tasks: list[str] = Field(description="the endpoints this model answers, e.g. generate, fill-mask, classify, attention")
    attention: str = Field(
        description="the family's attention kind: causal (a decoder), bidirectional (an encoder), or "
        "encoder-decoder (bidirectional encoder, causal decoder, and cross-attention from the target to the source)")
    labels: list[str] | None = Field(None, description="a classifier's labels, in the head's order")
    pooling: str | None = Field(None, description="how the classification head and the embeddings "
                                                        "(/v1/embeddings) pool the positions: mean or cls")
    head_figures: dict[str, HeadFigure] = Field(
        default_factory=dict, description="an encoder head's held-out figure from its report, by task "
                                          "(fill-mask, classify): how far to trust its answers")
    classifier_layers: int = Field(0, description="the classification head's own fine-tuned copies of the top "
                                   "blocks (all-MiniLM-L6-v2's genre head): classify reads them instead of the "
                                   "model's, whose maps /attention shows")
    state: Literal["starting", "running", "restarting", "failed", "stopped"] = Field(
        "running", description="its engine's state: a model that is not running answers 503 for now "
                               "(restarting) or for good (failed)")
    restarts: int = Field(0, description="engine processes started again after one stopped")
    detail: str | None = Field(None, description="why it is not running, when it is not")
    sampling_defaults: SamplingDefaultsInfo = Field(
        default_factory=SamplingDefaultsInfo, description="a generating model's recommended sampling: what a "
        "request that leaves temperature, top_p or top_k unset gets (all null: the API's own defaults)")


class ModelsResponse(BaseModel):
    default: str
    models: list[ModelSummary]


# --- /fill-mask --------------------------------------------------------------
class FillMaskRequest(Strict):
    model: ModelName | None = Field(None, description="a name from GET /models; default: the default model, or "
                                                      "the one loaded model that can fill masks")
    text: NonEmptyText = Field(description="text with one or more [MASK]")
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
    text: NonEmptyText = Field(description="the passage to classify")


class LabelScore(BaseModel):
    label: str
    score: float


class ClassifyResponse(BaseModel):
    model: str
    labels: list[LabelScore] = Field(description="every label, highest score first")

"""Request and response bodies of POST /attention."""
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
    Strict,
    Text,
)
from attnlens.app.api.generate_schemas import TokenText


# --- /attention --------------------------------------------------------------
class AttentionRequest(Strict):
    """Give exactly one of `text` (tokenised here), `ids` (used as they are) or `messages` (a
    conversation rendered with a chat model's template)."""

    # the description says so too: exactly one of them (clients and fuzzers generate valid bodies)
    model_config = ConfigDict(**Strict.model_config, json_schema_extra={
        "oneOf": [{"required": ["text"]}, {"required": ["ids"]}, {"required": ["messages"]}]})

    model: ModelName | None = Field(None, description=MODEL_FIELD)
    text: Text | None = Field(None, min_length=1, description="text to tokenise and analyse")
    ids: list[int] | None = Field(
        None, min_length=1,
        description="token ids to analyse as they are, e.g. a prompt's `prompt_tokens` ids followed by the "
        "generated tokens' ids: no re-tokenising, so the maps match the generated sequence even where "
        "its text holds U+FFFD for partial UTF-8 characters",
    )
    messages: Messages | None = None
    layers: list[int] | None = Field(None, min_length=1, description="layer indices, default all")
    heads: list[int] | None = Field(None, min_length=1, description="head indices, default all")
    format: Literal["json", "f16", "u8"] = "json"
    packing: Literal["full", "tril"] = Field(
        "full",
        description="'full' = every cell row-major; 'tril' = per matrix only the cells on or below the "
        "diagonal, row by row (row i has i+1 values), ~half the bytes (with format=json each matrix "
        "is then a list of rows of growing length); causal (decoder) attention only",
    )
    # encoder-decoder only: `text` / `ids` are the source; the target is given or translated
    target: Text | None = Field(None, min_length=1, description="encoder-decoder only: the target text "
                               "(tokenised here); without target or target_ids, the model's greedy translation")
    target_ids: list[int] | None = Field(None, min_length=1, description="encoder-decoder only: the target's "
                                         "token ids as they are (without the decoder's start token)")
    ablate: Ablate = Field(None, description=ABLATE_DESCRIPTION + "; the maps are those of the ablated model "
                           "(an encoder-decoder's default target is still the unablated model's translation)")
    # what each map becomes, computed a block of query rows at a time (never the whole map held)
    pool: int | None = Field(None, ge=1, le=4096, description=(
        "each map as an N x N grid over contiguous, near-equal bins (fewer where a window is shorter; "
        "the answer's row_edges / col_edges give them): cell (i, j) is the mean, over the queries in "
        "row bin i, of the total attention they give to the keys in column bin j, so pooled rows "
        "still sum to 1; a causal map's empty upper cells are 0. Not with top_k"))
    top_k: int | None = Field(None, ge=1, le=1024, description=(
        "for every query row its k heaviest keys, heaviest first: `positions` (key positions, -1 "
        "where the weight is 0) and the weights as the maps, shape [L][H][rows][k]. Not with pool"))
    rows: list[int] | None = Field(None, min_length=2, max_length=2, description=(
        "[a, b]: query positions a .. b-1 only, at full resolution (or pooled, or top-k); each "
        "group's window is clipped to its own axis"))
    cols: list[int] | None = Field(None, min_length=2, max_length=2, description=(
        "[c, d]: key positions c .. d-1 only (the weights are still those of the whole row's softmax)"))

    @field_validator("rows", "cols")
    @classmethod
    def _window(cls, v):
        if v is not None and not 0 <= v[0] < v[1]:
            raise ValueError(f"a window [start, end] needs 0 <= start < end, got {v}")
        return v


class ReducedMaps(BaseModel):
    """What a group's answer states beside its maps: the window it covers; a pooled answer's bins; a
    top-k answer's keys."""

    rows: list[int] | None = Field(None, description="[a, b]: the query positions the maps cover")
    cols: list[int] | None = Field(None, description="[c, d]: the key positions the maps cover")
    row_edges: list[int] | None = Field(None, description="pool: the row bins' edges (bin i is edges[i] .. edges[i+1]-1)")
    col_edges: list[int] | None = Field(None, description="pool: the column bins' edges")
    positions: list[list[list[list[int]]]] | str | None = Field(
        None, description="top_k: each row's keys, heaviest first (-1: none); json nested lists, "
        "else base64 of little-endian int32")
    positions_dtype: Literal["int32"] | None = None


class AttentionGroup(ReducedMaps):
    """One group of maps in the format asked for (the same fields as the top level's)."""

    shape: list[int] = Field(description="[len(layers), len(heads), rows, columns]")
    attention: list[list[list[list[float]]]] | None = Field(None, description="format=json")
    data: str | None = Field(None, description="f16/u8: base64 of the row-major array")
    dtype: Literal["float16", "uint8"] | None = None
    packing: Literal["full", "tril"] | None = None
    scale: float | None = None


class TranslationAttention(BaseModel):
    """An encoder-decoder's second and third groups (the first, the encoder's self-attention
    over the source, is the answer's top-level maps). Rows of `decoder` and `cross` are
    `target_tokens` (the decoder's start token, then the target); columns of `cross` are the
    source tokens (the answer's `tokens`)."""

    target_tokens: list[TokenText]
    generated: bool = Field(description="true when the target is the model's own greedy translation")
    decoder: AttentionGroup = Field(description="decoder self-attention, [L][H][T][T], causal "
                                    "(packing 'tril' applies here only)")
    cross: AttentionGroup = Field(description="cross-attention, [L][H][T][S]: target rows over source columns")


class AttentionGroupAxes(BaseModel):
    """One of the family's attention groups as it declares it (GET /models has the full declaration)."""

    name: str
    queries: str = Field(description="the axis the rows run over: tokens, source or target")
    keys: str = Field(description="the axis the columns run over")
    causal: bool


class AttentionResponse(ReducedMaps):
    model: str
    family: str = Field("decoder", description="the model's family (GET /models describes its attention groups)")
    groups: list[AttentionGroupAxes] = Field(default_factory=list, description=(
        "the family's attention groups, the primary one (the top-level maps) first; the others are "
        "under `translation` by name"))
    direction: str = Field(
        "causal", description="the family's attention kind. causal: position i sees positions <= i (zero above the diagonal); "
        "bidirectional: every position sees every other (an encoder; full T x T maps); encoder-decoder: "
        "the top-level maps are the encoder's over the source, `translation` has the decoder's and the cross maps")
    tokens: list[TokenText] = Field(description="the analysed positions; an encoder's text is framed "
                                                "as [CLS] text [SEP]")
    n_layers: int
    n_heads: int
    layers: list[int]
    heads: list[int]
    format: Literal["json", "f16", "u8"]
    shape: list[int] = Field(description="[len(layers), len(heads), T, T]; pooled [.., N, N], top_k [.., rows, k], "
                                         "a window [.., b - a, d - c]")
    attention: list[list[list[list[float]]]] | None = Field(None, description="format=json")
    data: str | None = Field(None, description="f16/u8: base64 of the row-major array")
    dtype: Literal["float16", "uint8"] | None = Field(None, description="element type of data (little-endian)")
    packing: Literal["full", "tril"] | None = None
    scale: float | None = Field(None, description="u8: value = byte * scale")
    translation: TranslationAttention | None = Field(
        None, description="encoder-decoder only: `tokens` are the source and the top-level maps its "
        "encoder self-attention [L][H][S][S] (always packing 'full'); this holds the target's tokens, the "
        "decoder self-attention and the cross-attention")
    ablate: list[Ablation] | None = Field(None, description="the request's ablations, groups resolved")



"""Request and response bodies of the causal routes: POST /patch (activation and attribution patching)
and POST /logit-attribution (direct logit attribution), of a decoder (model/analysis/patching.py,
attribution_patching.py, logit_attribution.py) or an encoder-decoder (encoder_decoder_patching.py,
encoder_decoder_attribution.py).

The metric is logit(answer) - logit(foil) at `position` (default the last). A prompt is `text`
(tokenised as /attention tokenises a decoder's prompt) or `ids` (as they are); an answer or a foil
is the text of exactly one token, or its id. An encoder-decoder's prompts are its sources, read with
one target (`target` | `target_ids`, default none: the start token alone), and `position` is a
target position (0: the start token); its values and heads come by group (encoder, decoder, cross).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.config import JsonDict

from attnlens.app.api.common_schemas import MODEL_FIELD, ModelName, Strict, Text
from attnlens.app.api.generate_schemas import TokenText

Component = Literal["heads", "heads_by_position", "residual", "layers", "paths"]
Method = Literal["exact", "attribution"]

ANSWER_FIELD = "the answer token's text, exactly one token (e.g. \" Mary\", its leading space included)"
FOIL_FIELD = "the foil token's text, exactly one token: the metric is logit(answer) - logit(foil)"
TARGET_FIELD = ("encoder-decoder only: the target both sources are read with (tokenised here; the decoder's start "
                "token comes first); default none: the metric is on the first target token")
TARGET_IDS_FIELD = "encoder-decoder only: the target's token ids (without the start token)"
POSITION_FIELD = ("where the metric is read (its logits predict the next token); default the last position. An "
                  "encoder-decoder's is a target position, 0 the start token")


class Sender(Strict):
    """The head whose write is patched along its paths (component "paths")."""

    layer: int = Field(description="0..n_layers-1")
    head: int = Field(description="0..n_heads-1")
    group: str | None = Field(None, description="the head's attention group: an encoder-decoder's encoder, decoder "
                              "or cross (required there); a decoder's is its one group (self), the default")


PATCH_ONE_OF: JsonDict = {"allOf": [
    {"oneOf": [{"required": ["clean"]}, {"required": ["clean_ids"]}]},
    {"oneOf": [{"required": ["corrupted"]}, {"required": ["corrupted_ids"]}]},
    {"oneOf": [{"required": ["answer"]}, {"required": ["answer_id"]}]},
    {"oneOf": [{"required": ["foil"]}, {"required": ["foil_id"]}]},
    {"not": {"required": ["target", "target_ids"]}},
]}


class PatchRequest(Strict):
    """Which components carry the difference between a clean and a corrupted prompt: each cell of
    `component` patched from the clean run into the corrupted one, the metric logit(answer) -
    logit(foil) read at `position`. Give one of clean / clean_ids, corrupted / corrupted_ids,
    answer / answer_id and foil / foil_id each; the prompts have the same number of tokens. An
    encoder-decoder's prompts are two sources read with one target (target / target_ids)."""

    model_config = ConfigDict(**Strict.model_config, json_schema_extra=PATCH_ONE_OF)

    model: ModelName | None = Field(None, description=MODEL_FIELD + "; a decoder or an encoder-decoder")
    clean: Text | None = Field(None, min_length=1, description="the clean prompt's text (tokenised as /attention "
                               "tokenises a decoder's prompt; an encoder-decoder's source)")
    clean_ids: list[int] | None = Field(None, min_length=1, description="the clean prompt's token ids as they are")
    corrupted: Text | None = Field(None, min_length=1, description="the corrupted prompt's text: as many tokens as "
                                   "the clean one")
    corrupted_ids: list[int] | None = Field(None, min_length=1, description="the corrupted prompt's token ids: as "
                                            "many as the clean one's")
    answer: Text | None = Field(None, min_length=1, description=ANSWER_FIELD)
    answer_id: int | None = Field(None, description="the answer token's id")
    foil: Text | None = Field(None, min_length=1, description=FOIL_FIELD)
    foil_id: int | None = Field(None, description="the foil token's id")
    target: Text | None = Field(None, min_length=1, description=TARGET_FIELD)
    target_ids: list[int] | None = Field(None, description=TARGET_IDS_FIELD)
    position: int | None = Field(None, ge=0, description=POSITION_FIELD)
    component: Component = Field("heads", description="heads: each head's output at every position [L][H]; "
                                 "heads_by_position: at one position [L][T][H]; residual: a block's input stream "
                                 "at one position [L][T]; layers: each attention and MLP output at one position "
                                 "{attention, mlp: [L][T]}; paths: from `sender` to each later head's query, key "
                                 "or value input {q, k, v: [L][H]}. An encoder-decoder's by group: heads {encoder, "
                                 "decoder, cross: [L][H]}, heads_by_position {encoder: [L][S][H], decoder, cross: "
                                 "[L][T][H]}, residual {encoder: [L][S], decoder: [L][T]}, layers {encoder: "
                                 "{attention, mlp}, decoder: {attention, cross, mlp}}, paths {encoder, decoder, "
                                 "cross: {q, k, v}} (receivers by group, null where the sender has no direct path)")
    method: Method = Field("exact", description="exact: each cell patched in a run of its own (batched); "
                           "attribution: every cell's first-order estimate from one forward pair and one backward "
                           "(not for paths)")
    sender: Sender | None = Field(None, description="component paths only (required there): the sender head")


class LogitAttributionRequest(Strict):
    """Each head's, MLP's, the embedding's and the rest's direct write into logit(answer) -
    logit(foil) at `position`, through the final norm at its scale there. Give `text` or `ids`;
    answer and foil default to the model's top two predictions there. An encoder-decoder's text is
    its source, read with a target (target / target_ids): its decoder and cross heads, along its
    decoder's stream (post-norm: every norm's scale frozen)."""

    model_config = ConfigDict(**Strict.model_config, json_schema_extra={"allOf": [
        {"oneOf": [{"required": ["text"]}, {"required": ["ids"]}]}, {"not": {"required": ["target", "target_ids"]}}]})

    model: ModelName | None = Field(None, description=MODEL_FIELD + "; a pre-norm decoder or an encoder-decoder")
    text: Text | None = Field(None, min_length=1, description="the prompt's text (tokenised as /attention "
                              "tokenises a decoder's prompt; an encoder-decoder's source)")
    ids: list[int] | None = Field(None, min_length=1, description="the prompt's token ids as they are")
    answer: Text | None = Field(None, min_length=1, description=ANSWER_FIELD + "; default the top prediction")
    answer_id: int | None = Field(None, description="the answer token's id")
    foil: Text | None = Field(None, min_length=1, description=FOIL_FIELD + "; default the best other prediction")
    foil_id: int | None = Field(None, description="the foil token's id")
    target: Text | None = Field(None, min_length=1, description=TARGET_FIELD)
    target_ids: list[int] | None = Field(None, description=TARGET_IDS_FIELD)
    position: int | None = Field(None, ge=0, description="where the logits are read; default the last position (an "
                                 "encoder-decoder's: a target position, 0 the start token)")


# --- answers -------------------------------------------------------------------------------
class LayerValues(BaseModel):
    attention: list[list[float]] = Field(description="[L][T]: the attention output patched at one position")
    mlp: list[list[float]] = Field(description="[L][T]: the MLP output patched at one position")


class PathValues(BaseModel):
    q: list[list[float | None]] = Field(description="[L][H]: into the receiver's queries; null where the sender "
                                        "has no direct path (a decoder's: at layers up to the sender's)")
    k: list[list[float | None]] = Field(description="[L][H]: into its keys")
    v: list[list[float | None]] = Field(description="[L][H]: into its values")


class GroupPathValues(BaseModel):
    """An encoder-decoder's paths, by receiver group: an encoder sender reaches later encoder heads' q, k, v
    and every cross head's k, v (the memory); a decoder or cross sender later decoder heads' q, k, v and
    later cross heads' q (a decoder sender's own block's cross heads too)."""

    encoder: PathValues
    decoder: PathValues
    cross: PathValues


Grid = list[list[float]] | list[list[list[float]]]


class GroupValues(BaseModel):
    """An encoder-decoder's heads, heads_by_position or residual values, by group."""

    encoder: Grid = Field(description="the encoder's heads [L][H] (by position [L][S][H]); residual [L][S]")
    decoder: Grid = Field(description="the decoder's self-attention heads [L][H] (by position [L][T][H]); "
                          "residual [L][T]")
    cross: Grid | None = Field(None, description="cross-attention heads [L][H] (by position [L][T][H]); none for "
                               "residual")


class EncoderLayerValues(BaseModel):
    attention: list[list[float]] = Field(description="[L][S]: self-attention's output patched at a source position")
    mlp: list[list[float]] = Field(description="[L][S]")


class DecoderLayerValues(BaseModel):
    attention: list[list[float]] = Field(description="[L][T]: self-attention's output at a target position")
    cross: list[list[float]] = Field(description="[L][T]: cross-attention's output")
    mlp: list[list[float]] = Field(description="[L][T]")


class GroupLayerValues(BaseModel):
    """An encoder-decoder's layers values, by stack."""

    encoder: EncoderLayerValues
    decoder: DecoderLayerValues


PatchValues = (list[list[float]] | list[list[list[float]]] | LayerValues | PathValues | GroupValues | GroupLayerValues
               | GroupPathValues)


class PatchResponse(BaseModel):
    model: str
    component: Component
    method: Method
    position: int = Field(description="where the metric was read")
    clean_metric: float = Field(description="logit(answer) - logit(foil) of the clean prompt")
    corrupted_metric: float = Field(description="of the corrupted prompt")
    values: PatchValues = Field(description="each cell's patched metric, raw (normalise as (v - corrupted_metric) "
                                "/ (clean_metric - corrupted_metric)); heads [L][H], heads_by_position [L][T][H], "
                                "residual [L][T], layers {attention, mlp}, paths {q, k, v}; an encoder-decoder's "
                                "by group (the request's `component`)")
    sender: Sender | None = Field(None, description="paths: the sender head, its group named (a decoder's: self)")
    clean_tokens: list[TokenText] = Field(description="the clean prompt's (an encoder-decoder's source's) tokens")
    corrupted_tokens: list[TokenText]
    target_tokens: list[TokenText] | None = Field(None, description="an encoder-decoder's target, the decoder's "
                                                  "start token first: `position` indexes it; null for a decoder")
    differing: list[int] = Field(description="the positions where the prompts differ")
    answer: TokenText
    foil: TokenText


class CrossHeads(BaseModel):
    decoder: list[list[float]] = Field(description="[L][H]: each decoder self-attention head's direct write")
    cross: list[list[float]] = Field(description="[L][H]: each cross-attention head's")


class LogitAttributionResponse(BaseModel):
    model: str
    tokens: list[TokenText] = Field(description="the prompt's (an encoder-decoder's source's) tokens")
    target_tokens: list[TokenText] | None = Field(None, description="an encoder-decoder's target, the start token "
                                                  "first: `position` indexes it; null for a decoder")
    position: int = Field(description="where the logits were read")
    answer: TokenText
    foil: TokenText
    answer_logit: float
    foil_logit: float
    logit_difference: float = Field(description="logit(answer) - logit(foil), the model's own: what the parts sum to "
                                    "(before the soft-cap where `softcap` is set: answer_logit and foil_logit too)")
    softcap: float | None = Field(None, description="the model's final logit soft-cap (Gemma 2: cap * tanh(logit / cap)), "
                                  "no sum of parts: the parts sum to the logits before it; null without one")
    capped_logit_difference: float | None = Field(None, description="with `softcap`: the model's own output "
                                                  "difference, after the cap; null without one")
    heads: list[list[float]] | CrossHeads = Field(description="[L][H]: each head's direct write (an "
                                                  "encoder-decoder's {decoder, cross}: its encoder writes no logit "
                                                  "directly)")
    mlps: list[float] = Field(description="[L]: each (decoder) MLP's")
    embedding: float = Field(description="the token embedding's")
    other: float = Field(description="the rest: positions, the attention output and value biases, the final norm's "
                         "bias (a post-norm encoder-decoder's: every norm's on the way) and the head's")
    other_parts: dict[str, float] = Field(description="`other` by part")


class ScorePair(BaseModel):
    query_part: str = Field(description="the part of the query's residual stream")
    key_part: str = Field(description="the part of the key's residual stream")
    value: float = Field(description="its share of the score")


class ScoreParts(BaseModel):
    """Why the head attends from the query to `key`: its score split into pairs of what wrote the two
    residual streams (model/analysis/score_decomposition.py; an encoder-decoder's: encoder_decoder_scores.py,
    every norm's scale frozen)."""

    key: int
    score: float = Field(description="the head's scaled score q . k * scale from the query to the key (before the "
                         "soft-cap where `softcap` is set): what the pairs sum to")
    softcap: float | None = Field(None, description="the layer's attention soft-cap (Gemma 2: cap * tanh(score / cap)), "
                                  "no sum of pairs; null without one")
    capped_score: float | None = Field(None, description="with `softcap`: the capped score the softmax reads")
    probability: float = Field(description="its attention from the query to the key")
    parts: list[str] = Field(description="the query side's parts: embedding, positions, each earlier head (L3H1), "
                             "each earlier MLP (L3 MLP), biases; an encoder-decoder's named by group (encoder L0H1, "
                             "decoder L0H1, cross L0H1, decoder L0 MLP)")
    key_parts: list[str] = Field(description="the key side's parts: `parts` for a self-attention head; a cross "
                                 "head's the encoder's (its keys read the encoder's output)")
    top_pairs: list[ScorePair] = Field(description="the largest pairs by magnitude, largest first")
    query_totals: list[float] = Field(description="per part (in `parts`' order): its query side against the whole "
                                      "key")
    key_totals: list[float] = Field(description="per key part (in `key_parts`' order): its key side against the "
                                    "whole query")
    rest: float = Field(description="score minus the listed pairs")

"""Request and response bodies of the explain routes: POST /logits, POST /lens, POST /attention/explain.

Every request reads one sequence as /attention does: exactly one of `text` (tokenised; an
encoder's framed as [CLS] text [SEP]), `ids` (as they are) or `messages` (a chat model's
conversation through its template), and for an encoder-decoder a
`target` or `target_ids` (default: the unablated model's greedy translation). Positions are
those of the stream whose logits the family's head reads (model/families/contract.py, LensSpec):
a decoder's or encoder's tokens, an encoder-decoder's decoder inputs (`target_tokens`, the start
token first).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.config import JsonDict

from attnlens.app.api.causes_schemas import ScoreParts
from attnlens.app.api.common_schemas import MODEL_FIELD, Ablate, Ablation, Messages, ModelName, Strict, Text
from attnlens.app.api.generate_schemas import TokenText

ONE_OF_TEXT_OR_IDS: JsonDict = {"oneOf": [{"required": ["text"]}, {"required": ["ids"]}, {"required": ["messages"]}]}


class SequenceRequest(Strict):
    """Give exactly one of `text` (tokenised here), `ids` (used as they are) or `messages` (a
    conversation, rendered with a chat model's template, as /attention takes it)."""

    model_config = ConfigDict(**Strict.model_config, json_schema_extra=ONE_OF_TEXT_OR_IDS)

    model: ModelName | None = Field(None, description=MODEL_FIELD)
    text: Text | None = Field(None, min_length=1, description="text to tokenise (an encoder's is framed as "
                              "[CLS] text [SEP]); an encoder-decoder's source")
    ids: list[int] | None = Field(None, min_length=1, description="token ids as they are")
    messages: Messages | None = None
    target: Text | None = Field(None, min_length=1, description="encoder-decoder only: the target text; "
                                "without target or target_ids, the model's greedy translation (unablated)")
    target_ids: list[int] | None = Field(None, min_length=1, description="encoder-decoder only: the target's "
                                         "token ids (without the decoder's start token)")
    ablate: Ablate = None


class LogitsRequest(SequenceRequest):
    top_k: int = Field(5, ge=1, le=50, description="tokens per position, 1..50")
    positions: Literal["all", "last"] = Field("all", description="every position, or only the last")


class LensRequest(SequenceRequest):
    top_k: int = Field(5, ge=1, le=20, description="tokens per position and layer, 1..20")
    positions: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="the positions to read, in this order, each once (default: every "
        "position); only these are unembedded: the cost is (layers + 1) x positions rows through the head")
    rank: bool = Field(False, description="also the actual token's rank at every layer and position (one more "
                       "pass over the vocabulary per row)")

    @field_validator("positions")
    @classmethod
    def _each_once(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError("each position at most once")
        return v


class ExplainRequest(SequenceRequest):
    group: str | None = Field(None, description="the attention group (GET /models); default the family's first "
                              "(decoder, encoder: self; encoder-decoder: encoder)")
    layer: int = Field(description="0..n_layers-1")
    head: int = Field(description="0..n_heads-1")
    query: int = Field(description="the query position: a row of the group's map")
    key: int | None = Field(None, ge=0, description="a key position of a pre-norm decoder (0..query) or an "
                            "encoder-decoder (a decoder head's: 0..query on the target; an encoder or cross head's: a "
                            "source position): the answer also says why the head attends there (`score_parts`: its "
                            "score split into pairs of what wrote the query's and the key's streams); not with "
                            "`ablate`")


# --- answers -------------------------------------------------------------------------------
class TokenProb(TokenText):
    prob: float


class PositionLogits(BaseModel):
    position: int
    token: TokenText = Field(description="the token at this position")
    next: TokenText | None = Field(description="what this position's logits predict: the next token (null at the "
                                   "end), or for an encoder's masked-LM head the token at the position itself")
    top: list[TokenProb]
    next_prob: float | None
    next_logprob: float | None


class PositionEffect(BaseModel):
    position: int
    kl: float = Field(description="KL(clean || ablated) of this position's distribution, in nats")
    delta_logprob: float | None = Field(description="ablated - clean log-probability of `next`")


class ExplainAnswer(BaseModel):
    """Fields every explain answer shares."""

    model: str
    family: str
    predicts: Literal["next", "same"] = Field(description="next: a position's logits predict the next token (an "
                                              "LM head); same: the token at the position (an encoder's MLM head)")
    head: str = Field(description="what turns the residual stream into logits")
    tokens: list[TokenText] = Field(description="the sequence's tokens (an encoder-decoder's source)")
    target_tokens: list[TokenText] | None = Field(None, description="encoder-decoder only: the decoder's inputs, "
                                                  "the start token first: the positions scored")
    generated: bool | None = Field(None, description="encoder-decoder only: the target is the model's own greedy "
                                   "translation")
    ablate: list[Ablation] | None = Field(None, description="the request's ablations, groups resolved")


class LogitsResponse(ExplainAnswer):
    positions: list[PositionLogits] = Field(description="with `ablate`, the ablated model's")
    clean: list[PositionLogits] | None = Field(None, description="with `ablate`: the same positions without it")
    effect: list[PositionEffect] | None = Field(None, description="with `ablate`: per position, what it changed")


class LensActual(TokenText):
    rank: int | None = Field(description="0 = the most likely token at this layer; null unless the request "
                             "asked for `rank`")
    prob: float


class ExpertChoice(BaseModel):
    expert: int
    weight: float = Field(description="its share of the MLP's output (the router's probability, renormalised "
                          "over the chosen experts)")


class LensPosition(BaseModel):
    position: int = Field(description="the position in the stream (the request's `positions`, in order)")
    top: list[TokenProb]
    actual: LensActual | None = Field(description="the token the position predicts (see `predicts`); null at a "
                                      "decoder's last position")
    experts: list[ExpertChoice] | None = Field(default=None, description="a mixture of experts (Mixtral): the "
                                               "experts this block routed the position to, heaviest first; "
                                               "null for other models and the embeddings' row")


class LensLayer(BaseModel):
    index: int = Field(description="-1: the embeddings (block 0's input); l: after block l")
    label: str
    positions: list[LensPosition]


class LensResponse(ExplainAnswer):
    layers: list[LensLayer] = Field(description="the embeddings, then after every block, each through the final "
                                    "norm and the head; the last row is the model's own output")


class ExplainResponse(BaseModel):
    model: str
    family: str
    group: str
    layer: int
    head: int
    query: int
    query_token: TokenText
    key_tokens: list[TokenText]
    d_head: int
    scale: float = Field(description="what the model multiplies q.k by (its attention module's scale: 1/sqrt(d_head) "
                         "unless the model sets its own)")
    softcap: float | None = Field(default=None, description="Gemma 2's soft-cap: `scaled` is cap * tanh(scores * "
                                  "scale / cap); null without one")
    kv_head: int = Field(description="the key/value head this query head reads (grouped-query attention: "
                         "head // (n_heads / n_kv_heads); else the head itself)")
    positions: str = Field(description="how positions enter the computation")
    formula: str
    q: list[float] = Field(description="[d_head]: the query vector (rotated, for rotary positions)")
    keys: list[list[float]] = Field(description="[keys][d_head]")
    values: list[list[float]] = Field(description="[keys][d_head]")
    scores: list[float] = Field(description="q . k per key")
    scaled: list[float] = Field(description="scores * scale (soft-capped where `softcap` is given)")
    mask: list[bool] = Field(description="true = the query may attend to the key")
    masked: list[float | None] = Field(description="scaled, null where masked (-inf before the softmax)")
    softmax: list[float] = Field(description="softmax of masked: recomputed here")
    pattern_row: list[float] = Field(description="the map's row as the model computed it, for comparison")
    z: list[float] = Field(description="[d_head]: sum of softmax x values, the head's output at this query (before "
                           "the output projection and before any ablation of this head)")
    tokens: list[TokenText] = Field(description="the sequence's tokens (an encoder-decoder's source)")
    target_tokens: list[TokenText] | None = Field(None, description="encoder-decoder only: the decoder's inputs, "
                                                  "the start token first")
    generated: bool | None = Field(None, description="encoder-decoder only: the target is the model's own greedy "
                                   "translation")
    ablate: list[Ablation] | None = None
    score_parts: ScoreParts | None = Field(None, description="only when the request names a `key`: why the head "
                                           "attends from the query to it")

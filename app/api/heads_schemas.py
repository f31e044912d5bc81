"""Request and response bodies of POST /heads (the head atlas: per-head scores and roles)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from attnlens.app.api.common_schemas import MODEL_FIELD, ModelName, Strict, Text
from attnlens.app.api.generate_schemas import TokenText

MAX_PROBE_LENGTH = 65536  # the schema's bound; the model's context bounds it further (a 400 names probe.length)
MAX_PROBE_SEED = 2**32 - 1


class RepeatedRandomProbe(Strict):
    """BOS, then `length` random ordinary tokens (no special token), then the same `length` again."""

    kind: Literal["repeated_random"] = Field(description="the probe: 'repeated_random'")
    length: int | None = Field(None, ge=1, le=MAX_PROBE_LENGTH, description=(
        "n, the random tokens in each copy: the probe has 2n + 1 tokens (2n + 2 for a model that frames a "
        "text as [CLS] text [SEP]) and must fit the model's context; default min(50, the most that fit)"))
    seed: int = Field(0, ge=0, le=MAX_PROBE_SEED, description="the draw's seed: the same seed, the same tokens")


class HeadsRequest(Strict):
    """Give exactly one of `text` (tokenised, framed as /attention frames it), `ids` (as they are)
    or `probe` (the repeated-random sequence, built here)."""

    model_config = ConfigDict(**Strict.model_config, json_schema_extra={
        "oneOf": [{"required": ["text"]}, {"required": ["ids"]}, {"required": ["probe"]}]})

    model: ModelName | None = Field(None, description=MODEL_FIELD)
    text: Text | None = Field(None, min_length=1, description="text to tokenise and score")
    ids: list[int] | None = Field(None, min_length=1, description="token ids to score as they are")
    probe: RepeatedRandomProbe | None = Field(None, description="score the heads on a built-in probe instead")
    target: Text | None = Field(None, min_length=1, description="encoder-decoder only: the target text; without "
                                "target or target_ids, the model's greedy translation")
    target_ids: list[int] | None = Field(None, min_length=1, description="encoder-decoder only: the target's "
                                         "token ids as they are (without the decoder's start token)")


class HeadScores(BaseModel):
    layer: int
    head: int
    scores: dict[str, float | None] = Field(description="score name -> value (null: undefined for this input, "
                                            "e.g. a one-token sequence has no query rows 1..T-1)")
    role: str = Field(description="previous_token | next_token | duplicate_token | induction | first_token | self | "
                                  "broad | alignment | cls | sep | punctuation (an encoder's: Clark et al.'s scores) | "
                                  "mixed (nothing over its threshold)")
    role_score: float | None = Field(description="the score the role was given for (see definitions.role)")


class HeadGroup(BaseModel):
    name: str = Field(description="the family's attention group (GET /models): self, encoder, decoder or cross")
    causal: bool
    bidirectional: bool = Field(description="a self group whose queries see every key (an encoder)")
    rows: Literal["tokens", "target_tokens"] = Field(description="the answer field the query rows run over")
    columns: Literal["tokens", "target_tokens"] = Field(description="the answer field the key columns run over")
    heads: list[list[HeadScores]] = Field(description="[layer][head]")
    definitions: dict[str, str] = Field(description="score name -> its definition in this group")


class ProbeEcho(BaseModel):
    kind: Literal["repeated_random"]
    length: int
    seed: int


class HeadsResponse(BaseModel):
    model: str
    family: str
    tokens: list[TokenText] = Field(description="the query-side tokens of the first group (a source for an "
                                                "encoder-decoder)")
    target_tokens: list[TokenText] | None = Field(None, description="encoder-decoder: the decoder's start token, "
                                                  "then the target")
    generated_target: bool | None = Field(None, description="encoder-decoder: the target is the model's own "
                                                            "greedy translation")
    probe: ProbeEcho | None = None
    groups: list[HeadGroup]
    heads: list[list[HeadScores]] = Field(description="groups[0].heads: heads[layer][head]")
    thresholds: dict[str, float] = Field(description="role -> the threshold its score had to reach")
    definitions: dict[str, str] = Field(description="score name (and 'role') -> one line; where the family's "
                                                    "groups define a score differently, each group's is named")
    notes: list[str] = Field(default_factory=list, description="how the input was built (the probe's framing)")
    clark_sentences: list[str] | None = Field(None, description="an encoder: the fixed English sentences its "
                                              "clark_* scores (Clark et al. 2019) average over, each framed "
                                              "[CLS] sentence [SEP]; the same whatever the input")

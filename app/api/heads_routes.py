"""POST /heads: the head atlas. Every head of every attention group the model's family declares,
scored on a text, on token ids, or on the built-in repeated-random probe, with a role per head
(app/serving/head_atlas.py; the serving side app/serving/heads_serving.py; the definitions are
model/analysis/head_scores.py's)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from attnlens.app.api.deps import HeadsModel, StateDep
from attnlens.app.api.heads_schemas import HeadsResponse
from attnlens.app.serving.heads_serving import HeadsServing

router = APIRouter(tags=["heads"])


@router.post(
    "/heads",
    response_model=HeadsResponse,
    responses={400: {"description": "text, ids or the probe longer than the model's context, or its attention "
                                    "maps larger than ATTNLENS_MAX_ANSWER_BYTES (the message gives the numbers)"},
               404: {"description": "unknown model"}, 413: {},
               429: {"description": "too many model calls running or waiting (ATTNLENS_MAX_ATTENTION_CONCURRENT; "
                                    "for a model that does not generate ATTNLENS_MAX_ENCODER_CONCURRENT + "
                                    "ATTNLENS_MAX_QUEUE), or maps in flight over ATTNLENS_MAX_ANSWER_BYTES for "
                                    "ATTNLENS_ANSWER_WAIT_S; see Retry-After"}, 503: {}},
)
async def heads(asked: HeadsModel, request: Request, state: StateDep):
    """Per-head scores and roles of every attention group, on `text`, `ids` or `probe` (exactly one).

    Scores come from the attention maps /attention shows. previous_token, duplicate_token and
    induction are TransformerLens's head detector ("mul", no exclusions) on a causal group, their
    bidirectional analogues (and next_token) on an encoder's; every self group also has
    first_token, self, entropy and mean_distance; a cross group alignment, first_token and
    entropy. An encoder's heads also get Clark et al.'s (2019) scores, clark_cls, clark_sep,
    clark_punctuation, clark_previous, clark_next and clark_entropy (nats), on fixed English
    sentences (`clark_sentences`) whatever the input, and the roles cls, sep and punctuation.
    `definitions` says each in one line and `thresholds` which score a role needed.
    The probe {"kind": "repeated_random", "length": n, "seed": s} is BOS + n random tokens + the
    same n, where an induction head shows (about 0.5 at most on a causal model).
    """
    return await HeadsServing(state).heads(asked.body, asked.served, request)

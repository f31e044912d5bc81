"""POST /logits, POST /lens, POST /attention/explain: what a model predicts at each position (with
and without ablated heads), the logit lens, and one head's attention step by step. Thin: the
serving side is app/serving/explain_serving.py (ExplainServing), the schemas app/api/explain_schemas.py.
A client that goes away stops its model call (and its place in the model's line)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from attnlens.app.api.deps import ExplainModel, LensModel, LogitsModel, StateDep
from attnlens.app.api.explain_schemas import (
    ExplainResponse,
    LensResponse,
    LogitsResponse,
)
from attnlens.app.serving.explain_serving import ExplainServing

router = APIRouter(tags=["explain"])

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "text or ids longer than the context, a bad ablation (param `ablate`), layer, head, "
                         "group or query out of range (the param says which)"},
    404: {"description": "unknown model"}, 413: {},
    429: {"description": "too many model calls or answers in flight; see Retry-After"},
    503: {},
}


@router.post("/logits", response_model=LogitsResponse, responses=ERRORS)
async def logits(asked: LogitsModel, request: Request, state: StateDep):
    """At every position (or only the last), the top-k tokens the model predicts there with their
    probabilities, and the probability of the token that actually comes next (an encoder's masked-LM
    head predicts the token at the position itself: `predicts`). With `ablate`, the ablated model's
    answer, the clean one (`clean`) and per position the KL divergence and the change in log-probability
    of the actual token (`effect`)."""
    return await ExplainServing(state).logits(asked.body, asked.served, request)


@router.post("/lens", response_model=LensResponse, responses=ERRORS)
async def lens(asked: LensModel, request: Request, state: StateDep):
    """The logit lens: the residual stream at the embeddings and after every block, at every position,
    through the final norm and the head (an encoder's masked-LM head; an encoder-decoder's decoder
    stream): the top-k tokens and the rank and probability of the actual token."""
    return await ExplainServing(state).lens(asked.body, asked.served, request)


@router.post("/attention/explain", response_model=ExplainResponse, responses=ERRORS)
async def attention_explain(asked: ExplainModel, request: Request, state: StateDep):
    """One head's attention at one query, step by step: the query and every key and value vector,
    q.k, the 1/sqrt(d_head) scale, the mask, the softmax (beside the map's own row) and the weighted
    sum of the values, the head's z."""
    return await ExplainServing(state).explain_head(asked.body, asked.served, request)

"""POST /patch and POST /logit-attribution: which components of a decoder (or of an encoder-decoder:
its encoder, decoder and cross heads) carry a behaviour, by
activation patching (exact, or attribution patching's first-order estimates) between a clean and a
corrupted prompt, and by each part's direct write into a logit difference. Thin: the serving side is
app/serving/causes_serving.py (CausesServing), the schemas app/api/causes_schemas.py."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from attnlens.app.api.causes_schemas import LogitAttributionResponse, PatchResponse
from attnlens.app.api.deps import LogitAttributionModel, PatchModel, StateDep
from attnlens.app.serving.causes_serving import CausesServing

router = APIRouter(tags=["causes"])

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "a model that is neither a (pre-norm) decoder nor an encoder-decoder (param `model`); "
                         "prompts of different lengths (`corrupted`), an answer or foil that is not one token, a "
                         "position, sender, a target given to a decoder, paths asked of an encoder-decoder, a prompt "
                         "over the context or over ATTNLENS_MAX_PATCH_TOKENS, an answer larger than "
                         "ATTNLENS_MAX_ANSWER_BYTES (the param says which)"},
    404: {"description": "unknown model"}, 413: {},
    429: {"description": "too many model calls or answers in flight; see Retry-After"},
    503: {},
}


@router.post("/patch", response_model=PatchResponse, responses=ERRORS)
async def patch(asked: PatchModel, request: Request, state: StateDep):
    """Activation patching: each cell of `component` (heads, heads_by_position, residual, layers, or the
    paths from `sender`) patched from the `clean` prompt's run into the `corrupted` one's, and the
    metric logit(answer) - logit(foil) at `position` (default the last) of each patched run. `method`
    attribution gives every cell's first-order estimate from one forward pair and one backward instead.
    The prompts have the same number of tokens; `differing` lists where they differ. An encoder-decoder's
    prompts are two sources read with one `target`; its metric is at a target position and its values
    come by group (encoder, decoder and cross heads). A client that goes away stops the call."""
    return await CausesServing(state).patch(asked.body, asked.served, request)


@router.post("/logit-attribution", response_model=LogitAttributionResponse, responses=ERRORS)
async def logit_attribution(asked: LogitAttributionModel, request: Request, state: StateDep):
    """Direct logit attribution: how much each head, each MLP, the token embedding and the rest write
    directly into logit(answer) - logit(foil) at `position` (default the last; answer and foil default to
    the top two predictions there), through the final norm at its scale there. The parts sum to
    `logit_difference`. An encoder-decoder's `text` is its source, read with a `target`: its decoder and
    cross heads' direct writes along its decoder's stream (post-norm: every norm's scale frozen)."""
    return await CausesServing(state).logit_attribution(asked.body, asked.served, request)

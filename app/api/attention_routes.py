"""POST /attention: every attention map of a text (or of given token ids), as JSON or packed f16 / u8.

What the answer holds follows the model's family declaration (model/families/contract.py): its
attention groups and their axes, how it frames a text, whether it reads a target (the layout is in
app/serving/attention_serving.py, its serving side)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from attnlens.app.api.attention_schemas import AttentionResponse
from attnlens.app.api.deps import AttentionModel, StateDep
from attnlens.app.serving.attention_serving import AttentionServing

router = APIRouter(tags=["attention"])


@router.post(
    "/attention",
    response_model=AttentionResponse,
    responses={400: {"description": "text or ids longer than the context, or an answer larger than "
                                    "ATTNLENS_MAX_ANSWER_BYTES (the message gives the numbers)"},
               404: {"description": "unknown model"}, 413: {},
               429: {"description": "too many attention requests, or answers in flight over "
                                    "ATTNLENS_MAX_ANSWER_BYTES for ATTNLENS_ANSWER_WAIT_S; see Retry-After"},
               503: {}},
)
async def attention(asked: AttentionModel, request: Request, state: StateDep):
    """Attention maps of `text`, of token `ids` as they are, or of a conversation (`messages`,
    rendered with a chat model's template: the maps show the template's tokens); exactly one.

    A decoder's maps are causal (zero above the diagonal). An encoder's are bidirectional,
    full T x T, and its `text` is framed as [CLS] text [SEP] (`ids` are used as they are).
    An encoder-decoder's `text` / `ids` are the source: the encoder's maps are at the top level,
    the decoder's and the cross maps under `translation`, for `target` / `target_ids` or the
    model's own greedy translation. GET /models gives each model's groups and their axes.

    Long inputs: `pool` gives an N x N overview of each map, `top_k` each row's strongest links,
    `rows` / `cols` a window at full resolution. Maps are made a block of query rows at a time and
    reduced at once, so a request's memory follows its answer, not T x T.
    """
    return await AttentionServing(state).attention(asked.body, asked.served, request)

"""POST /attention: every attention map of a text (or of given token ids), as JSON or packed f16 / u8.

What the answer holds follows the model's family declaration (model/families/contract.py): its
attention groups and their axes, how it frames a text, whether it reads a target (the layout is in
app/attention_analysis.py)."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Depends, Request

from ..answers import claimed_json
from ..attention_analysis import MapRequest, analyse_attention, answer_bytes, answer_fields, smaller_answer
from ..deps import get_state
from ..errors import ApiError, field_error
from ..explain.ablation import resolve_ablate
from ..registry import ATTENTION, ServedModel, lookup
from ..schemas import AttentionRequest, AttentionResponse
from ..sequences import read_sequence
from ..serving import unless_disconnected
from ..state import AppState

router = APIRouter(tags=["attention"])


def _indices(name: str, requested: list[int] | None, n: int) -> list[int]:
    if requested is None:
        return list(range(n))
    bad = [i for i in requested if not 0 <= i < n]
    if bad:
        raise field_error(name, f"index {bad[0]} out of range: the model has {n} {name} (0..{n - 1})",
                          "out_of_range")
    if len(set(requested)) != len(requested):
        raise field_error(name, "indices must not repeat", "duplicate")
    return list(requested)


def _map_request(body, family, lengths: dict[str, int]) -> MapRequest:
    """The request's pool / top_k / rows / cols; a window must start within the primary group's axis."""
    if body.pool is not None and body.top_k is not None:
        raise field_error("top_k", "give pool (an overview) or top_k (each row's strongest keys), not both",
                          "exclusive")
    primary = family.primary
    for name, axis in (("rows", primary.queries), ("cols", primary.keys)):
        window = getattr(body, name)
        if window is not None and window[0] >= lengths[axis]:
            raise ApiError(400, f"{name} starts at {window[0]}, past the last of the {lengths[axis]} positions "
                                f"of the maps' {axis}", param=name, code="out_of_range")
    return MapRequest(pool=body.pool, top_k=body.top_k, rows=None if body.rows is None else tuple(body.rows),
                      cols=None if body.cols is None else tuple(body.cols))


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
async def attention(body: AttentionRequest, request: Request, state: AppState = Depends(get_state)):
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
    served = lookup(state, body.model, ATTENTION)
    family, cfg, tok = served.family, served.checkpoint.config, served.checkpoint.tokenizer
    if body.packing == "tril" and not family.has_causal_group:
        raise field_error("packing", f"'tril' keeps only the lower triangle, but this model's attention is "
                                     f"{family.attention_kind} (full maps): use packing='full'", "unsupported")
    layers = _indices("layers", body.layers, cfg.n_layers)
    heads = _indices("heads", body.heads, cfg.n_heads)
    edits, echo = resolve_ablate(served, body.ablate, state.settings)
    ids, target = await read_sequence(body, served, state)
    # the target's rows: start + target, or at most the context for the model's own output
    lengths = {"tokens": len(ids), "source": len(ids),
               "target": cfg.context_length if target is None else len(target) + 1}
    want = _map_request(body, family, lengths)
    # held from before the forward until the answer's last byte is sent: bounded memory
    claim = await state.answers.claim(answer_bytes(family, lengths, len(layers), len(heads), body.format, body.packing,
                                                   want), what="this answer", instead=smaller_answer(
        family, lengths, len(layers), len(heads), body.format, body.packing, want, state.answers.limit))
    try:
        analysis = await unless_disconnected(request, served.call_model(partial(
            analyse_attention, ids=ids, layers=layers, heads=heads, target_ids=target, ablate=edits, want=want,
            fmt=body.format, keep_bytes=state.settings.attention_keep_bytes)))
    except BaseException:
        await claim.release()
        raise

    def content() -> dict:  # runs on a worker thread, as does its encoding
        return {"model": served.name, "family": family.name, "direction": family.attention_kind,
                "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "layers": layers, "heads": heads,
                "format": body.format, **answer_fields(family, analysis, tok, body.format, body.packing, want),
                **({"ablate": [a.model_dump() for a in echo]} if echo is not None else {})}

    # Already the documented shape: no re-validating millions of floats.
    return await claimed_json(content, claim, state.settings.send_timeout_s)

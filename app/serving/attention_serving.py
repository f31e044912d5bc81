"""POST /attention's serving side (app/api/attention_routes.py is the thin router): the request read
and checked against the model (its layers, heads, packing, window, ablations), its answer's bytes
claimed, one AttentionCall on the model's side (model/analysis/attention_maps.py), the answer laid
out by the family (app/serving/attention_answer.py) and encoded as asked."""

from __future__ import annotations

from fastapi import Request

from attnlens.app.api.attention_schemas import AttentionRequest
from attnlens.app.registry.model_registry import ATTENTION, lookup
from attnlens.app.server.api_errors import ApiError, field_error
from attnlens.app.server.state import AppState
from attnlens.app.serving.ablation_edits import resolve_ablate
from attnlens.app.serving.answer_budget import answer_with_claim
from attnlens.app.serving.attention_answer import answer_bytes, answer_fields, smaller_answer
from attnlens.app.serving.sequences import read_sequence
from attnlens.model.analysis.attention_maps import MapRequest
from attnlens.model.analysis.operations import AttentionCall


def checked_indices(name: str, requested: list[int] | None, n: int) -> list[int]:
    """The asked layers or heads (default: all), each in range and none twice (a 400 naming `name`)."""
    if requested is None:
        return list(range(n))
    bad = [i for i in requested if not 0 <= i < n]
    if bad:
        raise field_error(name, f"index {bad[0]} out of range: the model has {n} {name} (0..{n - 1})",
                          "out_of_range")
    if len(set(requested)) != len(requested):
        raise field_error(name, "indices must not repeat", "duplicate")
    return list(requested)


def map_request(body, family, lengths: dict[str, int]) -> MapRequest:
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


class AttentionServing:
    """Answers POST /attention for the models in `state`."""

    def __init__(self, state: AppState):
        self.state = state

    async def attention(self, body: AttentionRequest, request: Request):
        state = self.state
        served = lookup(state, body.model, ATTENTION)
        family, cfg, tok = served.family, served.checkpoint.config, served.checkpoint.tokenizer
        if body.packing == "tril" and not family.has_causal_group:
            raise field_error("packing", f"'tril' keeps only the lower triangle, but this model's attention is "
                                         f"{family.attention_kind} (full maps): use packing='full'", "unsupported")
        layers = checked_indices("layers", body.layers, cfg.n_layers)
        heads = checked_indices("heads", body.heads, cfg.n_heads)
        edits, echo = resolve_ablate(served, body.ablate, state.settings)
        ids, target = await read_sequence(body, served, state)
        # the target's rows: start + target, or at most the context for the model's own output
        lengths = {"tokens": len(ids), "source": len(ids),
                   "target": cfg.context_length if target is None else len(target) + 1}
        want = map_request(body, family, lengths)
        call = AttentionCall(ids=ids, layers=layers, heads=heads, target_ids=target, ablate=edits, want=want,
                             fmt=body.format, keep_bytes=state.settings.attention_keep_bytes)

        def content(analysis) -> dict:  # runs on a worker thread, as does its encoding
            return {"model": served.name, "family": family.name, "direction": family.attention_kind,
                    "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "layers": layers, "heads": heads,
                    "format": body.format, **answer_fields(family, analysis, tok, body.format, body.packing, want),
                    **({"ablate": [a.model_dump() for a in echo]} if echo is not None else {})}

        # held from before the forward until the answer's last byte is sent: bounded memory.
        # Already the documented shape: no re-validating millions of floats.
        return await answer_with_claim(
            state, served, call, content, request=request, what="this answer",
            need=answer_bytes(family, lengths, len(layers), len(heads), body.format, body.packing, want),
            instead=smaller_answer(family, lengths, len(layers), len(heads), body.format, body.packing, want,
                                   state.answers.limit))

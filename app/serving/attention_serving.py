"""POST /attention's serving side (app/api/attention_routes.py is the thin router): the request read
and checked against the model (its layers, heads, packing, window, ablations), its answer's bytes
claimed, one AttentionCall on the model's side (model/analysis/attention_maps.py: MapRequest,
analyse_attention), and the answer laid out by the family's declaration (model/families/contract.py)
and encoded as asked.

    answer_bytes        the answer's size, before anything is computed (what it claims of the budget)
    smaller_answer      what to ask instead when it would not fit
    answer_fields       on a worker thread: the answer's fields, encoded as asked
    AttentionServing    the route's one method: check, claim, call, lay out, send

The answer's layout: `groups` lists the family's attention groups as it declares them (name,
query axis, key axis, causal), the primary one first. The primary group's maps are at the top
level, over the tokens of its query axis (`tokens`); a family that reads a target (an
encoder-decoder) has its other groups under `translation` by name, with the target's tokens (the
decoder's start token first) and whether the target is the model's own greedy output. Each group
states the window it covers (`rows`, `cols`), a pooled one its bins (`row_edges`, `col_edges`),
a top-k one its keys (`positions`). Packing "tril" applies to causal groups' whole maps; every
other map is sent full.
"""

from __future__ import annotations

from fastapi import Request

from attnlens.app.api.attention_schemas import AttentionRequest
from attnlens.app.registry.model_registry import ServedModel
from attnlens.app.server.api_errors import ApiError, field_error
from attnlens.app.server.state import AppState
from attnlens.app.serving.ablation_edits import NOTHING_ABLATED, resolve_ablate
from attnlens.app.serving.answer_budget import answer_with_claim
from attnlens.app.serving.attention_codec import encode, encode_positions
from attnlens.app.serving.prompts import read_sequence
from attnlens.model import Family
from attnlens.model.analysis.attention_maps import AnalysisMaps, MapRequest
from attnlens.model.analysis.operations import AttentionCall


def whole_maps(want: MapRequest) -> bool:
    """Every cell of every map is asked: the only answer `packing` "tril" applies to."""
    return want.pool is None and want.top_k is None and want.rows is None and want.cols is None


def asked_window(want: MapRequest, n_queries: int, n_keys: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(rows, cols) of a group with these axes' lengths: the asked window clipped to them, as the
    model's reductions clip it (MapRequest.window), sized here before the model is called."""
    clip = lambda w, n: (0, n) if w is None else (min(w[0], n), min(w[1], n))
    return clip(want.rows, n_queries), clip(want.cols, n_keys)


def packing_of(family: Family, group: str, packing: str, want: MapRequest = MapRequest()) -> str:
    """"tril" only for a causal group's whole maps; everything else is sent full."""
    return packing if family.groups_by_name[group].causal and whole_maps(want) else "full"


def answer_bytes(family: Family, axis_lengths: dict[str, int], n_layers: int, n_heads: int, fmt: str,
                 packing: str, want: MapRequest = MapRequest()) -> float:
    """An upper bound on the answer's bytes, every group counted (what an answer claims): the maps as
    kept (float32 for json, the wire's type otherwise; pooled and top-k ones float32), their encoding,
    and the tokens."""
    mats = n_layers * n_heads
    per_cell = {"json": 10.0, "f16": 2 + 8 / 3, "u8": 1 + 4 / 3}[fmt]  # text, or raw + base64
    kept = {"json": 4, "f16": 2, "u8": 1}[fmt]
    total: float = 4096
    for g in family.groups:
        Q, K = axis_lengths[g.queries], axis_lengths[g.keys]
        (a, b), (c, d) = asked_window(want, Q, K)
        R, C = b - a, d - c
        total += (Q + K) * 64 + mats * R * 2
        if want.pool is not None:
            total += mats * min(want.pool, R) * min(want.pool, C) * (4 + per_cell) + 2 * want.pool * 12
        elif want.top_k is not None:
            positions = 8.0 if fmt == "json" else 4 + 16 / 3  # text, or int32 + base64
            total += mats * R * min(want.top_k, C) * (4 + per_cell + 4 + positions)
        else:
            sent = R * (R + 1) // 2 if packing_of(family, g.name, packing, want) == "tril" else R * C
            total += mats * (R * C * kept + sent * per_cell)
    return total


def smaller_answer(family: Family, axis_lengths: dict[str, int], n_layers: int, n_heads: int, fmt: str,
                   packing: str, want: MapRequest, limit: int) -> str:
    """What to ask for instead when an answer would pass `limit` bytes: a pool that fits, if one does."""
    for bins in (1024, 512, 256, 128, 64, 32, 16):
        pooled = MapRequest(pool=bins, rows=want.rows, cols=want.cols)
        if (want.pool is None or bins < want.pool) and \
                answer_bytes(family, axis_lengths, n_layers, n_heads, fmt, packing, pooled) <= limit:
            return f"use pool: {bins}, or top_k, a window (rows, cols), or fewer layers or heads"
    return "ask for fewer layers or heads"


def answer_fields(family: Family, analysis: AnalysisMaps, tokenizer, fmt: str, packing: str,
                  want: MapRequest = MapRequest()) -> dict:
    """The answer's attention fields for this family's groups (see the module docstring)."""
    token_list = lambda ids: [{"id": i, "text": tokenizer.display_text(i)} for i in ids]

    def group_fields(name: str) -> dict:
        extras = dict(analysis.extras.get(name, {}))
        positions = extras.pop("positions", None)
        return {**encode(analysis.maps[name], fmt, packing_of(family, name, packing, want)), **extras,
                **(encode_positions(positions, fmt) if positions is not None else {})}

    primary = family.primary
    fields = {"groups": [{"name": g.name, "queries": g.queries, "keys": g.keys, "causal": g.causal}
                         for g in family.groups],
              "tokens": token_list(analysis.tokens[primary.queries]),
              **group_fields(primary.name)}
    if family.takes_target:
        fields["translation"] = {
            "target_tokens": token_list(analysis.tokens["target"]),
            "generated": analysis.generated_target,
            **{g.name: group_fields(g.name) for g in family.groups[1:]},
        }
    return fields


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

    async def attention(self, body: AttentionRequest, served: ServedModel, request: Request):
        state = self.state
        family, cfg, tok = served.family, served.checkpoint.config, served.checkpoint.tokenizer
        if body.packing == "tril" and not family.has_causal_group:
            raise field_error("packing", f"'tril' keeps only the lower triangle, but this model's attention is "
                                         f"{family.attention_kind} (full maps): use packing='full'", "unsupported")
        layers = checked_indices("layers", body.layers, cfg.n_layers)
        heads = checked_indices("heads", body.heads, cfg.n_heads)
        # most requests ablate nothing: only those that do are resolved against the model
        edits, echo = NOTHING_ABLATED if body.ablate is None else resolve_ablate(served, body.ablate, state.settings)
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

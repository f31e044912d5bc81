"""/attention's answer for any family: its declared attention groups, computed on the model's side in
one model call (model/analysis/attention_maps.py: MapRequest, analyse_attention) and laid out here
by the declaration (model/families/contract.py).

    answer_bytes        the answer's size, before anything is computed (what it claims of the budget)
    smaller_answer      what to ask instead when it would not fit
    answer_fields       on a worker thread: the answer's fields, encoded as asked

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

from attnlens.app.serving.attention_codec import encode, encode_positions
from attnlens.model import Family
from attnlens.model.analysis.attention_maps import AnalysisMaps, MapRequest


def packing_of(family: Family, group: str, packing: str, want: MapRequest = MapRequest()) -> str:
    """"tril" only for a causal group's whole maps; everything else is sent full."""
    return packing if family.group(group).causal and want.whole else "full"


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
        (a, b), (c, d) = want.window(Q, K)
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

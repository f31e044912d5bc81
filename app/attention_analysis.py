"""/attention for any family: its declared attention groups, computed in one model call and laid
out by the declaration (model/families/contract.py).

    MapRequest          what each map becomes: whole, a window (rows, cols), pooled, or top-k
    analyse_attention   on the model's side (the engine's line or a worker thread): the asked layers
                        and heads of every group, made in blocks of query rows and reduced at once
                        (model/attention_blocks.py), as numpy
    answer_bytes        the answer's size, before anything is computed (what it claims of the budget)
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

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from attnlens.model import Family, family_of
from attnlens.model.attention_blocks import KeptQK, Pool, Reduction, TopK, Window, blocked_maps

from .attention_codec import U8_SCALE, encode, encode_positions
from .engine import progress


@dataclass(frozen=True)
class MapRequest:
    """What each asked map becomes (the request's `pool`, `top_k`, `rows`, `cols`): a window of query
    rows [a, b) and key columns [c, d) (default: all), at full resolution, pooled to a grid of
    `pool` x `pool` bins, or as each row's `top_k` heaviest keys. A window is clipped to each
    group's own axes (an encoder-decoder's groups run over the source and the target)."""

    pool: int | None = None
    top_k: int | None = None
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None

    @property
    def whole(self) -> bool:
        """Every cell of every map: the only answer `packing` "tril" applies to."""
        return self.pool is None and self.top_k is None and self.rows is None and self.cols is None

    def window(self, n_queries: int, n_keys: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(rows, cols) of a group with these axes' lengths: the asked window clipped to them."""
        clip = lambda w, n: (0, n) if w is None else (min(w[0], n), min(w[1], n))
        return clip(self.rows, n_queries), clip(self.cols, n_keys)

    def reduction(self, n_layers: int, n_heads: int, n_queries: int, n_keys: int, fmt: str) -> Reduction:
        rows, cols = self.window(n_queries, n_keys)
        if self.pool is not None:
            return Pool(n_layers, n_heads, rows, cols, self.pool)
        if self.top_k is not None:
            return TopK(n_layers, n_heads, rows, cols, self.top_k)
        store = {"json": torch.float32, "f16": torch.float16, "u8": torch.uint8}[fmt]
        return Window(n_layers, n_heads, rows, cols, store, U8_SCALE)


@dataclass
class AnalysisMaps:
    tokens: dict[str, list[int]]  # axis -> ids
    maps: dict[str, np.ndarray]  # group -> (L', H', rows, cols): float32, or the wire's float16 / uint8 steps
    generated_target: bool = False
    # group -> what else its answer states: rows, cols (the window covered); row_edges, col_edges
    # (pool); positions (top_k)
    extras: dict[str, dict] = field(default_factory=dict)


_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> KeptQK (in the process that runs it)


def kept_for(model, limit: int) -> KeptQK | None:
    """The model's store of recently analysed queries and keys, `limit` bytes (0: none)."""
    if limit <= 0:
        return None
    kept = _kept.get(model)
    if kept is None or kept.limit != limit:
        kept = _kept[model] = KeptQK(limit)
    return kept


def analyse_attention(model, ids: list[int], layers: list[int], heads: list[int],
                      target_ids: list[int] | None = None, ablate: tuple = (), want: MapRequest = MapRequest(),
                      fmt: str = "json", keep_bytes: int = 0) -> AnalysisMaps:
    """Runs on the model's side: the asked layers' and heads' maps of every group, made in blocks of
    query rows and reduced as `want` asks (model/attention_blocks.py); with `ablate`, model/hooks.py's
    ZEdits, those of the ablated model (a default target is still the unablated model's output).
    A whole map is kept in `fmt`'s type (float32 for json, float16, uint8 steps): no float32 copy of
    a long map is ever held for a smaller answer. `keep_bytes`: the queries and keys kept of recent
    sequences (kept_for), so another window of a layer already analysed runs no forward."""
    tokens, generated = model.sequence(ids, target_ids)  # the clean translation, before any edit
    family = family_of(model)
    reductions = {g.name: want.reduction(len(layers), len(heads), len(tokens[g.queries]), len(tokens[g.keys]), fmt)
                  for g in family.groups}
    blocked_maps(model, tokens, layers, heads, reductions, ablate, progress=progress.report,
                 kept=kept_for(model, keep_bytes))
    maps, extras = {}, {}
    for name, reduction in reductions.items():
        result = reduction.result()
        maps[name] = result.pop("maps").numpy()
        extras[name] = {"rows": list(reduction.rows), "cols": list(reduction.cols),
                        **{k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in result.items()}}
    return AnalysisMaps(tokens, maps, generated, extras)


def attention_maps(model, ids: list[int], layers: list[int], heads: list[int]) -> np.ndarray:
    """The primary group's (L', H', T, T) maps of one sequence (a decoder's or an encoder's)."""
    return analyse_attention(model, ids, layers, heads).maps[family_of(model).primary.name]


def packing_of(family: Family, group: str, packing: str, want: MapRequest = MapRequest()) -> str:
    """"tril" only for a causal group's whole maps; everything else is sent full."""
    return packing if family.group(group).causal and want.whole else "full"


def answer_bytes(family: Family, axis_lengths: dict[str, int], n_layers: int, n_heads: int, fmt: str,
                 packing: str, want: MapRequest = MapRequest()) -> int:
    """An upper bound on the answer's bytes, every group counted (what an answer claims): the maps as
    kept (float32 for json, the wire's type otherwise; pooled and top-k ones float32), their encoding,
    and the tokens."""
    mats = n_layers * n_heads
    per_cell = {"json": 10.0, "f16": 2 + 8 / 3, "u8": 1 + 4 / 3}[fmt]  # text, or raw + base64
    kept = {"json": 4, "f16": 2, "u8": 1}[fmt]
    total = 4096
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

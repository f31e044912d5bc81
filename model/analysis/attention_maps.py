"""/attention's maps on the model's side: the asked layers and heads of every attention group a
family declares (model/families/contract.py), computed in one model call, each map reduced as the
request asks (model/analysis/attention_blocks.py), as numpy.

    MapRequest          what each map becomes: whole, a window (rows, cols), pooled, or top-k
    AnalysisMaps        the result: the axes' token ids and every group's maps and extras
    kept_for            the model's store of recently analysed queries and keys (a zoom's)
    analyse_attention   the maps of one sequence, made in blocks of query rows and reduced at once
    attention_maps      the primary group's (L', H', T, T) maps of one sequence

The answer's size, layout and encoding are the service's (app/serving/attention_serving.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from attnlens.codec import U8_SCALE  # the wire's uint8 step: a whole u8 map is kept in it
from attnlens.model.analysis.attention_blocks import KeptQK, Pool, Reduction, TopK, Window, blocked_maps
from attnlens.model.families.contract import family_of


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
                      fmt: str = "json", keep_bytes: int = 0,
                      report: Callable[[], None] | None = None) -> AnalysisMaps:
    """The asked layers' and heads' maps of every group, made in blocks of query rows and reduced as
    `want` asks (model/analysis/attention_blocks.py); with `ablate`, model/hooks.py's ZEdits, those
    of the ablated model (a default target is still the unablated model's output).
    A whole map is kept in `fmt`'s type (float32 for json, float16, uint8 steps): no float32 copy of
    a long map is ever held for a smaller answer. `keep_bytes`: the queries and keys kept of recent
    sequences (kept_for), so another window of a layer already analysed runs no forward. `report`
    is called at each progress point (the engine's heartbeat, and where a call is stopped)."""
    tokens, generated = model.sequence(ids, target_ids)  # the clean translation, before any edit
    family = family_of(model)
    reductions = {g.name: want.reduction(len(layers), len(heads), len(tokens[g.queries]), len(tokens[g.keys]), fmt)
                  for g in family.groups}
    blocked_maps(model, tokens, layers, heads, reductions, ablate, progress=report,
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

"""/attention's maps on the model's side: the asked layers and heads of every attention group a
family declares (model/families/contract.py), computed in one model call, each map reduced as the
request asks, as numpy. A request's memory grows with T x block, never T x T: the maps are made a
block of query rows at a time, each block reduced at once.

Shapes: L' asked layers, H' asked heads, Q query positions and S key positions of a group, B rows
of a block, n the keys a block's rows can see (a causal block's rows see keys up to their own).

    MapRequest          what each map becomes: whole, a window (rows, cols), pooled, or top-k
    AnalysisMaps        the result: the axes' token ids and every group's maps and extras
    analyse_attention   the maps of one sequence, made in blocks of query rows and reduced at once
    attention_maps      the primary group's (L', H', T, T) maps of one sequence

The reductions and how the maps are made:

    bin_edges(n, bins)      bins + 1 contiguous, near-equal bin edges from 0 to n
    Window                  rows [a, b) x columns [c, d) of each map at full resolution (the whole
                            map by default), kept as float32, float16 or uint8 steps of a scale
    Pool                    each map as a grid of bins: cell (i, j) is the mean, over the queries in
                            row bin i, of the attention they give to the keys in column bin j
    TopK                    each query row's k heaviest keys (in the column window): positions
                            and weights, heaviest first; a weight of 0 is no link (position -1)
    blocked_maps            one forward of the sequence; a layer whose attention runs on our C
                            kernel (a causal prompt on the CPU) has its reduction made by the
                            kernel from the forward's own scores (model/parts/causal_attention.py's
                            Emit); any other is made from its queries and keys (hook points), per
                            block of query rows: the asked heads' probabilities, masked as the
                            forward masks them, fed to the group's reduction and dropped
    KeptQK, kept_for        the queries and keys of recently analysed sequences, within a byte
                            budget: another window of a layer already analysed (a zoom) is made
                            from them, without a forward

A map's rows are computed over every key they see (a softmax needs them all), whatever the
column window; a block's keys past its last row are skipped when the group is causal.

The answer's size, layout and encoding are the service's (app/serving/attention_serving.py).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable

import numpy as np
import torch

from attnlens.codec import U8_SCALE  # the wire's uint8 step: a whole u8 map is kept in it
from attnlens.model.hooks import Hooks, hooked
from attnlens.model.hooks import active as active_hooks
from attnlens.model.parts.attention import MultiHeadAttention
from attnlens.model.parts.attention_backends import emitting
from attnlens.model.parts.causal_attention import Emit

BLOCK_BYTES = 16 << 20  # a block's scores (H' x B x n float32; its softmax and reduction take as much again): a stream beside the call waits about one block
FUSED = True  # a layer's maps from its forward's kernel where it can (False: always recomputed; the bench's before)
# the most a fused Pool's per-row bin sums of one layer (H' x rows x column bins float32) may take; over it,
# the layer is recomputed in blocks (SmolLM2's 9 heads at 8,192 tokens and 64 bins: 19 MB)
EMIT_BYTES = 256 << 20
_QK = ("hook_rot_q", "hook_rot_k", "hook_q", "hook_k")


@dataclass(frozen=True)
class MapRequest:
    """What each asked map becomes (the request's `pool`, `top_k`, `rows`, `cols`): a window of query
    rows [a, b) and key columns [c, d) (default: all), at full resolution, pooled to a grid of
    `pool` x `pool` bins, or as each row's `top_k` heaviest keys. A window is clipped to each
    group's own axes (an encoder-decoder's groups run over the source and the target). Plain data
    the service builds (and sizes its answer by: app/serving/attention_serving.py); the model reads it."""

    pool: int | None = None
    top_k: int | None = None
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None

    def window(self, n_queries: int, n_keys: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(rows, cols) of a group with these axes' lengths: the asked window clipped to them."""
        clip = lambda w, n: (0, n) if w is None else (min(w[0], n), min(w[1], n))
        return clip(self.rows, n_queries), clip(self.cols, n_keys)

    def reduction(self, n_layers: int, n_heads: int, n_queries: int, n_keys: int, fmt: str) -> Reduction:
        """What a group's maps with these axes' lengths become, kept in `fmt`'s type when whole."""
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


def analyse_attention(model, ids: list[int], layers: list[int], heads: list[int],
                      target_ids: list[int] | None = None, ablate: tuple = (), want: MapRequest = MapRequest(),
                      fmt: str = "json", keep_bytes: int = 0,
                      report: Callable[[], None] | None = None) -> AnalysisMaps:
    """The asked layers' and heads' maps of every group, made in blocks of query rows and reduced as
    `want` asks (blocked_maps); with `ablate`, model/hooks.py's ZEdits, those
    of the ablated model (a default target is still the unablated model's output).
    A whole map is kept in `fmt`'s type (float32 for json, float16, uint8 steps): no float32 copy of
    a long map is ever held for a smaller answer. `keep_bytes`: the queries and keys kept of recent
    sequences (kept_for), so another window of a layer already analysed runs no forward. `report`
    is called at each progress point (the engine's heartbeat, and where a call is stopped)."""
    tokens, generated = model.sequence(ids, target_ids)  # the clean translation, before any edit
    family = model.family  # the declaration its class carries (model/families/contract.py)
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
    return analyse_attention(model, ids, layers, heads).maps[model.family.primary.name]


# --- the reductions: what a group's maps become ---------------------------------------------

def bin_edges(n: int, bins: int) -> list[int]:
    """bins + 1 edges from 0 to n, bin i = [edges[i], edges[i + 1]): contiguous, sizes differing by
    at most one; at most n bins (a bin holds one position at least)."""
    bins = max(1, min(bins, n))
    return [i * n // bins for i in range(bins + 1)]


class Reduction:
    """What a group's maps become: `add` takes a block of probabilities as it is made; `result` the
    answer's arrays once every block is in. rows (a, b) and cols (c, d): the query and key positions
    it covers."""

    def __init__(self, n_layers: int, n_heads: int, rows: tuple[int, int], cols: tuple[int, int]):
        self.shape = (n_layers, n_heads)
        self.rows, self.cols = rows, cols

    def add(self, layer: int, probs: torch.Tensor, row0: int, key0: int) -> None:
        """probs (H', B, n): the asked heads' probabilities of query rows row0.. over keys key0..
        (every key outside [key0, key0 + n) has probability 0 for these rows)."""
        raise NotImplementedError

    def emit(self, layer: int, heads: list[int]) -> Emit | None:
        """What the forward's kernel may make of `layer`'s maps for this reduction (then `take` it)."""
        return None

    def take(self, layer: int, emit: Emit) -> None:
        """The maps of `layer` the kernel made (emit.done), into the result."""

    def _key_overlap(self, key0: int, n: int) -> tuple[int, int]:
        """The key positions [lo, hi) a block holds within the column window (lo >= hi: none)."""
        return max(self.cols[0], key0), min(self.cols[1], key0 + n)

    def result(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class Window(Reduction):
    """The maps' rows [a, b) x columns [c, d) at full resolution: (L', H', b - a, d - c), kept as
    `store` (float32, float16, or uint8 counting steps of `scale`)."""

    def __init__(self, n_layers, n_heads, rows, cols, store: torch.dtype = torch.float32, scale: float = 1.0):
        super().__init__(n_layers, n_heads, rows, cols)
        self.store, self.scale = store, scale
        self.maps = torch.zeros(n_layers, n_heads, rows[1] - rows[0], cols[1] - cols[0], dtype=store)

    def add(self, layer, probs, row0, key0):
        lo, hi = self._key_overlap(key0, probs.shape[-1])
        if lo >= hi:
            return
        part = probs[:, :, lo - key0:hi - key0]  # (H', B, hi - lo)
        if self.store == torch.uint8:
            part = part.div(self.scale).round_().clamp_(0, 255)
        r = row0 - self.rows[0]
        self.maps[layer, :, r:r + probs.shape[1], lo - self.cols[0]:hi - self.cols[0]] = part.to(self.store).cpu()

    def emit(self, layer, heads):
        return Emit(heads, self.rows, self.cols, window=self.maps[layer], window_scale=self.scale)  # written in place

    def result(self):
        return {"maps": self.maps}


class Pool(Reduction):
    """Each map pooled to a grid (L', H', Nr, Nc) over bin_edges of the rows' and the columns' windows:
    cell (i, j) = mean over the queries of row bin i of the sum of their weights on the keys of
    column bin j. Pooled rows sum to 1 when the columns are every key; cells no query of the bin
    can see (a causal map's upper cells) are exactly 0."""

    def __init__(self, n_layers, n_heads, rows, cols, bins: int):
        super().__init__(n_layers, n_heads, rows, cols)
        self.row_edges = [rows[0] + e for e in bin_edges(rows[1] - rows[0], bins)]
        self.col_edges = [cols[0] + e for e in bin_edges(cols[1] - cols[0], bins)]
        self.grid = torch.zeros(n_layers, n_heads, len(self.row_edges) - 1, len(self.col_edges) - 1)
        self._row_bin: torch.Tensor | None = None  # query position - a -> its row bin

    def add(self, layer, probs, row0, key0):
        H, B, n = probs.shape
        device = probs.device
        # the sum over each column bin from running sums: S[e] - S[s], the key positions clipped to the block
        running = torch.zeros(H, B, n + 1, device=device)
        torch.cumsum(probs, dim=-1, out=running[:, :, 1:])
        at = (torch.tensor(self.col_edges, device=device) - key0).clamp_(0, n)  # (Nc + 1,)
        sums = (running[:, :, at[1:]] - running[:, :, at[:-1]]).clamp_(min=0)  # (H', B, Nc); rounding never below 0
        self._add_sums(layer, sums, row0)

    def emit(self, layer, heads):
        if 4 * len(heads) * (self.rows[1] - self.rows[0]) * (len(self.col_edges) - 1) > EMIT_BYTES:
            return None
        return Emit(heads, self.rows, self.cols, col_edges=self.col_edges)  # bin_sums (H', b - a, Nc) made by the call

    def take(self, layer, emit):
        assert emit.bin_sums is not None
        self._add_sums(layer, emit.bin_sums, self.rows[0])

    def _add_sums(self, layer: int, sums: torch.Tensor, row0: int) -> None:
        """sums (H', B, Nc): query rows row0.. summed over each column bin, added to their row bins."""
        device = sums.device
        if self._row_bin is None or self._row_bin.device != device:
            edges = torch.tensor(self.row_edges, device=device)
            positions = torch.arange(self.rows[0], self.rows[1], device=device)
            self._row_bin = torch.searchsorted(edges, positions, right=True) - 1
        bins = self._row_bin[row0 - self.rows[0]:row0 - self.rows[0] + sums.shape[1]]
        grid = self.grid[layer].to(device) if device.type != "cpu" else self.grid[layer]
        grid.index_add_(1, bins, sums)  # rows of a bin summed into its row of the grid
        if device.type != "cpu":
            self.grid[layer] = grid.cpu()

    def result(self):
        counts = torch.tensor(self.row_edges[1:]) - torch.tensor(self.row_edges[:-1])  # (Nr,)
        return {"maps": self.grid / counts[:, None], "row_edges": self.row_edges, "col_edges": self.col_edges}


class TopK(Reduction):
    """Each query row's k heaviest keys within the column window, heaviest first: weights
    (L', H', b - a, k) float32 and key positions (int32); a weight of 0 (a masked key, or fewer
    keys than k) has position -1."""

    def __init__(self, n_layers, n_heads, rows, cols, k: int):
        super().__init__(n_layers, n_heads, rows, cols)
        self.k = k
        self.weights = torch.zeros(n_layers, n_heads, rows[1] - rows[0], k)
        self.positions = torch.full((n_layers, n_heads, rows[1] - rows[0], k), -1, dtype=torch.int32)

    def add(self, layer, probs, row0, key0):
        lo, hi = self._key_overlap(key0, probs.shape[-1])
        if lo >= hi:
            return
        k = min(self.k, hi - lo)
        weights, index = torch.topk(probs[:, :, lo - key0:hi - key0], k, dim=-1)  # (H', B, k), sorted
        positions = torch.where(weights > 0, index + lo, -1).to(torch.int32)
        r = row0 - self.rows[0]
        self.weights[layer, :, r:r + probs.shape[1], :k] = weights.cpu()
        self.positions[layer, :, r:r + probs.shape[1], :k] = positions.cpu()

    def emit(self, layer, heads):  # written in place
        return Emit(heads, self.rows, self.cols, top_weights=self.weights[layer], top_positions=self.positions[layer])

    def result(self):
        return {"maps": self.weights, "positions": self.positions}


# --- the queries and keys kept for another window (a zoom) ------------------------------------

_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> KeptQK (in the process that runs it)


def kept_for(model, limit: int) -> KeptQK | None:
    """The model's store of recently analysed queries and keys, `limit` bytes (0: none)."""
    if limit <= 0:
        return None
    kept = _kept.get(model)
    if kept is None or kept.limit != limit:
        kept = _kept[model] = KeptQK(limit)
    return kept


class KeptQK:
    """Queries and keys ((Q, H, D), (S, K, D)) by (sequence, attention module), the most recently
    used last, within `limit` bytes (the oldest go first; a pair larger than the limit is not kept)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.bytes = 0
        self._items: OrderedDict[Hashable, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    @staticmethod
    def _size(pair) -> int:
        return sum(t.numel() * t.element_size() for t in pair)

    def get(self, key: Hashable) -> tuple[torch.Tensor, torch.Tensor] | None:
        pair = self._items.get(key)
        if pair is not None:
            self._items.move_to_end(key)
        return pair

    def put(self, key: Hashable, q: torch.Tensor, k: torch.Tensor) -> None:
        pair = (_alone(q), _alone(k))
        size = self._size(pair)
        if size > self.limit or key in self._items:
            return
        while self._items and self.bytes + size > self.limit:
            self.bytes -= self._size(self._items.popitem(last=False)[1])
        self._items[key] = pair
        self.bytes += size

    def __len__(self) -> int:
        return len(self._items)


def _alone(t: torch.Tensor) -> torch.Tensor:
    """t itself when it is all its storage holds (a rotary model's q is), else a copy: a view of a
    fused projection would keep the whole projection alive."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.contiguous()


def _visible(causal: bool, window: int | None, row0: int, row1: int, n_keys: int, device
             ) -> tuple[int, int, torch.Tensor | None]:
    """The keys [lo, hi) rows row0..row1-1 can see, and the (B, hi - lo) mask of those they cannot
    (None: they see all of them). Causal: up to the row itself; a window: the last `window` too."""
    if not causal:
        return 0, n_keys, None
    lo = 0 if window is None else max(0, row0 - window + 1)
    hi = min(row1, n_keys)
    rows = torch.arange(row0, row1, device=device)[:, None]  # (B, 1)
    keys = torch.arange(lo, hi, device=device)[None, :]  # (1, n)
    hidden = keys > rows
    if window is not None:
        hidden |= keys <= rows - window
    return lo, hi, hidden


def reduce_layer(reduction: Reduction, layer: int, q: torch.Tensor, k: torch.Tensor, heads: list[int],
                 groups: int, scale: float, causal: bool, window: int | None, *,
                 block_bytes: int = BLOCK_BYTES, progress: Callable[[], None] | None = None,
                 softcap: float | None = None) -> None:
    """One layer's asked heads, q (Q, H, D) over k (S, K, D) (K = H / groups key heads), made in
    blocks of query rows within reduction.rows and fed to `reduction` as `layer`; `softcap`: the
    scores capped first, as the layer's forward caps them (Gemma 2)."""
    a, b = reduction.rows
    S = k.shape[0]
    kv = torch.tensor([h // groups for h in heads], device=k.device)
    q_heads = q[a:b].index_select(1, torch.tensor(heads, device=q.device)).float().transpose(0, 1)  # (H', Qw, D)
    k_heads = k.index_select(1, kv).float().permute(1, 2, 0).contiguous()  # (H', D, S)
    rows_per_block = max(1, block_bytes // (4 * len(heads) * max(S, 1)))
    for row0 in range(a, b, rows_per_block):
        row1 = min(b, row0 + rows_per_block)
        lo, hi, hidden = _visible(causal, window, row0, row1, S, q.device)
        scores = torch.bmm(q_heads[:, row0 - a:row1 - a], k_heads[:, :, lo:hi]).mul_(scale)  # (H', B, n)
        if softcap is not None:
            scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
        if hidden is not None:
            scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        del scores
        reduction.add(layer, probs, row0, lo)
        if progress is not None:
            progress()


def _reduce_whole(reduction: Reduction, maps: torch.Tensor, layers: list[int], heads: list[int]) -> None:
    """Full (L, H, Q, S) maps, already made, through a reduction: its rows as one block."""
    a, b = reduction.rows
    for i, layer in enumerate(layers):
        reduction.add(i, maps[layer][heads][:, a:b].float(), a, 0)


def _emits(model, pending: dict, layers: list[int], heads: list[int], reductions: dict[str, Reduction]
           ) -> dict[str, Emit]:
    """What the forward's kernel is asked to make (attention module's path -> Emit): the layers whose
    maps it computes as the forward does, those of causal groups without a sliding window or a
    soft-cap (the backend leaves an Emit undone where its kernel does not run: the GPU, a mask)."""
    if not FUSED:
        return {}
    emits = {}
    for module, (group, i) in pending.items():
        attn = model.get_submodule(module)
        if group.causal and model.layer_windows[layers[i]] is None and attn.softcap is None:
            emit = reductions[group.name].emit(i, heads)
            if emit is not None:
                emits[module] = emit
    return emits


def blocked_maps(model, tokens: dict[str, list[int]], layers: list[int], heads: list[int],
                 reductions: dict[str, Reduction], ablate: tuple = (), progress: Callable[[], None] | None = None,
                 block_bytes: int = BLOCK_BYTES, kept: KeptQK | None = None) -> None:
    """Feed the asked layers' and heads' maps of every group in `reductions` (group name ->
    Reduction) of one analysed sequence (`tokens`, as model.sequence gives them) to its reduction.

    One forward (model.run_sequence) under hooks that keep the asked layers' queries and keys, and
    edit it with `ablate` (model/hooks.py's ZEdits). A layer whose attention our C kernel computes
    (causal, no sliding window or soft-cap, float32 on the CPU) makes its reduction there, from the
    forward's own scores (`_emits`). At each progress point of the forward (after an attention,
    after a block), the layers whose queries and keys are in are taken from the kernel, or else
    reduced from them, and let go: one layer's are held at a time.
    `progress` is called after each attention and each block of the forward, and after each
    block of query rows (model/hooks.py's progress points). With
    `kept`, the layers' queries and keys are kept there too, and a call whose layers are all
    there runs no forward. Under hooks of a caller's (`hooked`), which these would replace, the
    family's `analyse` makes the full maps, then they are reduced."""
    family = model.family
    if active_hooks() is not None:
        target = tokens["target"][1:] if family.takes_target else None
        analysis = model.analyse(tokens[family.primary.queries], target)
        for name, reduction in reductions.items():
            _reduce_whole(reduction, analysis.maps[name], layers, heads)
        return
    pending = {}  # attention module's hook name -> (group, index of the layer among the asked ones)
    for name in reductions:
        for i, layer in enumerate(layers):
            group = family.groups_by_name[name]
            pending[group.hook.format(layer=layer)] = (group, i)
    sequence = (tuple(tuple(tokens[axis]) for axis in family.axes), tuple(ablate))

    def reduce(module: str, group, i: int, q: torch.Tensor, k: torch.Tensor) -> None:
        attn = model.get_submodule(module)  # a module's path is its hook name
        assert isinstance(attn, MultiHeadAttention)  # a group's hook names its attention module
        window = model.layer_windows[layers[i]] if group.causal else None  # this layer's (Gemma: some)
        reduce_layer(reductions[group.name], i, q, k, heads, attn.groups, attn.scale, group.causal,
                     window, block_bytes=block_bytes, progress=progress, softcap=attn.softcap)

    for module, (group, i) in list(pending.items()):  # layers analysed before: no forward for them
        pair = kept.get((sequence, module)) if kept is not None else None
        if pair is not None:
            reduce(module, group, i, *pair)
            del pending[module]
    if not pending:
        return
    emits = _emits(model, pending, layers, heads, reductions)
    hooks: Hooks

    def after_block() -> None:
        for module, (group, i) in list(pending.items()):
            captured = hooks.captured
            rotary = f"{module}.hook_rot_q" in captured
            q_name, k_name = (f"{module}.hook_rot_q", f"{module}.hook_rot_k") if rotary else (
                f"{module}.hook_q", f"{module}.hook_k")
            if q_name not in captured or k_name not in captured or f"{module}.hook_z" not in captured:
                continue  # not this layer yet, or its attention still runs (a progress point between its pieces)
            q, k = captured[q_name][0], captured[k_name][0]  # (Q, H, D), (S, K, D)
            if kept is not None:
                kept.put((sequence, module), q, k)
            emit = emits.pop(module, None)
            if emit is not None and emit.done:  # made by the forward's kernel
                reductions[group.name].take(i, emit)
            else:
                reduce(module, group, i, q, k)
            for n in (*_QK, "hook_z"):
                captured.pop(f"{module}.{n}", None)
            del pending[module]
        if progress is not None:
            progress()

    hooks = Hooks(record={f"{m}.{n}" for m in pending for n in (*_QK, "hook_z")}, ablate=tuple(ablate),
                  progress=after_block)
    with hooked(model, hooks), emitting(emits):
        model.run_sequence(tokens)
    if pending:
        raise RuntimeError(f"the forward never ran {sorted(pending)}")

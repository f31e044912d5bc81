"""Activation patching of an encoder-decoder (the translator), exact and by attribution, with
TransformerLens's semantics (patching.py's, for a decoder): which of its encoder, decoder and cross
heads carry the difference between a clean and a corrupted source.

The two runs read the clean and the corrupted source (the same number of tokens) and the same
target (the decoder's start token, then `target_ids`); the metric is logit(answer) - logit(foil)
at target position `position` (default the last: what the decoder writes after the target).
Values are that metric, raw, in groups (S = source positions, T = the target's, start included):

    component           patched activation                           values
    heads               a head's z, every position                   {"encoder", "decoder", "cross": [L][H]}
    heads_by_position   a head's z at one position (encoder heads    {"encoder": [L][S][H],
                        at source positions, the decoder's and        "decoder", "cross": [L][T][H]}
                        cross heads at target positions)
    residual            a block's input stream at one position       {"encoder": [L][S], "decoder": [L][T]}
    layers              each sub-layer's output at one position      {"encoder": {"attention", "mlp": [L][S]},
                                                                      "decoder": {"attention", "cross",
                                                                                  "mlp": [L][T]}}

    paths               a sender head's clean output along each       {"encoder", "decoder", "cross":
                        direct path to a later head's q, k or v        {"q", "k", "v": [L][H]}}, None
                        input (encoder_decoder_paths.py)               where the sender has no path

Exact: every cell a row of encoder_decoder_runs' passes, starting at its own block from the
corrupted run (a row patched in the decoder reuses the corrupted memory: no encoder), many rows a
batch; the target is cut after the metric's position (the decoder is causal), so cells after it
keep the corrupted metric, and so does a cell whose clean activation is the corrupted one (the same
target: the decoder's input stream, its first self-attention), without a run.
Attribution: corrupted metric + sum over the cell's positions and dims of (clean - corrupted) x
d metric / d activation at the corrupted run (one forward of the pair, one backward).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from attnlens.model.analysis import encoder_decoder_runs as runs
from attnlens.model.analysis.attribution_patching import in_callers_mode
from attnlens.model.analysis.block_runs import Report
from attnlens.model.analysis.encoder_decoder_paths import FROZEN, GROUPS, patch_paths
from attnlens.model.analysis.encoder_decoder_runs import Pair
from attnlens.model.analysis.patching import (
    PATCH_BYTES,
    PatchResult,
    check_ids,
    check_kind,
    check_pair,
    check_sender,
)

# component -> its values' layout: a point's grid at each leaf (encoder_decoder_runs.POINTS)
LAYOUT: dict[str, dict[str, Any]] = {
    "heads": {"encoder": "encoder.z", "decoder": "decoder.z", "cross": "cross.z"},
    "heads_by_position": {"encoder": "encoder.z", "decoder": "decoder.z", "cross": "cross.z"},
    "residual": {"encoder": "encoder.resid_pre", "decoder": "decoder.resid_pre"},
    "layers": {"encoder": {"attention": "encoder.attn_out", "mlp": "encoder.mlp_out"},
               "decoder": {"attention": "decoder.attn_out", "cross": "cross.attn_out", "mlp": "decoder.mlp_out"}},
}


def _no_report() -> None:
    pass


def check_encoder_decoder_patch(config, clean_ids: list[int], corrupted_ids: list[int], target_ids: list[int] | None,
                                answer_id: int, foil_id: int, position: int | None, component: str, method: str,
                                sender: tuple[int, int] | None, sender_group: str | None = None) -> None:
    """A ValueError naming the field an encoder-decoder of `config` cannot patch."""
    runs.check_blocks(config)
    check_kind(component, method)
    if component == "paths":
        if sender is not None and sender_group not in GROUPS:
            raise ValueError(f"sender group {sender_group!r}: an encoder-decoder's sender is a head of one of its "
                             f"groups {', '.join(GROUPS)}")
        check_sender(config, sender, "(group, layer, head)")
    elif sender is not None or sender_group is not None:
        raise ValueError("sender is for component paths only")
    check_pair(config, clean_ids, corrupted_ids, "source")
    target = target_ids or []
    if len(target) + 1 > config.context_length:
        raise ValueError(f"target_ids has {len(target)} tokens; with the start token over the context length "
                         f"{config.context_length}")
    check_ids(config, [("clean_ids", clean_ids), ("corrupted_ids", corrupted_ids), ("target_ids", target)],
              answer_id, foil_id)
    if position is not None and not 0 <= position <= len(target):
        raise ValueError(f"position {position} out of range 0..{len(target)}: the target has {len(target) + 1} "
                         "positions, the start token first")


# --- cells ----------------------------------------------------------------------------------------
Cell = tuple[str, int, int, int]  # (point, layer, head or -1: the whole stream, position or -1: every one)


def _axis(point: str) -> str:
    return "encoder" if point.startswith("encoder") else "decoder"


def cells_of(component: str, pair: Pair, L: int, H: int) -> list[Cell]:
    """Every cell of `component` whose patch can reach the metric (decoder positions up to its own)."""
    out = []
    for point in _points(LAYOUT[component]):
        heads = range(H) if point.endswith(".z") else (-1,)
        n = pair.lengths["encoder"] if _axis(point) == "encoder" else pair.position + 1
        positions = (-1,) if component == "heads" else range(n)
        out += [(point, layer, h, p) for layer in range(L) for p in positions for h in heads]
    return out


def _points(tree) -> list[str]:
    return [tree] if isinstance(tree, str) else [p for sub in tree.values() for p in _points(sub)]


def arrange(component: str, pair: Pair, L: int, H: int, value: Callable[[Cell], float]) -> dict[str, Any]:
    """The values in LAYOUT's shape, each cell's from `value` (positions past the metric's: the corrupted
    metric)."""
    corrupted = pair.metrics[1]

    def grid(point: str) -> list:
        heads = point.endswith(".z")
        at = lambda layer, p: ([value((point, layer, h, p)) for h in range(H)] if heads
                               else value((point, layer, -1, p)))
        if component == "heads":
            return [at(layer, -1) for layer in range(L)]
        reach = pair.lengths["encoder"] if _axis(point) == "encoder" else pair.position + 1
        blank = lambda: [corrupted] * H if heads else corrupted
        return [[at(layer, p) if p < reach else blank() for p in range(pair.lengths[_axis(point)])]
                for layer in range(L)]

    def walk(tree):
        return grid(tree) if isinstance(tree, str) else {k: walk(v) for k, v in tree.items()}
    return walk(LAYOUT[component])


def _slice(t: torch.Tensor, cell: Cell) -> torch.Tensor:
    """The cell's part of a run's activation t (S or N, ...)."""
    _, _, head, p = cell
    t = t if p < 0 else t[p:p + 1]
    return t if head < 0 else t[:, head]


class PatchTap(runs.Tap):
    """Each row's one patch at the block it joins: its cell's activation set to the clean run's."""

    def __init__(self, cells: list[Cell], clean: runs.Recorder):
        self.cells, self.clean = cells, clean

    def at(self, point, layer, t, fresh):
        rows = [i for i in range(fresh.start, fresh.stop) if self.cells[i][0] == point]
        if not rows:
            return t
        clean = self.clean.got[point][layer][0]  # (S or N, ...) the clean row
        t = t.clone()
        for i in rows:
            _, _, head, p = self.cells[i]
            where = slice(None) if p < 0 else p
            if head < 0:
                t[i, where] = clean[where]
            else:
                t[i, where, head] = clean[where, head]
        return t


# --- exact --------------------------------------------------------------------------------------
@torch.inference_mode()
def patch_encoder_decoder(model, clean_ids: list[int], corrupted_ids: list[int], answer_id: int, foil_id: int,
                          position: int | None = None, component: str = "heads", target_ids: list[int] | None = None,
                          report: Report = _no_report, max_bytes: int = PATCH_BYTES,
                          sender: tuple[str, int, int] | None = None) -> PatchResult:
    """Exact activation patching of `component` (module docstring): every cell's patched metric. `sender`
    (group, layer, head): component "paths"' sender head."""
    check_encoder_decoder_patch(model.config, clean_ids, corrupted_ids, target_ids, answer_id, foil_id, position,
                                component, "exact", None if sender is None else sender[1:],
                                None if sender is None else sender[0])
    L, H = model.config.n_layers, model.config.n_heads
    pair = Pair(model, clean_ids, corrupted_ids, target_ids, answer_id, foil_id, position)
    if component == "paths":
        assert sender is not None  # the check asks for one
        pair.run(model, set(FROZEN), report)
        paths = patch_paths(model, pair, sender, report, max_bytes)
        return PatchResult(component, "exact", pair.position, pair.differs, pair.metrics[0], pair.metrics[1], paths,
                           (sender[1], sender[2]), sender[0])
    cells = cells_of(component, pair, L, H)
    pair.run(model, {c[0] for c in cells}, report)
    assert pair.got is not None
    got = pair.got.got
    moved = [c for c in cells if not torch.equal(_slice(got[c[0]][c[1]][0], c), _slice(got[c[0]][c[1]][1], c))]
    join = lambda c: c[1] if _axis(c[0]) == "encoder" else L + c[1]  # the block a cell's row starts at
    moved.sort(key=join)
    chunk = max(1, max_bytes // runs.row_bytes(model, pair.lengths["encoder"], pair.position + 1))
    start = pair.start()
    found: dict[Cell, float] = {}
    for i in range(0, len(moved), chunk):
        part = moved[i:i + chunk]
        final = runs.run_rows(model, [join(c) for c in part], start, PatchTap(part, pair.got), report)
        found.update(zip(part, runs.metric(model, final[:, -1], pair.direction).tolist()))
    values = arrange(component, pair, L, H, lambda c: found.get(c, pair.metrics[1]))
    return PatchResult(component, "exact", pair.position, pair.differs, pair.metrics[0], pair.metrics[1], values)


# --- attribution -----------------------------------------------------------------------------------
def attribution_patch_encoder_decoder(model, clean_ids: list[int], corrupted_ids: list[int], answer_id: int,
                                      foil_id: int, position: int | None = None, component: str = "heads",
                                      target_ids: list[int] | None = None, report: Report = _no_report
                                      ) -> PatchResult:
    """Every cell's first-order estimate of its patched metric (module docstring), autograd on inside
    whatever the caller's mode (attribution_patching.py's reasons)."""
    check_encoder_decoder_patch(model.config, clean_ids, corrupted_ids, target_ids, answer_id, foil_id, position,
                                component, "attribution", None)
    L, H = model.config.n_layers, model.config.n_heads
    paused = in_callers_mode(report)
    with torch.inference_mode(False), torch.enable_grad():
        pair = Pair(model, clean_ids, corrupted_ids, target_ids, answer_id, foil_id, position)
        want = set(_points(LAYOUT[component]))
        value = pair.run(model, want, paused)[1]  # the corrupted row's metric: its gradients only
        assert pair.got is not None
        names = [(point, layer) for point in sorted(want) for layer in range(L)]
        grads = torch.autograd.grad(value, [pair.got.got[p][layer] for p, layer in names], allow_unused=True)
    report()
    effects = {}  # (point, layer) -> (clean - corrupted) x gradient, (S or N, ...) float32
    for (point, layer), g in zip(names, grads):
        t = pair.got.got[point][layer].detach()
        effects[point, layer] = ((t[0] - t[1]) * (torch.zeros_like(t[1]) if g is None else g[1])).float()
    corrupted = pair.metrics[1]
    values = arrange(component, pair, L, H, lambda c: corrupted + float(_slice(effects[c[0], c[1]], c).sum()))
    return PatchResult(component, "attribution", pair.position, pair.differs, pair.metrics[0], corrupted, values)

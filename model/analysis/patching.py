"""Activation patching of a decoder, with TransformerLens's semantics (transformer_lens/patching.py),
exact and batched: which components carry the difference between a clean and a corrupted prompt.

A patched run is the corrupted prompt's forward with one activation replaced by its value in the
clean run; the patched metric is logit(answer) - logit(foil) at `position`. Values are that metric,
raw (a caller normalises: (v - corrupted) / (clean - corrupted)).

    component           patched activation (TransformerLens)                   values
    heads               a head's z, every position (attn_head_out_all_pos)     [L][H]
    heads_by_position   a head's z at one position (attn_head_out_by_pos)      [L][T][H]
    residual            resid_pre of a block at one position (resid_pre)       [L][T]
    layers              attention / MLP output at one position (attn_out,      {"attention": [L][T],
                        mlp_out)                                                "mlp": [L][T]}
    paths               path patching from a sender head to each later head's  {"q", "k", "v": [L][H]},
                        query, key or value input (get_act_patch_direct_path)  None at layers <= the sender's

Paths (Wang et al. 2022, the edge A -> B): the sender's clean-minus-corrupted write (z @ W_O at
every position) is added to the residual stream only as the receiver head reads it for its
queries (or keys, or values); every other reader, every other head of the receiver's layer
included, sees the corrupted stream. With grouped-query attention a receiver is a query head: its
keys (values) are its own projection of the patched stream, its group's other heads keep theirs.

Why it is fast (no loop of whole forwards): the clean and corrupted prompts run once, side by
side, keeping what the patches read. Then, the model being causal:
* nothing before the first position where the prompts differ (`first_difference`) differs between
  the runs, so a patch there changes nothing: its value is the corrupted metric, without a run;
* a patch at block l and position p leaves every block below l and every position before p as in
  the corrupted run: a patched row starts at block l, from the corrupted residual stream, and
  computes positions p .. `position` only (keys and values before p from the corrupted run);
* positions after `position` never reach the metric (their patches give the corrupted metric),
  and the last block computes only the metric's position;
* the rows of one starting position run as one batch over the blocks, each row joining at its
  own block (block_runs.run_rows): one pass over the model for every cell of every layer, each
  block's weights read once. A batch is cut to `max_bytes` (block_runs.row_bytes).
So `heads` on SmolLM2 (270 cells) costs about what 270 rows of (position + 1 - first_difference)
tokens cost, on average through half the blocks, in 30 batched blocks.

attribution_patching.py gives the same components' first-order estimates (method="attribution");
encoder_decoder_patching.py both, for an encoder-decoder's three groups of heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnlens.model.analysis.block_runs import (
    Readout,
    Recorder,
    Report,
    Span,
    Tap,
    check_decoder,
    metric,
    norm,
    project,
    readout,
    row_bytes,
    run_rows,
    span,
)

COMPONENTS = ("heads", "heads_by_position", "residual", "layers", "paths")
METHODS = ("exact", "attribution")
PATCH_BYTES = 256 << 20  # what a batch of patched rows may hold at once (block_runs.row_bytes)


def _no_report() -> None:
    pass


@dataclass
class PatchResult:
    """The patched metric of every cell of `component` (shapes in the module docstring)."""

    component: str
    method: str  # "exact" | "attribution" (first-order estimates of the same values)
    position: int  # where the metric is read
    first_difference: int  # the first position where the prompts (an encoder-decoder's sources) differ, or their length
    clean_metric: float
    corrupted_metric: float
    values: Any
    sender: tuple[int, int] | None = None  # paths: the sender head (layer, head)
    sender_group: str | None = None  # an encoder-decoder's paths: the sender's group (encoder, decoder, cross)


def check_patch(config, clean_ids: list[int], corrupted_ids: list[int], answer_id: int, foil_id: int,
                position: int | None, component: str, method: str, sender: tuple[int, int] | None) -> None:
    """A ValueError naming the field that a model of `config` cannot patch."""
    if config.family != "decoder":
        raise ValueError(f"activation patching needs a decoder (a causal language model) or an encoder-decoder; "
                         f"this model is an {config.family}")
    check_kind(component, method)
    check_pair(config, clean_ids, corrupted_ids, "prompt")
    check_ids(config, [("clean_ids", clean_ids), ("corrupted_ids", corrupted_ids)], answer_id, foil_id)
    if position is not None and not 0 <= position < len(clean_ids):
        raise ValueError(f"position {position} out of range 0..{len(clean_ids) - 1}")
    if component == "paths":
        if config.norm != "pre":
            raise ValueError("component 'paths' needs a pre-norm model: a post-norm block normalises the "
                             "sender's write before it reaches the residual stream")
        if config.post_norms:
            raise ValueError("component 'paths' cannot patch a model with norms after each sub-layer (post_norms: "
                             "Gemma 2/3, OLMo 2): the norm of the attention's output mixes every head's write, "
                             "so one head's write into the residual stream is not its own")
        check_sender(config, sender, "(layer, head)")


# --- the checks a decoder's and an encoder-decoder's patching share ---------------------------------
def check_kind(component: str, method: str) -> None:
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {COMPONENTS}, got {component!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if component == "paths" and method != "exact":
        raise ValueError("component 'paths' is patched exactly only (method 'exact')")


def check_pair(config, clean_ids: list[int], corrupted_ids: list[int], what: str) -> None:
    """The clean and corrupted inputs (a prompt, an encoder-decoder's source) line up and fit."""
    if not clean_ids:
        raise ValueError("clean_ids is empty")
    if len(corrupted_ids) != len(clean_ids):
        raise ValueError(f"corrupted_ids has {len(corrupted_ids)} tokens and clean_ids {len(clean_ids)}: the "
                         f"corrupted {what} must have as many tokens as the clean one")
    if len(clean_ids) > config.context_length:
        raise ValueError(f"clean_ids has {len(clean_ids)} tokens, over the context length {config.context_length}")


def check_ids(config, named_ids: list[tuple[str, list[int]]], answer_id: int, foil_id: int) -> None:
    """Every token id, the answer's and the foil's too, is in the vocabulary."""
    for name, ids in named_ids:
        bad = [i for i in ids if not 0 <= i < config.vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} out of range 0..{config.vocab_size - 1}")
    for name, i in (("answer_id", answer_id), ("foil_id", foil_id)):
        if not 0 <= i < config.vocab_size:
            raise ValueError(f"{name} {i} out of range 0..{config.vocab_size - 1}")


def check_sender(config, sender: tuple[int, int] | None, shape: str) -> None:
    """Component paths' sender head is given and in range (`shape` says how it is written)."""
    if sender is None:
        raise ValueError(f"component 'paths' needs a sender {shape}")
    layer, head = sender
    if not 0 <= layer < config.n_layers:
        raise ValueError(f"sender layer {layer} out of range 0..{config.n_layers - 1}")
    if not 0 <= head < config.n_heads:
        raise ValueError(f"sender head {head} out of range 0..{config.n_heads - 1}")


# --- the two runs --------------------------------------------------------------------------------
@dataclass
class Pair:
    """The two prompts as far as the metric reads them (1, N) with N = position + 1, the first
    position where they differ, the metric's direction, and the two runs' intermediates (row 0
    clean, row 1 corrupted) with their metrics."""

    clean: torch.Tensor
    corrupted: torch.Tensor
    length: int  # the prompts' full length (the values' T)
    position: int
    differs: int
    direction: Readout
    runs: Recorder | None = None
    metrics: tuple[float, float] = (0.0, 0.0)

    @property
    def n(self) -> int:
        return self.position + 1


def pair_of(model, clean_ids: list[int], corrupted_ids: list[int], answer_id: int, foil_id: int,
            position: int | None) -> Pair:
    """The prompts cut after the metric's position (default the last), and what the patches need to know
    of them; the runs come from run_pair."""
    pos = len(clean_ids) - 1 if position is None else position
    differs = next((i for i, (a, b) in enumerate(zip(clean_ids, corrupted_ids)) if a != b), len(clean_ids))
    device = model.device
    as_row = lambda ids: torch.tensor([ids[:pos + 1]], dtype=torch.long, device=device)  # (1, N)
    return Pair(as_row(clean_ids), as_row(corrupted_ids), len(clean_ids), pos, min(differs, pos + 1),
                readout(model, answer_id, foil_id))


def run_pair(model, pair: Pair, want: set[str], report: Report) -> None:
    """The clean and corrupted prompts side by side, keeping `want` (and every layer's residual stream,
    keys and values: where patched rows start from) in pair.runs, their metrics in pair.metrics."""
    runs = Recorder(want | {"resid_pre", "keys", "values"})
    x = model.embed(torch.cat([pair.clean, pair.corrupted]))  # (2, N, C)
    final = run_rows(model, span(model, 0, pair.n), [0, 0], lambda layer, n: x, runs, report, last_only=False)
    clean, corrupted = metric(model, final[:, -1], pair.direction).tolist()
    pair.runs, pair.metrics = runs, (clean, corrupted)


# --- patched rows --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One patched row: the block it starts at, what it patches ("z", "resid_pre", "attn_out",
    "mlp_out"; paths: "q", "k", "v") and the head (-1 for a whole-stream activation)."""

    layer: int
    kind: str
    head: int = -1


class PatchTap(Tap):
    """Each row's one patch, at the block the row joins: its cell's activation set to the clean run's,
    at the span's first position (every position of the span for `every`: the heads component).
    Paths: the receiver's q, k or v input is its projection of the stream plus the sender's `delta`."""

    def __init__(self, model, cells: list[Cell], clean: Recorder, sp: Span, every: bool,
                 delta: torch.Tensor | None = None):
        self.model, self.cells, self.clean, self.sp, self.every, self.delta = model, cells, clean, sp, every, delta

    def _rows(self, fresh: slice, kinds: tuple[str, ...]) -> list[int]:
        return [i for i in range(fresh.start, fresh.stop) if self.cells[i].kind in kinds]

    def _set(self, kind: str, layer: int, t: torch.Tensor, fresh: slice) -> torch.Tensor:
        """t (R, Tq, ...) covering the span's last Tq positions, with the fresh `kind` rows patched."""
        rows = self._rows(fresh, (kind,))
        first = self.sp.end - t.shape[1]  # the position of t[:, 0]
        p = self.sp.start
        if not rows or (p < first and not self.every):  # the last block computes the last position only
            return t
        clean = self.clean.got[kind][layer][0]  # (N, ...) the clean row
        index = torch.tensor(rows, device=t.device)
        t = t.clone()
        if kind != "z":
            t[index, p - first] = clean[p]
            return t
        heads = torch.tensor([self.cells[i].head for i in rows], device=t.device)
        if self.every:  # (Tq, H, D) -> (Tq, n, D) -> (n, Tq, D)
            t[index, :, heads] = clean[first:, heads].transpose(0, 1)
        else:
            t[index, p - first, heads] = clean[p, heads]  # (n, D)
        return t

    def resid_pre(self, layer, x, fresh):
        return self._set("resid_pre", layer, x, fresh)

    def z(self, layer, z, fresh):
        return self._set("z", layer, z, fresh)

    def attn_out(self, layer, out, fresh):
        return self._set("attn_out", layer, out, fresh)

    def mlp_out(self, layer, out, fresh):
        return self._set("mlp_out", layer, out, fresh)

    def qkv(self, layer, x, q, k, v, fresh):
        rows = self._rows(fresh, ("q", "k", "v"))
        if not rows or self.delta is None:
            return q, k, v
        block = self.model.blocks[layer]
        index = torch.tensor(rows, device=x.device)
        q2, k2, v2 = project(block.attn, norm(block.ln1, x[index] + self.delta),
                                 self.sp.ropes[layer])  # the receivers' own
        H, K = q.shape[1], k.shape[1]
        G = H // K
        kinds = {self.cells[i].kind for i in rows}
        if G > 1 and kinds & {"k", "v"}:  # each query head its own keys and values: (R, K, Tn, D) -> (R, H, Tn, D)
            k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        out = {"q": q, "k": k, "v": v}
        as_index = lambda values: torch.tensor(values, dtype=torch.long, device=x.device)
        for kind, mine in (("q", q2), ("k", k2), ("v", v2)):
            picked = [j for j, i in enumerate(rows) if self.cells[i].kind == kind]
            if not picked:
                continue
            heads = [self.cells[rows[j]].head for j in picked]
            src = heads if kind == "q" else [h // G for h in heads]  # the key/value head a query head reads
            t = out[kind].clone()
            receivers = as_index([rows[j] for j in picked])
            t[receivers, as_index(heads)] = mine[as_index(picked), as_index(src)]  # (n, Tn, D)
            out[kind] = t
        return out["q"], out["k"], out["v"]


def run_cells(model, pair: Pair, cells: list[Cell], start: int, report: Report, max_bytes: int, *,
              every: bool = False, delta: torch.Tensor | None = None) -> list[float]:
    """The patched metric of each cell (sorted by layer), each row computing positions start .. position
    from its cell's block: in batches of at most max_bytes."""
    assert pair.runs is not None
    runs = pair.runs
    sp = span(model, start, pair.n, runs, row=1)
    chunk = max(1, max_bytes // row_bytes(model, sp))
    enter = lambda layer, n: runs.got["resid_pre"][layer][1:2, start:]  # (1, Tn, C) the corrupted stream
    values: list[float] = []
    for i in range(0, len(cells), chunk):
        part = cells[i:i + chunk]
        tap = PatchTap(model, part, runs, sp, every, None if delta is None else delta[start:])
        final = run_rows(model, sp, [c.layer for c in part], enter, tap, report)
        values += metric(model, final[:, -1], pair.direction).tolist()
    return values


def patch_by_position(model, pair: Pair, kinds: list[str], heads: bool, report: Report, max_bytes: int
                      ) -> dict[str, list]:
    """[kind] -> [L][T] (with `heads`, [L][T][H]): the activation at one position patched, for each
    position from the first difference to the metric's (one batch of rows per position); elsewhere
    the corrupted metric (the patch changes nothing the metric reads)."""
    L, H = model.config.n_layers, model.config.n_heads
    blank = lambda: [pair.metrics[1]] * H if heads else pair.metrics[1]
    out: dict[str, list[list[Any]]] = {kind: [[blank() for _ in range(pair.length)] for _ in range(L)]
                                       for kind in kinds}
    for p in range(pair.differs, pair.n):
        cells = [Cell(layer, kind, h) for layer in range(L) for kind in kinds for h in (range(H) if heads else (-1,))]
        for cell, value in zip(cells, run_cells(model, pair, cells, p, report, max_bytes)):
            if heads:
                out[cell.kind][cell.layer][p][cell.head] = value
            else:
                out[cell.kind][cell.layer][p] = value
    return out


# --- the components --------------------------------------------------------------------------------
def patch_heads(model, pair: Pair, report: Report, max_bytes: int) -> list[list[float]]:
    """[L][H]: each head's z at every position patched."""
    L, H = model.config.n_layers, model.config.n_heads
    if pair.differs >= pair.n:  # nothing differs before the metric's position
        return [[pair.metrics[1]] * H for _ in range(L)]
    cells = [Cell(layer, "z", h) for layer in range(L) for h in range(H)]
    values = run_cells(model, pair, cells, pair.differs, report, max_bytes, every=True)
    return [values[layer * H:(layer + 1) * H] for layer in range(L)]


def sender_delta(model, pair: Pair, sender: tuple[int, int]) -> torch.Tensor:
    """(N, C) the sender head's clean-minus-corrupted write into the residual stream: its z @ W_O (times
    the residual multiplier)."""
    assert pair.runs is not None
    layer, head = sender
    D = model.config.d_head
    z = pair.runs.got["z"][layer][:, :, head]  # (2, N, D)
    w_o = model.blocks[layer].attn.proj.weight[:, head * D:(head + 1) * D]  # (C, D)
    return (z[0] - z[1]) @ w_o.t() * model.blocks[layer].residual_multiplier  # (N, C), Granite's multiplier too


def patch_paths(model, pair: Pair, sender: tuple[int, int], report: Report, max_bytes: int) -> dict[str, list]:
    """{"q", "k", "v"} -> [L][H]: the sender's write reaching only that input of that later head; None
    at the sender's layer and below (no path)."""
    L, H = model.config.n_layers, model.config.n_heads
    out: dict[str, list] = {kind: [[None] * H if layer <= sender[0] else [pair.metrics[1]] * H for layer in range(L)]
                            for kind in ("q", "k", "v")}
    if pair.differs >= pair.n or sender[0] == L - 1:
        return out
    cells = [Cell(layer, kind, h) for layer in range(sender[0] + 1, L) for h in range(H) for kind in ("q", "k", "v")]
    values = run_cells(model, pair, cells, pair.differs, report, max_bytes, delta=sender_delta(model, pair, sender))
    for cell, value in zip(cells, values):
        out[cell.kind][cell.layer][cell.head] = value
    return out


KEEPS = {"heads": {"z"}, "heads_by_position": {"z"}, "residual": set(), "layers": {"attn_out", "mlp_out"},
         "paths": {"z"}}


@torch.inference_mode()
def patch(model, clean_ids: list[int], corrupted_ids: list[int], answer_id: int, foil_id: int,
          position: int | None = None, component: str = "heads", sender: tuple[int, int] | None = None,
          report: Report = _no_report, max_bytes: int = PATCH_BYTES) -> PatchResult:
    """Exact activation patching of `component` (module docstring): every cell's patched metric."""
    check_decoder(model, "activation patching")
    check_patch(model.config, clean_ids, corrupted_ids, answer_id, foil_id, position, component, "exact", sender)
    pair = pair_of(model, clean_ids, corrupted_ids, answer_id, foil_id, position)
    run_pair(model, pair, KEEPS[component], report)
    values: Any
    if component == "heads":
        values = patch_heads(model, pair, report, max_bytes)
    elif component == "heads_by_position":
        values = patch_by_position(model, pair, ["z"], True, report, max_bytes)["z"]
    elif component == "residual":
        values = patch_by_position(model, pair, ["resid_pre"], False, report, max_bytes)["resid_pre"]
    elif component == "layers":
        got = patch_by_position(model, pair, ["attn_out", "mlp_out"], False, report, max_bytes)
        values = {"attention": got["attn_out"], "mlp": got["mlp_out"]}
    else:
        assert sender is not None  # check_patch asks for one
        values = patch_paths(model, pair, sender, report, max_bytes)
    return PatchResult(component, "exact", pair.position, pair.differs, pair.metrics[0], pair.metrics[1], values,
                       None if sender is None or component != "paths" else (sender[0], sender[1]))

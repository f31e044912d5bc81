"""Path patching of an encoder-decoder (the translator): from a sender head of any group (encoder,
decoder or cross) to each later head's query, key and value inputs, with the semantics of
patching.py's decoder paths (Wang et al. 2022; TransformerLens's get_act_patch_direct_path).

The edge sender -> receiver input is patched alone: the sender's output is the clean run's, every
other head's output (its z) and every MLP's output stay the corrupted run's, and the stream so made
reaches only that one input of that one receiver head; the rest of the receiver's run (every other
reader, the other heads of its layer included) is the corrupted run, recomputed after the receiver.

    the sender run     the corrupted run from the sender's block on, every head's z and every MLP's
                       output frozen at their corrupted values, the sender head's z at its clean
                       value: each later head's q, k and v as they read that stream
    a receiver's row   the corrupted run from the receiver's block on, its q (k, v) the sender run's

The norms are not components: they are recomputed on the stream they see. In a pre-norm model the
sender run's stream is the corrupted stream plus the sender's write (z @ W_O), exactly the decoder's
paths; in a post-norm one (x = norm(x + sub-layer), the translator) the write reaches a later reader
through the norms in between, each at the scale that stream gives it.

Which inputs a sender reaches directly ("later"), by the order the forward computes them:

    sender     encoder receivers        decoder receivers      cross receivers
    encoder l  q, k, v at layers > l    none                   k, v at every layer (the memory:
                                                               the encoder's last stream, its norm)
    decoder l  none                     q, k, v at layers > l  q at layers >= l (the cross-attention
                                                               of block l reads after the self-attention)
    cross l    none                     q, k, v at layers > l  q at layers > l

An encoder head reaches the decoder's stream only through the cross heads' outputs, which are
frozen: no direct path. Values: {"encoder", "decoder", "cross": {"q", "k", "v": [L][H]}}, the
patched metric (raw), None where the sender has no direct path.

Exact and batched as encoder_decoder_patching.py: one pass of one row for the sender run, then
every receiver a row starting at its own block from the corrupted run (a decoder receiver's row
reads the corrupted memory), many rows a batch. A sender whose clean z equals its corrupted z
(a decoder head of block 0: both runs read the same target) changes nothing: the corrupted metric
everywhere it reaches, without a run.
"""

from __future__ import annotations

import torch

from attnlens.model.analysis import encoder_decoder_runs as runs
from attnlens.model.analysis.block_runs import Report
from attnlens.model.analysis.encoder_decoder_runs import Pair

GROUPS = ("encoder", "decoder", "cross")
FROZEN = ("encoder.z", "decoder.z", "cross.z", "encoder.mlp_out", "decoder.mlp_out")

Cell = tuple[str, int, int]  # (input point "cross.k", layer, head)


def reached(group: str, layer: int, L: int) -> dict[str, dict[str, range]]:
    """receiver group -> input kind -> the layers whose heads' input a sender (group, layer) reaches."""
    none, later = range(0), range(layer + 1, L)
    if group == "encoder":
        return {"encoder": dict.fromkeys("qkv", later), "decoder": dict.fromkeys("qkv", none),
                "cross": {"q": none, "k": range(L), "v": range(L)}}
    return {"encoder": dict.fromkeys("qkv", none), "decoder": dict.fromkeys("qkv", later),
            "cross": {"q": range(layer, L) if group == "decoder" else later, "k": none, "v": none}}


class SenderRun(runs.Recorder):
    """Every head's z and MLP's output set to the corrupted run's, the sender head's z to the clean run's;
    keeps every head's q, k and v inputs (INPUTS) as this stream makes them."""

    def __init__(self, got: dict, sender: tuple[str, int, int]):
        super().__init__(set(runs.INPUTS))
        self.runs, self.sender = got, sender

    def at(self, point, layer, t, fresh):
        if point in FROZEN:
            both = self.runs[point][layer]  # (2, T, H, D) or (2, T, C): clean, corrupted
            t = both[1:2]
            group, s_layer, head = self.sender
            if point == f"{group}.z" and layer == s_layer:
                t = t.clone()
                t[:, :, head] = both[0:1, :, head]  # (1, T, D) the sender's clean z
        return super().at(point, layer, t, fresh)


class PathTap(runs.Tap):
    """Each row's one receiver input (cell: point, layer, head) set to the sender run's, at the block the
    row joins."""

    def __init__(self, cells: list[Cell], sent: dict):
        self.cells, self.sent = cells, sent

    def at(self, point, layer, t, fresh):
        rows = [i for i in range(fresh.start, fresh.stop) if self.cells[i][:2] == (point, layer)]
        if not rows:
            return t
        t = t.clone()  # (R, H, T, D)
        for i in rows:
            head = self.cells[i][2]
            t[i, head] = self.sent[point][layer][0, head]  # (T, D)
        return t


def patch_paths(model, pair: Pair, sender: tuple[str, int, int], report: Report, max_bytes: int
                ) -> dict[str, dict[str, list]]:
    """{group: {"q", "k", "v": [L][H]}}: each receiver input's patched metric (module docstring); `pair`
    has run, keeping FROZEN."""
    assert pair.got is not None
    L, H = model.config.n_layers, model.config.n_heads
    group, layer, head = sender
    reach = reached(group, layer, L)
    corrupted = pair.metrics[1]
    values: dict[str, dict[str, list]] = {
        g: {k: [[corrupted] * H if l in reach[g][k] else [None] * H for l in range(L)] for k in "qkv"} for g in GROUPS}
    join = lambda g, l: l if g == "encoder" else L + l  # a block's index in a pass
    cells = sorted(((f"{g}.{k}", l, h) for g in GROUPS for k in "qkv" for l in reach[g][k] for h in range(H)),
                   key=lambda c: join(c[0].split(".")[0], c[1]))
    z = pair.got.got[f"{group}.z"][layer][:, :, head]  # (2, T, D)
    if not cells or torch.equal(z[0], z[1]):  # no later reader, or the sender writes the same in both runs
        return values
    start = pair.start()
    sent = SenderRun(pair.got.got, sender)
    runs.run_rows(model, [join(group, layer)], start, sent, report)
    chunk = max(1, max_bytes // runs.row_bytes(model, pair.lengths["encoder"], pair.position + 1))
    for i in range(0, len(cells), chunk):
        part = cells[i:i + chunk]
        final = runs.run_rows(model, [join(c[0].split(".")[0], c[1]) for c in part], start,
                              PathTap(part, sent.got), report)
        for (point, l, h), value in zip(part, runs.metric(model, final[:, -1], pair.direction).tolist()):
            g, kind = point.split(".")
            values[g][kind][l][h] = value
    return values

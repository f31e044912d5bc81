"""An encoder-decoder's blocks run by hand (model/families/encoder_decoder.py's forward, module by
module), many rows at once, each joining at its own block, with taps: what patching an
encoder-decoder runs (encoder_decoder_patching.py), as block_runs.py is a decoder's.

Shapes: R = rows, S = source positions, N = target positions computed (the decoder's start token
first, up to the metric's position), C = d_model, H = heads, D = d_head, L = layers a side.

A pass goes through 2L blocks: the encoder's (block g = l), then the decoder's (g = L + l). A row
joins at its own block from the stream `Start` gives there (the run it departs from), so nothing
below its block is recomputed. Rows that went through the encoder read their own memory (the
encoder norm of their last stream) in every cross-attention; rows that joined in the decoder read
the Start's memory. What a Tap sees, by name, per layer:

    encoder.resid_pre, encoder.attn_out, encoder.mlp_out   (R, S, C)
    encoder.z                                              [R, S, H, D]
    decoder.resid_pre, decoder.attn_out, cross.attn_out,
    decoder.mlp_out                                        (R, N, C)
    decoder.z, cross.z                                     [R, N, H, D]  (before the output projection)
    memory (layer 0)                                       (R_e, S, C) the encoder rows' memory
    encoder.q, encoder.k, encoder.v                        (R, H, S, D)  each head's input, as attention
    decoder.q, decoder.k, decoder.v, cross.q               (R, H, N, D)  reads it (INPUTS: path patching
    cross.k, cross.v                                       (R, H, S, D)  edits one head's)

Pre- and post-norm blocks (the family builds no other part); differentiable with autograd on,
through block_runs' linear / norm / ffn (attribution patching takes its gradients here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnlens.model.analysis.block_runs import Report, _param, ffn, linear, norm, project, unembed_direction
from attnlens.model.parts.attention import MultiHeadAttention, causal_mask, sdpa

POINTS = ("encoder.resid_pre", "encoder.z", "encoder.attn_out", "encoder.mlp_out", "decoder.resid_pre", "decoder.z",
          "decoder.attn_out", "cross.z", "cross.attn_out", "decoder.mlp_out")
INPUTS = tuple(f"{group}.{kind}" for group in ("encoder", "decoder", "cross") for kind in "qkv")


def check_blocks(config) -> None:
    """A ValueError (naming the model) for an encoder-decoder whose blocks this module does not run."""
    if config.post_norms or config.residual_multiplier != 1.0 or config.qk_norm or config.attn_softcap is not None:
        raise ValueError("model: this encoder-decoder's blocks (post-sub-layer norms, a residual multiplier, q/k "
                         "norms or a soft-cap) are not run by hand here")


class Tap:
    """What a pass reads and edits at each point (POINTS): returns what the block goes on with. `fresh`
    is the slice of rows that joined at this block (a row is patched at the block it joins)."""

    def at(self, point: str, layer: int, t: torch.Tensor, fresh: slice) -> torch.Tensor:
        return t


class Recorder(Tap):
    """Keeps the points in `want`: got[point][layer] (with autograd on, graph nodes to take gradients at)."""

    def __init__(self, want: set[str]):
        self.want = want
        self.got: dict[str, dict[int, torch.Tensor]] = {name: {} for name in want}

    def at(self, point, layer, t, fresh):
        if point in self.want:
            self.got[point][layer] = t
        return t


@dataclass
class Start:
    """Where rows depart from: the stream entering each block, encoder [L] (1 or R, S, C) and decoder
    [L] (1, N, C) (decoder[0]: the embedded target, where encoder rows enter the decoder), and the
    memory (1, S, C) rows joining in the decoder read (None when every row starts in the encoder)."""

    encoder: list[torch.Tensor]
    decoder: list[torch.Tensor]
    memory: torch.Tensor | None = None


# --- the blocks --------------------------------------------------------------------------------
def _read(block, x: torch.Tensor, ln) -> torch.Tensor:
    """What a sub-layer reads: ln(x) (pre-norm) or x (post-norm)."""
    return norm(ln, x) if block.pre_norm else x


def _add(block, x: torch.Tensor, out: torch.Tensor, ln) -> torch.Tensor:
    """The residual sum: x + out (pre-norm) or ln(x + out) (post-norm)."""
    return x + out if block.pre_norm else norm(ln, x + out)


def _rows_of(attn: MultiHeadAttention, x: torch.Tensor, rows: slice) -> torch.Tensor:
    """x through rows `rows` of the fused qkv projection (cross-attention projects q and kv apart)."""
    w: torch.Tensor | None = attn.qkv.weight
    b: torch.Tensor | None = attn.qkv.bias
    if torch.is_grad_enabled():
        w, b = _param(w), _param(b)
    assert w is not None
    return F.linear(x, w[rows], None if b is None else b[rows])


def memory_kv(attn: MultiHeadAttention, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-attention keys and values (R, H, S, D) of memory (R, S, C), as project_memory."""
    R, S, _ = memory.shape
    H, D = attn.n_heads, attn.d_head
    kv = _rows_of(attn, memory, slice(H * D, None)).view(R, S, 2, H, D)  # (R, S, 2HD) -> (R, S, 2, H, D)
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


def _attend(tap: Tap, group: str, layer: int, attn: MultiHeadAttention, q, k, v, causal: bool,
            fresh: slice) -> torch.Tensor:
    """The attention output (R, Tq, C) of q (R, H, Tq, D) over k, v (R, H, Sk, D), the inputs and z
    through the tap."""
    q, k, v = (tap.at(f"{group}.{kind}", layer, t, fresh) for kind, t in zip("qkv", (q, k, v)))
    R, _, T, _ = q.shape
    mask = causal_mask(T, k.shape[2], device=q.device) if causal else None
    y = sdpa(q, k, v, attn_mask=mask, scale=attn.scale)  # (R, H, T, D)
    z = tap.at(f"{group}.z", layer, y.transpose(1, 2), fresh)  # [R, T, H, D]
    return tap.at(f"{group}.attn_out", layer, linear(attn.proj, z.reshape(R, T, -1)), fresh)


def encoder_block(model, layer: int, x: torch.Tensor, tap: Tap, fresh: slice) -> torch.Tensor:
    """Encoder block `layer` on x (R, S, C): bidirectional self-attention, then the FFN."""
    block = model.encoder.blocks[layer]
    x = tap.at("encoder.resid_pre", layer, x, fresh)
    q, k, v = project(block.attn, _read(block, x, block.ln1), None)
    x = _add(block, x, _attend(tap, "encoder", layer, block.attn, q, k, v, False, fresh), block.ln1)
    mlp = tap.at("encoder.mlp_out", layer, ffn(block.ffn, _read(block, x, block.ln2)), fresh)
    return _add(block, x, mlp, block.ln2)


def decoder_block(model, layer: int, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], tap: Tap,
                  fresh: slice) -> torch.Tensor:
    """Decoder block `layer` on x (R, N, C): causal self-attention, cross-attention over the memory's
    keys and values kv (R, H, S, D), then the FFN."""
    block = model.decoder.blocks[layer]
    x = tap.at("decoder.resid_pre", layer, x, fresh)
    q, k, v = project(block.attn, _read(block, x, block.ln1), None)
    x = _add(block, x, _attend(tap, "decoder", layer, block.attn, q, k, v, True, fresh), block.ln1)
    cross = block.cross_attn
    R, N, _ = x.shape
    q = _rows_of(cross, _read(block, x, block.ln_cross), slice(0, cross.n_heads * cross.d_head))  # (R, N, HD)
    q = q.view(R, N, cross.n_heads, cross.d_head).transpose(1, 2)  # (R, H, N, D)
    x = _add(block, x, _attend(tap, "cross", layer, cross, q, *kv, False, fresh), block.ln_cross)
    mlp = tap.at("decoder.mlp_out", layer, ffn(block.ffn, _read(block, x, block.ln2)), fresh)
    return _add(block, x, mlp, block.ln2)


# --- a pass --------------------------------------------------------------------------------------
def run_rows(model, joins: list[int], start: Start, tap: Tap, report: Report) -> torch.Tensor:
    """Rows joining at their blocks (joins: each row's first block g, non-decreasing), through every block
    to the decoder's last: the final decoder stream (R, N, C), before the decoder norm. report() after
    each block."""
    L = model.config.n_layers
    x: torch.Tensor | None = None
    own: torch.Tensor | None = None  # the memory of the rows that went through the encoder (R_e, S, C)
    joined = 0
    for g in range(joins[0], 2 * L):
        if g == L and x is not None:  # the encoder's rows leave it: their memory, the target's stream
            own = tap.at("memory", 0, norm(model.encoder_norm, x), slice(0, 0))
            x = start.decoder[0].expand(x.shape[0], -1, -1)
        n = 0
        while joined + n < len(joins) and joins[joined + n] == g:
            n += 1
        if n:
            new = (start.encoder[g] if g < L else start.decoder[g - L]).expand(n, -1, -1)
            x = new if x is None else torch.cat([x, new])
        assert x is not None  # the first block is the first row's
        fresh = slice(joined, joined + n)
        joined += n
        if g < L:
            x = encoder_block(model, g, x, tap, fresh)
        else:
            x = decoder_block(model, g - L, x, _cross_kv(model, g - L, own, start.memory, x.shape[0]), tap, fresh)
        report()
    assert x is not None
    return x


def _cross_kv(model, layer: int, own: torch.Tensor | None, memory: torch.Tensor | None, R: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross keys and values (R, H, S, D) of decoder layer `layer`: the encoder rows' own, then the
    shared memory's for the rows that joined in the decoder."""
    attn = model.decoder.blocks[layer].cross_attn
    m = 0 if own is None else own.shape[0]
    parts = [memory_kv(attn, own)] if own is not None else []
    if R > m:
        assert memory is not None, "rows joined in the decoder without a memory to read"
        k, v = memory_kv(attn, memory)  # (1, H, S, D)
        parts.append((k.expand(R - m, -1, -1, -1), v.expand(R - m, -1, -1, -1)))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([parts[0][0], parts[1][0]]), torch.cat([parts[0][1], parts[1][1]])


def row_bytes(model, S: int, N: int) -> int:
    """About what one row of a pass holds at once in a block: streams and sub-layer outputs, q/k/v,
    the attention scores and the FFN's hidden layer (twice: a block's temporaries)."""
    c = model.config
    floats = (S + N) * (8 * c.d_model + 3 * c.n_heads * c.d_head + 2 * c.d_ff) + 2 * c.n_heads * (S * S + N * N + N * S)
    return 2 * floats * torch.finfo(model.dtype).bits // 8


def metric(model, x: torch.Tensor, direction: tuple[torch.Tensor, float]) -> torch.Tensor:
    """The logit difference (R,) float32 of final decoder streams x (R, C): the decoder norm, then the
    direction (block_runs.unembed_direction: two rows of the LM head)."""
    d, b = direction
    return norm(model.decoder_norm, x).float() @ d + b


class Pair:
    """The clean and corrupted sources (2, S), the target cut after the metric's position (1, N), the
    metric's direction, and the two runs' intermediates (row 0 clean, row 1 corrupted) and metrics."""

    def __init__(self, model, clean_ids: list[int], corrupted_ids: list[int], target_ids: list[int] | None,
                 answer_id: int, foil_id: int, position: int | None):
        target = [model.config.decoder_start_id, *(target_ids or [])]
        self.position = len(target) - 1 if position is None else position
        device = model.device
        self.sources = torch.tensor([clean_ids, corrupted_ids], dtype=torch.long, device=device)  # (2, S)
        self.target = torch.tensor([target[:self.position + 1]], dtype=torch.long, device=device)  # (1, N)
        self.lengths = {"encoder": len(clean_ids), "decoder": len(target)}  # the values' S and T
        self.differs = next((i for i, (a, b) in enumerate(zip(clean_ids, corrupted_ids)) if a != b), len(clean_ids))
        self.direction = unembed_direction(model, answer_id, foil_id)
        self.got: Recorder | None = None
        self.metrics = (0.0, 0.0)

    def run(self, model, want: set[str], report: Report) -> torch.Tensor:
        """Both runs side by side, keeping `want` (and what patched rows start from): the metrics (2,)."""
        self.got = Recorder(want | {"encoder.resid_pre", "decoder.resid_pre", "memory"})
        with torch.no_grad():
            source, target = model.embed(self.sources), model.embed(self.target)  # (2, S, C), (1, N, C)
        if torch.is_grad_enabled():  # the graph starts at the streams, not at the embedding's weights
            source, target = source.clone().requires_grad_(), target.clone().requires_grad_()
        start = Start([source], [target])
        final = run_rows(model, [0, 0], start, self.got, report)
        value = metric(model, final[:, -1], self.direction)  # (2,)
        self.metrics = (float(value[0].detach()), float(value[1].detach()))
        return value

    def start(self) -> Start:
        """Where patched rows depart from: the corrupted run."""
        assert self.got is not None
        got, L = self.got.got, len(self.got.got["encoder.resid_pre"])
        return Start([got["encoder.resid_pre"][l][1:2] for l in range(L)],
                          [got["decoder.resid_pre"][l][1:2] for l in range(L)], got["memory"][0][1:2])

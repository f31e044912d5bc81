"""A decoder's blocks run one at a time, from any block and any position, with taps that read and
edit what flows through them: the engine under the causal analyses (patching.py,
attribution_patching.py).

Shapes: R = rows of a pass, T = the sequence's positions, Tn = the positions a pass computes
(start .. end-1), S = end (the keys its queries see), C = d_model, H = query heads, K = key/value
heads, D = d_head.

Why by hand and not model(ids): a patched run differs from the corrupted run only from the patched
block on, and only at the patched positions and after (the model is causal). So a pass starts at
block l from the corrupted run's residual stream, computes only positions start .. end-1 (the keys
and values of the positions before come from the corrupted run, `Span.prefix_*`), and carries many
rows at once: a row joins the batch at its own block (`run_rows`), so one pass over the blocks
serves the cells of every layer, each block's weights read once for all rows. The computation is
the model's own, module by module (its norms, projections, q/k norms, each layer's rotary angles and
mask, attention kernels or its soft-capped explicit path, FFN or mixture of experts, post-norms and
multipliers), in the order model/parts/block.py runs them, for every architecture the decoder
imports (tests/model/test_causes_every_arch.py holds each against the model's own hooked forward).

    Span        the positions a pass computes, each layer's rotary angles and mask, and the prefix's
                keys and values per layer
    Tap         what a pass reads and edits at each point of a block (the base changes nothing)
    Recorder    a Tap that keeps the intermediates asked for, per layer
    run_rows    rows joining at their blocks, through every block to the last: the final residual
    readout, metric     what the logit difference reads of a residual, and its value there

With autograd on (attribution patching), the products are differentiable in the stream only
(`linear`), the norms run the module's own forward on parameters autograd may save (never inference
tensors), a mixture of experts its own forward with those products, and no kernel of ours (they have
no backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
from torch.func import functional_call

from attnlens.model.families.contract import family_of
from attnlens.model.parts import causal_attention
from attnlens.model.parts.attention import MultiHeadAttention, causal_mask, sdpa
from attnlens.model.parts.feedforward import FeedForward, MixtureOfExperts, activate
from attnlens.model.parts.linear import onednn_available, onednn_linear
from attnlens.model.parts.positions import RotaryAngles, apply_rotary

Report = Callable[[], None]


def check_decoder(model, what: str) -> None:
    """A ValueError unless `model` is a decoder (the causal analyses need one causal stream)."""
    name = family_of(model).name
    if name != "decoder":
        raise ValueError(f"{what} needs a decoder (a causal language model); this model is an {name}")


# --- the model's parts, differentiable when autograd is on ---------------------------------------
def _param(p: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter as autograd may save it: detached, and a copy when it is an inference tensor."""
    if p is None:
        return None
    return p.detach().clone() if p.is_inference() else p.detach()


class _InputGradLinear(torch.autograd.Function):
    """y = module(x) by the module's own product (our few-row kernels, oneDNN, a packed matrix's
    kernel); the gradient flows to x only: x -> g W. The analyses differentiate the stream, never the
    weights, and F.linear under autograd takes BLAS's slower x W^T (and a packed weight dequantized)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, module: nn.Module) -> torch.Tensor:  # type: ignore[override]
        ctx.module = module
        return module(x)  # autograd is off in here: the inference product

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        w = ctx.module.weight.detach().to(g.dtype)  # (out, in), a packed one dequantized
        if g.device.type == "cpu" and g.dtype == torch.float32 and onednn_available():
            return onednn_linear(g, w.t()), None  # oneDNN reads W^T as it lies: 2-3x BLAS's g W here
        return g @ w, None  # (..., out) @ (out, in) -> (..., in)


def linear(module, x: torch.Tensor) -> torch.Tensor:
    """module(x); with autograd on, differentiable in x (not in the weights)."""
    if not torch.is_grad_enabled():
        return module(x)
    return _InputGradLinear.apply(x, module)


def norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) (LayerNorm, RMSNorm, HeadLayerNorm or Identity); with autograd on, the module's own
    forward on its parameters as autograd may save them (`_param`)."""
    if not torch.is_grad_enabled() or isinstance(module, nn.Identity):
        return module(x)
    params = {name: p.detach().clone() if p.is_inference() else p.detach() for name, p in module.named_parameters()}
    return functional_call(module, params, (x,))


def ffn(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) (model/parts/feedforward.py: a FeedForward or a MixtureOfExperts); with autograd on,
    written out with `linear` (the mixture: its own forward, each product by `linear` / `ffn`)."""
    if isinstance(module, MixtureOfExperts):
        if not torch.is_grad_enabled():
            return module(x)
        return module(x, apply=lambda part, t: ffn(part, t) if isinstance(part, FeedForward) else linear(part, t))
    if not torch.is_grad_enabled():
        return module(x)
    assert isinstance(module, FeedForward), f"no differentiable form of {type(module).__name__}"
    h = linear(module.fc, x)  # (R, Tn, F), gated: (R, Tn, 2F)
    if module.gated:
        gate, up = h.chunk(2, dim=-1)
        h = activate(gate, module.activation) * up
    else:
        h = activate(h, module.activation)
    return linear(module.proj, h)


def qk_norm(attn: MultiHeadAttention, module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """(R, N, T, D) queries or keys through q_norm / k_norm as MultiHeadAttention.norm_q: per head
    (Qwen3, Gemma 3; StableLM 2's LayerNorm of each head's own weights) or over all N * D values of a
    position at once (OLMo 2)."""
    if attn.qk_norm_all:
        return attn.norm_heads(t, lambda u: norm(module, u))
    return norm(module, t)


def project(attn: MultiHeadAttention, h: torch.Tensor, rope: RotaryAngles | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (R, H, Tn, D), k, v (R, K, Tn, D) of the normalised input h (R, Tn, C): the fused projection,
    the q/k norm (qk_norm) and rotary positions, as MultiHeadAttention.project."""
    R, T, _ = h.shape
    H, K, D = attn.n_heads, attn.n_kv_heads, attn.d_head
    heads = linear(attn.qkv, h).view(R, T, H + 2 * K, D).transpose(1, 2)  # (R, T, (H+2K)D) -> (R, H+2K, T, D)
    q, k, v = heads[:, :H], heads[:, H:H + K], heads[:, H + K:]
    if attn.q_norm is not None and attn.k_norm is not None:  # both or neither (config.qk_norm)
        q, k = qk_norm(attn, attn.q_norm, q), qk_norm(attn, attn.k_norm, k)
    if rope is not None:
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
    return q, k, v


def attend(attn: MultiHeadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           plain: bool) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v: q (R, H, Tq, D), k, v (R, K or H, S, D), mask (Tq, S) -> (R, H, Tq, D).
    `plain`: the mask is causality alone (queries at the last Tq of S positions), which our C kernel
    may take (a long prefill on the CPU, no autograd). Soft-capped scores (Gemma 2): the layer's own
    explicit formula (no fused kernel caps)."""
    if attn.softcap is not None:
        return attn.explicit_attention(q, k, v, mask, False, 0.0)[0]
    if plain:
        y = causal_attention.causal_attention(q, k, v, attn.scale)
        if y is not None:
            return y
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return sdpa(q, k, v, attn_mask=mask, scale=attn.scale, **gqa)


# --- a pass ------------------------------------------------------------------------------------
@dataclass
class Span:
    """The positions a pass computes, start .. end-1 of one sequence, each layer's rotary angles and
    mask (Gemma 2/3: sliding-window and full layers, Gemma 3's sliding layers with their own rotary
    base), and what its attention reads of the positions before: each layer's keys and values as
    attention reads them (after the q/k norm and rotary positions), (1, K, start, D), from the run the
    pass departs from."""

    start: int
    end: int
    ropes: list[RotaryAngles | None]  # per layer
    masks: list[torch.Tensor]  # per layer (Tn, S) True = may attend
    plains: list[bool]  # per layer: its mask is causality alone (no sliding window)
    prefix_keys: list[torch.Tensor] = field(default_factory=list)
    prefix_values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.end - self.start

    def with_prefix(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (R, K', Tn, D) preceded by the prefix's (R, K', start, D): (R, K', S, D). K' = H when a
        tap gave each query head its own keys (path patching); the prefix is then repeated per group."""
        if self.start == 0:
            return k, v
        pk, pv = self.prefix_keys[layer], self.prefix_values[layer]  # (1, K, start, D)
        if k.shape[1] != pk.shape[1]:
            G = k.shape[1] // pk.shape[1]
            pk, pv = pk.repeat_interleave(G, dim=1), pv.repeat_interleave(G, dim=1)  # (1, H, start, D)
        R = k.shape[0]
        return (torch.cat([pk.expand(R, -1, -1, -1), k], dim=2),
                torch.cat([pv.expand(R, -1, -1, -1), v], dim=2))


def span(model, start: int, end: int, prefix: "Recorder | None" = None, row: int = 0) -> Span:
    """Positions start .. end-1 of a sequence of `end` tokens; the keys and values of the positions
    before from row `row` of `prefix` (a Recorder that kept "keys" and "values")."""
    n = end - start
    causal = causal_mask(n, end, device=model.device)  # (Tn, S): query i at position start + i
    masks = model.window_masks(n, end, start=start, mask=causal)  # per layer: causal, or causal & its window
    out = Span(start, end, model.layer_rotary_angles(n, start=start), masks, [m is causal for m in masks])
    if start and prefix is not None:
        L = model.config.n_layers
        out.prefix_keys = [prefix.got["keys"][l][row:row + 1, :, :start] for l in range(L)]
        out.prefix_values = [prefix.got["values"][l][row:row + 1, :, :start] for l in range(L)]
    return out


class Tap:
    """What a pass reads and edits at each point of a block. `fresh` is the slice of the batch's rows
    that joined at this block (edits are theirs: a row is patched at the block it joins). Each
    method returns the tensor the block goes on with; the base changes nothing."""

    def resid_pre(self, layer: int, x: torch.Tensor, fresh: slice) -> torch.Tensor:
        return x  # (R, Tn, C) the block's input

    def qkv(self, layer: int, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fresh: slice):
        return q, k, v  # the block's input x, q (R, H, Tn, D), k, v (R, K, Tn, D) of this pass's positions

    def z(self, layer: int, z: torch.Tensor, fresh: slice) -> torch.Tensor:
        return z  # [R, Tq, H, D] each head's output before the output projection

    def attn_out(self, layer: int, out: torch.Tensor, fresh: slice) -> torch.Tensor:
        return out  # (R, Tq, C)

    def mlp_out(self, layer: int, out: torch.Tensor, fresh: slice) -> torch.Tensor:
        return out  # (R, Tq, C)


class Recorder(Tap):
    """Keeps, per layer, the intermediates named in `want`: resid_pre, keys, values (as attention
    reads them), z, attn_out, mlp_out. got[name][layer] is the tensor the block went on with (with
    autograd on, a node of the graph: gradients can be taken at it)."""

    def __init__(self, want: set[str]):
        self.want = want
        self.got: dict[str, dict[int, torch.Tensor]] = {name: {} for name in want}

    def _keep(self, name: str, layer: int, t: torch.Tensor) -> torch.Tensor:
        if name in self.want:
            self.got[name][layer] = t
        return t

    def resid_pre(self, layer, x, fresh):
        return self._keep("resid_pre", layer, x)

    def qkv(self, layer, x, q, k, v, fresh):
        self._keep("keys", layer, k)
        self._keep("values", layer, v)
        return q, k, v

    def z(self, layer, z, fresh):
        return self._keep("z", layer, z)

    def attn_out(self, layer, out, fresh):
        return self._keep("attn_out", layer, out)

    def mlp_out(self, layer, out, fresh):
        return self._keep("mlp_out", layer, out)


def block_step(model, layer: int, x: torch.Tensor, sp: Span, tap: Tap, fresh: slice, last: bool) -> torch.Tensor:
    """Block `layer` on x (R, Tn, C), as model/parts/block.py runs it: pre-LN, post-LN, parallel (GPT-J:
    one norm for both), Gemma's post-norms of each sub-layer's output, OLMo 2's post-norms alone,
    Granite's residual multiplier. `last`: only the last position's query, attention output and FFN
    (the keys and values of every position still made): the last block, where only the final
    position's residual is read."""
    block = model.blocks[layer]
    attn = block.attn
    m = block.residual_multiplier
    h = norm(block.ln1, x) if block.pre_norm else x  # ln1 is the Identity without pre-norms (OLMo 2)
    q, k, v = tap.qkv(layer, x, *project(attn, h, sp.ropes[layer]), fresh)
    k, v = sp.with_prefix(layer, k, v)  # (R, K', S, D)
    mask = sp.masks[layer]
    if last:  # the last query: (R, H, 1, D), (R, 1, C), (1, S)
        q, x, h, mask = q[:, :, -1:], x[:, -1:], h[:, -1:], mask[-1:]
    R, Tq = x.shape[0], x.shape[1]
    y = attend(attn, q, k, v, mask, sp.plains[layer] and not last)  # (R, H, Tq, D)
    z = tap.z(layer, y.transpose(1, 2), fresh)  # [R, Tq, H, D]
    out = linear(attn.proj, z.reshape(R, Tq, -1))  # [R, Tq, H, D] -> (R, Tq, HD) -> (R, Tq, C)
    if block.ln1_post is not None:  # Gemma, OLMo 2: the sub-layer's output normalised
        out = norm(block.ln1_post, out)
    if m != 1.0:  # Granite
        out = out * m
    out = tap.attn_out(layer, out, fresh)
    if block.parallel:  # GPT-NeoX: both sub-layers read the block's input, one residual sum
        mlp = ffn(block.ffn, h if block.shared_norm else norm(block.ln2, x))  # GPT-J: ln1(x) for both
        if m != 1.0:
            mlp = mlp * m
        return tap.mlp_out(layer, mlp, fresh) + out + x
    if not block.pre_norm:  # post-LN
        x = norm(block.ln1, x + out)
        return norm(block.ln2, x + tap.mlp_out(layer, ffn(block.ffn, x), fresh))
    x = x + out
    mlp = ffn(block.ffn, norm(block.ln2, x))
    if block.ln2_post is not None:
        mlp = norm(block.ln2_post, mlp)
    if m != 1.0:
        mlp = mlp * m
    return x + tap.mlp_out(layer, mlp, fresh)


def run_rows(model, sp: Span, joins: list[int], enter: Callable[[int, int], torch.Tensor], tap: Tap,
             report: Report, *, last_only: bool = True) -> torch.Tensor:
    """Rows that join a pass at their own blocks, through every block to the last.

    joins: each row's first block, non-decreasing; enter(layer, n) gives the (n or 1, Tn, C) residual
    stream the n rows joining at `layer` start from (the run they depart from, broadcast). A row's
    blocks below its first are those of that run, not recomputed. Returns the final residual stream
    (R, 1, C) at the last position (every position with last_only=False: (R, Tn, C)). report() after
    each block."""
    L = model.config.n_layers
    x: torch.Tensor | None = None
    joined = 0
    for layer in range(joins[0], L):
        n = 0
        while joined + n < len(joins) and joins[joined + n] == layer:
            n += 1
        if n:
            new = enter(layer, n).expand(n, -1, -1)  # (n, Tn, C)
            x = new if x is None else torch.cat([x, new])
        assert x is not None  # the first layer is the first row's
        fresh = slice(joined, joined + n)
        joined += n
        x = tap.resid_pre(layer, x, fresh)
        x = block_step(model, layer, x, sp, tap, fresh, last_only and layer == L - 1)
        report()
    assert x is not None
    return x


def row_bytes(model, sp: Span) -> int:
    """About what one row of a pass over `sp` holds at once in a block: its residual and sub-layer
    outputs, q/k/v with the prefix repeated, the attention scores and the FFN's hidden layer."""
    c = model.config
    n, S = sp.length, sp.end
    floats = (n * (6 * c.d_model + (c.n_heads + 2 * c.kv_heads) * c.d_head + 3 * c.d_ff)
              + 4 * c.n_heads * S * c.d_head + 2 * c.n_heads * n * S)
    return 2 * floats * torch.finfo(model.dtype).bits // 8  # twice: a block's temporaries


# --- the metric --------------------------------------------------------------------------------
def unembed_rows(model, ids: list[int]) -> torch.Tensor:
    """The LM head's rows of `ids` (n, C) (a packed head's dequantized)."""
    head = model.lm_head
    index = torch.tensor(ids, dtype=torch.long, device=model.device)
    packed = getattr(head, "packed", None)
    if packed is not None:
        return packed.dequantize(index.cpu()).to(model.device)
    return head.weight.detach()[index]


def unembed_direction(model, answer: int, foil: int) -> tuple[torch.Tensor, float]:
    """(C,) float32 W_U[answer] - W_U[foil] and the head's bias difference: the head's logit(answer) -
    logit(foil) = ln_f(x) . direction + bias (before the model's divisor and soft-cap: `Readout`)."""
    rows = unembed_rows(model, [answer, foil]).float()
    bias = getattr(model.lm_head, "bias", None)
    b = 0.0 if bias is None else float(bias[answer] - bias[foil])
    return rows[0] - rows[1], b


class Readout(NamedTuple):
    """What the metric reads of the final residual stream: the answer's and the foil's LM-head rows
    (2, C) float32 and biases (2,), then the model's own unembed's divisor (Granite) and soft-cap
    (Gemma 2), as Transformer.unembed applies them."""

    rows: torch.Tensor
    biases: torch.Tensor
    divisor: float
    cap: float | None


def readout(model, answer: int, foil: int) -> Readout:
    """The Readout of logit(answer) - logit(foil)."""
    rows = unembed_rows(model, [answer, foil]).float()  # (2, C)
    bias = getattr(model.lm_head, "bias", None)
    biases = torch.zeros(2) if bias is None else bias.detach()[[answer, foil]].float().cpu()
    return Readout(rows, biases.to(rows.device).clone(), model.config.logits_divisor, model.config.final_softcap)


def metric(model, x: torch.Tensor, r: Readout) -> torch.Tensor:
    """The logit difference (R,) float32 of final residual streams x (R, C): the final norm, the two
    rows of the LM head (never the whole vocabulary), the divisor and the soft-cap of Transformer.unembed."""
    logits = norm(model.ln_f, x).float() @ r.rows.t() + r.biases  # (R, 2)
    if r.divisor != 1.0:
        logits = logits / r.divisor
    if r.cap is not None:
        logits = torch.tanh(logits / r.cap) * r.cap
    return logits[:, 0] - logits[:, 1]

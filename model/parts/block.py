"""One transformer block: attention [+ cross-attention] + FFN, each a residual sub-layer.

Shapes: B = batch, T = query positions, S = key positions, C = d_model, H = query heads.

    pre-LN (GPT-2, Llama):    x = x + attn(ln1(x));  x = x + ffn(ln2(x))
    post-LN (Vaswani, BERT):  x = ln1(x + attn(x));  x = ln2(x + ffn(x))
    parallel (GPT-NeoX):      x = x + attn(ln1(x)) + ffn(ln2(x))    one sum, both read x
    parallel, one norm (GPT-J): x = x + attn(ln1(x)) + ffn(ln1(x))
    pre + post (Gemma 2/3):   x = x + ln1_post(attn(ln1(x)));  x = x + ln2_post(ffn(ln2(x)))
    post only (OLMo 2):       x = x + ln1_post(attn(x));       x = x + ln2_post(ffn(x))

Granite multiplies each sub-layer's output by config.residual_multiplier before the sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from attnlens.model import hooks as _hooks
from attnlens.model.config import ModelConfig
from attnlens.model.hooks import HookPoint
from attnlens.model.parts.attention import KVUpdate, MultiHeadAttention
from attnlens.model.parts.feedforward import FeedForward, MixtureOfExperts
from attnlens.model.parts.norms import make_norm
from attnlens.model.parts.positions import RotaryAngles


class BlockOutput(NamedTuple):
    x: torch.Tensor  # (B, T, C)
    self_attention: torch.Tensor | None  # (B, H, T, T or S) with return_attention, else None
    cross_attention: torch.Tensor | None  # (B, H, T, S_memory); None without cross-attention


class Block(nn.Module):
    """Self-attention [+ cross-attention] + FFN, each a residual sub-layer with its norm
    (LayerNorm or RMSNorm, config.norm_type).

    Parameter names (ln1, attn, ln2, ffn) are those of the saved checkpoints and GPT-2 interop;
    the cross-attention sub-layer (ln_cross, cross_attn) exists only with cross_attention=True.

    Hook points (model/hooks.py), all [B, T, C]: hook_resid_pre, hook_attn_out, hook_cross_out
    (with cross-attention), hook_mlp_out, hook_resid_post. The forward calls them only under
    active hooks, and goes on with what they return.
    """

    def __init__(self, config: ModelConfig, *, causal: bool = True, cross_attention: bool = False):
        super().__init__()
        self.causal = causal
        self.pre_norm = config.norm == "pre"
        self.parallel = config.parallel_residual
        self.shared_norm = config.parallel_shared_norm  # GPT-J: the FFN reads ln1(x) too (no ln2)
        self.residual_multiplier = config.residual_multiplier  # Granite: each sub-layer's output times this
        # the hook points in the order the forward passes them (no parameters: no checkpoint keys)
        self.hook_resid_pre = HookPoint()
        self.ln1 = make_norm(config) if config.pre_norms else nn.Identity()  # OLMo 2: none
        self.attn = MultiHeadAttention(config, rotary=config.positional == "rotary")
        self.hook_attn_out = HookPoint()
        self.ln_cross: nn.Module | None = None
        self.cross_attn: MultiHeadAttention | None = None
        if cross_attention:  # the encoder-decoder's decoder: attend to the encoder's output
            self.ln_cross = make_norm(config)
            self.cross_attn = MultiHeadAttention(config)
            self.hook_cross_out = HookPoint()
        self.ln2 = make_norm(config) if config.pre_norms and not self.shared_norm else nn.Identity()
        self.ffn = MixtureOfExperts(config) if config.n_experts else FeedForward(config)  # Mixtral: experts
        # Gemma's norms of each sub-layer's output, before it joins the residual (config.post_norms)
        self.ln1_post = make_norm(config) if config.post_norms else None
        self.ln2_post = make_norm(config) if config.post_norms else None
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def _input(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """What a sub-layer reads: ln(x) before the sum (pre-LN), x itself (post-LN)."""
        return norm(x) if self.pre_norm else x

    def _ffn_of(self, hooks: _hooks.Hooks | None, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """ffn(norm(x)) (B, T, C); a long prompt under a reporting call in pieces of positions
        (hooks.row_pieces), a progress point between (a mixture of experts, whose hook points see
        every position, in one)."""
        macs = getattr(self.ffn, "macs_per_row", None)
        pieces = None if macs is None or hooks is None else _hooks.row_pieces(x.shape[1], lambda t: macs * x.shape[0] * t)
        if pieces is None:
            return self.ffn(x if norm is None else norm(x))
        parts = []
        for a, b in pieces:
            part = x[:, a:b]
            parts.append(self.ffn(part if norm is None else norm(part)))  # (B, b - a, C)
            if b < x.shape[1]:
                _hooks.piece_done()
        return torch.cat(parts, dim=1)

    def _residual(self, x: torch.Tensor, out: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """x + sub(ln(x)) (pre-LN) or ln(x + sub(x)) (post-LN), given out = the sub-layer's output."""
        return x + out if self.pre_norm else norm(x + out)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        kv_update: KVUpdate | None = None,
        return_attention: bool = False,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        memory_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope: RotaryAngles | None = None,
    ) -> BlockOutput:
        hooks = _hooks.active()  # None (the common case): no hook point is called
        if hooks is not None:
            given = hooks.given.get(self.hook_resid_post.name) if hooks.given else None
            if given is not None:  # this block's output, given (Hooks.given): not recomputed
                return BlockOutput(given, None, None)
            x = self.hook_resid_pre(x)  # (B, T, C)
        h = self._input(x, self.ln1)
        out, self_probs = self.attn(h, mask=mask, causal=self.causal, kv_update=kv_update,
                                    return_attention=return_attention, rope=rope)
        if self.ln1_post is not None:
            out = self.ln1_post(out)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        if hooks is not None:
            out = self.hook_attn_out(out)
        cross_probs = None
        if self.parallel:  # GPT-NeoX: the FFN reads the block's input too; one residual sum
            mlp = self._ffn_of(hooks, h) if self.shared_norm else self._ffn_of(hooks, x, self.ln2)
            if self.residual_multiplier != 1.0:
                mlp = mlp * self.residual_multiplier
            if hooks is not None:
                mlp = self.hook_mlp_out(mlp)
            x = mlp + out + x
        else:
            x = self._residual(x, out, self.ln1)
            if self.cross_attn is not None:
                if memory is None and memory_kv is None:
                    raise ValueError("this block has cross-attention: pass the encoder output as memory "
                                     "(or its projected keys/values as memory_kv)")
                assert self.ln_cross is not None  # made with cross_attn
                out, cross_probs = self.cross_attn(self._input(x, self.ln_cross), memory, mask=memory_mask,
                                                   return_attention=return_attention, memory_kv=memory_kv)
                if hooks is not None:
                    out = self.hook_cross_out(out)
                x = self._residual(x, out, self.ln_cross)
            mlp = self._ffn_of(hooks, x, self.ln2 if self.pre_norm else None)
            if self.ln2_post is not None:
                mlp = self.ln2_post(mlp)
            if self.residual_multiplier != 1.0:
                mlp = mlp * self.residual_multiplier
            if hooks is not None:
                mlp = self.hook_mlp_out(mlp)
            x = self._residual(x, mlp, self.ln2)
        if hooks is not None:
            x = self.hook_resid_post(x)  # (B, T, C)
        return BlockOutput(x, self_probs, cross_probs)

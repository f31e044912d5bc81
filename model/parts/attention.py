"""Scaled dot-product attention with its masks, and the multi-head attention layer.

Shapes: B = batch, T = query positions (new tokens in this call), S = key positions the
queries may see (cached + new, or the memory's length for cross-attention), C = d_model,
H = query heads, K = key/value heads (H for multi-head, fewer for grouped-query, 1 for
multi-query attention), G = H / K query heads per key/value head, D = d_head.

    sliding_window_mask  (..., T, S) a query sees only its last `window` positions (Mistral)
    InPlaceDecode        a cache's layer that attends a decode step where its keys lie
    MultiHeadAttention   self-attention (keys/values from x) or cross-attention (from `memory`);
                         an optional RMSNorm per head on queries and keys (Qwen3's q_norm /
                         k_norm); rotary positions on queries and keys; grouped-query attention; the
                         device's attention backend (attention_backends.py, chosen once per device),
                         or the explicit path that also returns the (B, H, T, S) probabilities: one
                         map per query head
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlens.model import hooks as _hooks
from attnlens.model.config import ModelConfig
from attnlens.model.hooks import HookPoint
from attnlens.model.parts.attention_backends import (  # noqa: F401  (causal_mask, sdpa, fixed_shapes: re-exported)
    backend_for,
    causal_mask,
    emit_for,
    fixed_shapes,
    full_mask,
    one_query_attention,
    sdpa,
)
from attnlens.model.parts.causal_attention import Emit
from attnlens.model.parts.linear import Linear
from attnlens.model.parts.norms import HeadLayerNorm, RMSNorm
from attnlens.model.parts.positions import RotaryAngles, apply_rotary

# Stores this call's new (B, K, T, D) keys/values and returns all (B, K, S, D) keys/values
# the queries may see (see KVCache.begin): how a cache reaches one attention module.
KVUpdate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class InPlaceDecode:
    """A cache layer's KVUpdate that can also attend a decode step over its keys where they lie
    (model/paged_kv_cache.py's blocks): store this step's keys and values, then attend. None when
    this call cannot (not a decode step, or the family narrowed the rows' mask: a sliding window)."""

    def decode_in_place(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        want_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        raise NotImplementedError

def sliding_window_mask(query_positions: torch.Tensor, n_keys: int, window: int) -> torch.Tensor:
    """(..., T) absolute query positions -> (..., T, S) boolean mask, True where key k is within
    the query's window: k > q - window (the query itself and the window - 1 before it, as
    Mistral's reference code and transformers count). Causality is applied separately."""
    keys = torch.arange(n_keys, device=query_positions.device)  # (S,)
    return keys > (query_positions[..., None] - window)


class MultiHeadAttention(nn.Module):
    """softmax(Q K^T * scale + mask) V per query head (scale = 1/sqrt(D) or config.attn_scale, the
    `scale` attribute; with config.attn_softcap the scores are capped first: cap * tanh(s / cap)),
    then an output projection.

    The input projection is one fused ((H + 2K) D, C) matrix `qkv` (rows: q, then k, then v),
    the layout of GPT-2's c_attn and of nn.MultiheadAttention's in_proj_weight when K = H.
    Self-attention projects x through all of it; cross-attention projects x through the q rows
    and `memory` through the k and v rows. Its bias is config.qkv_bias, the output projection's
    config.attn_out_bias (Qwen2: the first only).

    Grouped-query attention (K < H): query head h reads key/value head h // G, the heads of
    one group side by side, as transformers' repeat_kv lays them out. Keys and values are never
    repeated: the cache holds K heads, and the G queries of a group meet its keys in one product.

    Q/K norm (config.qk_norm, Qwen3): `q_norm` and `k_norm`, RMSNorms over the D dims of each
    head (weights of size D, eps config.layer_norm_eps; OLMo 2, config.qk_norm_over="all": over
    all H * D queries / K * D keys of a position; StableLM 2, "own": a LayerNorm per head with the
    head's own weights), normalise every query and key right
    after the projection (`project`, `project_memory`): before rotary positions, the cache,
    the hook points (hook_q / hook_k and what follows see the normalised ones) and every path
    below. Without it both are None.

    Rotary positions (`rope`, the angles of this call's positions) rotate queries and keys
    before the keys reach the cache.

    Hook points (model/hooks.py), submodules named as TransformerLens names them: hook_q, hook_k,
    hook_v, hook_pattern, hook_z, and with `rotary` hook_rot_q, hook_rot_k. The forward calls them
    only under active hooks; what they return is what it computes on with (an ablation edits z).

    Masking: `mask` (bool, broadcastable to (B, H, T, S), True = may attend) and `causal`
    (query i, at absolute position S - T + i, sees keys up to that position) both apply
    when both are given. A masked key gets exactly zero probability.
    """

    def __init__(self, config: ModelConfig, *, rotary: bool = False):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.groups = self.n_heads // self.n_kv_heads
        self.d_head = config.d_head
        self.scale = config.scores_scale  # the scores' factor (1/sqrt(D) or attn_scale): every path and view reads it
        # Gemma 2's soft-cap: scores = cap * tanh(scores / cap) before the mask. No backend's fused
        # kernel applies it: with a cap every call takes the explicit path
        self.softcap = config.attn_softcap
        self.dropout = config.dropout
        H, K, D = self.n_heads, self.n_kv_heads, self.d_head
        self.qkv = Linear(config.d_model, (H + 2 * K) * D, bias=config.bias_of("qkv"))
        self.proj = Linear(H * D, config.d_model, bias=config.bias_of("attn_out"))
        self.resid_dropout = nn.Dropout(config.dropout)
        # Qwen3's q/k norm: one RMSNorm over each head's D dims for the queries, one for the keys
        # (OLMo 2: over all heads at once, H * D and K * D wide, before the split: qk_norm_over="all")
        self.qk_norm_all = config.qk_norm_over == "all"
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if config.qk_norm and config.qk_norm_over == "own":  # StableLM 2: a LayerNorm of each head's own weights
            self.q_norm = HeadLayerNorm(H, D, eps=config.layer_norm_eps)
            self.k_norm = HeadLayerNorm(K, D, eps=config.layer_norm_eps)
        elif config.qk_norm:
            self.q_norm = RMSNorm(H * D if self.qk_norm_all else D, eps=config.layer_norm_eps)
            self.k_norm = RMSNorm(K * D if self.qk_norm_all else D, eps=config.layer_norm_eps)
        # the hook points in the order the forward passes them; with rotary positions hook_q / hook_k
        # are before rotation, hook_rot_q / hook_rot_k after
        self.hook_q, self.hook_k = HookPoint(), HookPoint()  # [B, T, H, D], [B, S, K, D]
        if rotary:
            self.hook_rot_q, self.hook_rot_k = HookPoint(), HookPoint()  # [B, T, H, D], [B, S, K, D]
        self.hook_v = HookPoint()  # [B, S, K, D]
        self.hook_pattern = HookPoint()  # [B, H, T, S]
        self.hook_z = HookPoint()  # [B, T, H, D], before the output projection

    def project(self, x: torch.Tensor, memory: torch.Tensor | None, memory_kv=None, rope: RotaryAngles | None = None,
                hooks=None):
        """q (B, H, T, D) from x; k, v (B, K, S, D) from x, or from memory for cross-attention
        (or `memory_kv`, memory's keys and values already projected by `project_memory`);
        with `rope`, q and k of self-attention rotated by their positions (with `hooks`, q and
        k before rotation are kept as hook_q / hook_k of this call's new positions). With
        q_norm / k_norm, q and k are normalised per head first: every caller sees them so."""
        B, T, _ = x.shape
        H, K, D = self.n_heads, self.n_kv_heads, self.d_head
        if memory is None and memory_kv is None:
            # (B, T, (H + 2K) D) -> (B, H + 2K, T, D): the q heads, then k's, then v's, as views
            heads = self.qkv(x).view(B, T, H + 2 * K, D).transpose(1, 2)
            if rope is not None and self.q_norm is None and hooks is None:
                # q and k rotated as one (B, H + K, T, D) tensor: one set of operators for both
                qk = apply_rotary(heads[:, :H + K], rope)
                return qk[:, :H], qk[:, H:], heads[:, H + K:]
            q, k, v = heads[:, :H], heads[:, H:H + K], heads[:, H + K:]
            if self.q_norm is not None and self.k_norm is not None:  # both or neither (config.qk_norm)
                q, k = self.norm_q(q), self.norm_k(k)
            if rope is not None:
                if hooks is not None:  # (B, H, T, D) <-> [B, T, H, D], views both ways
                    q = self.hook_q(q.transpose(1, 2)).transpose(1, 2)
                    k = self.hook_k(k.transpose(1, 2)).transpose(1, 2)
                q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            return q, k, v
        w, b = self.qkv.weight, self.qkv.bias
        q = F.linear(x, w[:H * D], None if b is None else b[:H * D])  # (B, T, HD)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, T, HD) -> (B, H, T, D)
        if self.q_norm is not None:
            q = self.norm_q(q)
        if memory_kv is None:
            assert memory is not None  # the first branch took every call with neither
            memory_kv = self.project_memory(memory)
        k, v = memory_kv
        return q, k, v

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values (B, K, S, D) of memory (B, S, C): computed once per
        source and reused at every decoding step (the encoder-decoder's cross K/V cache)."""
        B, S, _ = memory.shape
        HD, K, D = self.n_heads * self.d_head, self.n_kv_heads, self.d_head
        w, b = self.qkv.weight, self.qkv.bias
        kv = F.linear(memory, w[HD:], None if b is None else b[HD:])  # (B, S, 2KD)
        k, v = kv.view(B, S, 2, K, D).permute(2, 0, 3, 1, 4).unbind(0)  # 2 x (B, K, S, D)
        if self.k_norm is not None:
            k = self.norm_k(k)
        return k, v

    def norm_q(self, q: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) queries through q_norm: per head, or over all H * D at once (qk_norm_all)."""
        assert self.q_norm is not None
        return self.norm_heads(q, self.q_norm) if self.qk_norm_all else self.q_norm(q)

    def norm_k(self, k: torch.Tensor) -> torch.Tensor:
        """(B, K, S, D) keys through k_norm, as norm_q."""
        assert self.k_norm is not None
        return self.norm_heads(k, self.k_norm) if self.qk_norm_all else self.k_norm(k)

    @staticmethod
    def norm_heads(x: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """(B, N, T, D) -> the same, normalised by `norm` (a module over N * D) over the N * D values of
        each position (block_runs passes its differentiable form)."""
        B, N, T, D = x.shape
        flat = x.transpose(1, 2).reshape(B, T, N * D)  # (B, T, N D)
        return norm(flat).view(B, T, N, D).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        causal: bool = False,
        kv_update: KVUpdate | None = None,
        return_attention: bool = False,
        memory_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        rope: RotaryAngles | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, C) output and, with return_attention, the (B, H, T, S) probabilities (else None)."""
        B, T, _ = x.shape
        hooks = _hooks.active()
        q, k, v = self.project(x, memory, memory_kv, rope, hooks)
        keep_probs = return_attention
        in_place = None
        if kv_update is not None:
            # a decode step over a cache in blocks attends where the keys lie (model/paged_kv_cache.py),
            # unless hooks read the keys (the cache says when else it cannot: InPlaceDecode)
            if isinstance(kv_update, InPlaceDecode) and T == 1 and hooks is None and not self.training \
                    and self.softcap is None:
                in_place = kv_update.decode_in_place(q, k, v, self.scale, return_attention)
            if in_place is None:
                k, v = kv_update(k, v)  # (B, K, S, D): the cached keys/values followed by the new ones
        if hooks is not None:
            q, k, v = self._hook_inputs(q, k, v, rope is not None)
            return_attention = return_attention or hooks.wants(self.hook_pattern.name)
        dropout_p = self.dropout if self.training else 0.0
        # causality at T == 1 lets the single newest query see every key: nothing to mask
        causal = causal and T > 1

        if in_place is not None:
            y, probs = in_place
        elif return_attention or self.softcap is not None:
            y, probs = self.explicit_attention(q, k, v, mask, causal, dropout_p, hooked=hooks is not None)
        else:
            probs = None
            # under hooks, maps asked of this module (attention_backends.emitting) are made by its kernel
            emit = emit_for(self.hook_z.name.removesuffix(".hook_z")) if hooks is not None else None
            y = self.attend(q, k, v, mask, causal, dropout_p, emit)

        if hooks is not None:  # (B, H, T, D) <-> [B, T, H, D]; kept as computed, then ablated
            y = self.hook_z(y.transpose(1, 2)).transpose(1, 2)
        y = self.proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, H, T, D) -> (B, T, HD), project
        if self.training:  # dropout is the identity at inference; skip the call when decoding
            y = self.resid_dropout(y)
        return y, probs if keep_probs else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
               dropout_p: float, emit: Emit | None = None) -> torch.Tensor:
        """The device's backend on q (B, H, T, D), k, v (B, K, S, D) -> (B, H, T, D); a long prompt
        under a reporting call in pieces of query rows (hooks.row_pieces), a progress point between.
        `emit`: maps the backend's kernel makes too (attention_backends.emitting), piece by piece;
        done only when every piece made its rows."""
        B, H, T, D = q.shape
        S = k.shape[2]
        backend = backend_for(q.device.type)
        pieces = None
        # rows split freely where a mask only names keys (padding); the hooks are read at a prompt only
        if T > 1 and (mask is None or mask.shape[-2] == 1) and _hooks.active() is not None:
            offset = S - T  # query t sees keys up to offset + t (causal), or all S
            pieces = _hooks.row_pieces(T, (lambda t: 2 * B * H * D * (t * offset + t * (t + 1) / 2)) if causal
                                       else (lambda t: 2 * B * H * D * S * t))
        if pieces is None:
            return backend.attend(q, k, v, mask=mask, causal=causal, scale=self.scale, dropout_p=dropout_p,
                                  emit=emit)
        if len(pieces) > 1 and pieces[-1][1] - pieces[-1][0] == 1:  # a causal prompt's kernel takes 2 rows at least
            pieces[-2:] = [(pieces[-2][0], pieces[-1][1])]
        out = q.new_empty(B, T, H, D)
        made = True  # every piece made the emit's rows
        for a, b in pieces:
            keys = S - T + b if causal else S  # what rows a..b-1 see
            part_mask = None if mask is None else mask[..., :keys]
            part = backend.attend(q[:, :, a:b], k[:, :, :keys], v[:, :, :keys], mask=part_mask, causal=causal,
                                  scale=self.scale, dropout_p=dropout_p, emit=emit)  # (B, H, b - a, D)
            if emit is not None:  # not done until the last piece: a progress point between may look
                made, emit.done = made and emit.done, False
            out[:, a:b] = part.transpose(1, 2)
            if b < T:
                _hooks.piece_done()
        if emit is not None:
            emit.done = made
        return out.transpose(1, 2)  # (B, T, H, D) -> (B, H, T, D), as the backends return

    def _hook_inputs(self, q, k, v, rotary: bool):
        """This call's q, k, v through their hook points ([B, T, H, D], [B, S, K, D]): with rotary
        positions, q and k after rotation (hook_rot_*: `project` passed them before)."""
        hook_q, hook_k = (self.hook_rot_q, self.hook_rot_k) if rotary else (self.hook_q, self.hook_k)
        q = hook_q(q.transpose(1, 2)).transpose(1, 2)  # (B, H, T, D) <-> [B, T, H, D]
        k = hook_k(k.transpose(1, 2)).transpose(1, 2)
        v = self.hook_v(v.transpose(1, 2)).transpose(1, 2)
        return q, k, v

    # the backends' helpers, as this layer's (tests and the explain view read them here)
    full_mask = staticmethod(full_mask)
    one_query_attention = staticmethod(one_query_attention)

    def explicit_attention(self, q, k, v, mask, causal: bool, dropout_p: float, *, hooked: bool = False):
        """The textbook formula, keeping the probabilities: (B, H, T, D), (B, H, T, S). `hooked`
        (active hooks): the probabilities pass through hook_pattern before they weigh the values."""
        B, H, T, D = q.shape
        K, S = k.shape[1], k.shape[2]
        G = H // K
        if G == 1:
            scores = (q @ k.transpose(-2, -1)).mul_(self.scale)  # (B, H, T, S)
        else:  # a group's G x T queries in one product with its keys: (B, K, G*T, S) -> (B, H, T, S)
            scores = (q.reshape(B, K, G * T, D) @ k.transpose(-2, -1)).mul_(self.scale)
            scores = scores.view(B, H, T, S)
        if self.softcap is not None:  # Gemma 2: cap * tanh(scores / cap), before the mask
            scores = torch.tanh(scores / self.softcap) * self.softcap
        full = full_mask(mask, causal, T, S, q.device)
        if full is not None:
            scores = scores.masked_fill(~full, float("-inf"))  # exp(-inf) = 0: masked keys get exactly 0
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        if hooked:
            probs = self.hook_pattern(probs)
        weights = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
        if G == 1:
            return weights @ v, probs
        y = weights.reshape(B, K, G * T, S) @ v  # (B, K, G*T, D)
        return y.view(B, H, T, D), probs

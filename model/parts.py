"""The parts every model family is built from, each written once.

Shapes: B = batch, T = query positions (new tokens in this call), S = key positions the
queries may see (cached + new, or the memory's length for cross-attention), C = d_model,
H = heads, D = d_head = C / H.

    sinusoidal_table   fixed positions of Vaswani et al. (2017)
    Embeddings         mixin: token embedding + learned or sinusoidal positions, dropout
    MultiHeadAttention self-attention (keys/values from x) or cross-attention (from `memory`);
                       a boolean mask broadcastable to (B, H, T, S), True = may attend, and/or
                       `causal`; the SDPA fast path, or the explicit path that also returns the
                       (B, H, T, S) probabilities
    FeedForward        Linear(C -> d_ff), GELU | ReLU, Linear(d_ff -> C)
    Block              residual sub-layers with LayerNorm before ("pre", GPT-2) or after the
                       residual sum ("post", Vaswani et al.): self-attention (causal or not),
                       an optional cross-attention (encoder-decoder), the FFN

A family (decoder: model/families/decoder.py) chooses how to stack these; it never copies them.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import ModelConfig

# Stores this call's new (B, H, T, D) keys/values and returns all (B, H, S, D) keys/values
# the queries may see (see KVCache.begin): how a cache reaches one attention module.
KVUpdate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def sinusoidal_table(n_positions: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (C/2,)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (P, C/2)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class Embeddings:
    """Mixin for a family's nn.Module: the token + position embedding, written once.

    `init_embeddings` registers the attributes on the model itself, so the state-dict names
    stay `tok_emb.weight` and `pos_emb.weight` (GPT-2/BERT interop and saved checkpoints):
    tok_emb (V, C); pos_emb (P, C) when positions are learned, else pos_emb None and the
    non-persistent sinusoidal buffer pos_table (P, C); emb_dropout.
    """

    def init_embeddings(self, config: ModelConfig) -> None:
        C = config.d_model
        self.tok_emb = nn.Embedding(config.vocab_size, C)
        if config.positional == "learned":
            self.pos_emb = nn.Embedding(config.context_length, C)
        else:
            self.pos_emb = None
            self.register_buffer("pos_table", sinusoidal_table(config.context_length, C), persistent=False)
        self.emb_dropout = nn.Dropout(config.dropout)

    def embed(self, ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None, *,
              norm: nn.Module | None = None, dropout: bool = True) -> torch.Tensor:
        """(B, T) ids -> (B, T, C): token embedding (times sqrt(C) if configured) + positions
        start .. start+T-1 (a slice, no index lookup), or each token's own (B, T) `positions`;
        then `norm` (BERT's embedding LayerNorm) and dropout while training."""
        x = self.tok_emb(ids)  # (B, T, C)
        if self.config.scale_embeddings:
            x = x * math.sqrt(self.config.d_model)
        pos = self.pos_emb.weight if self.pos_emb is not None else self.pos_table  # (P, C)
        if positions is None:
            x = x + pos[start : start + ids.shape[1]].to(x.dtype)
        else:
            x = x + pos[positions].to(x.dtype)  # (B, T) -> (B, T, C)
        if norm is not None:
            x = norm(x)
        return self.emb_dropout(x) if dropout and self.training else x

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel()
            if self.pos_emb is not None:
                n -= self.pos_emb.weight.numel()
        return n


# On CUDA, the fused attention kernels that need no set-up per shape. cuDNN's attention builds
# an execution plan for each new (batch, length) shape, 80 ms on average on an H100 and up to
# 160 (bench/README.md), which a prefill of every new prompt length would pay. Where the shapes
# never change (a decode step captured in a CUDA graph) the plan is built once, at capture, and
# cuDNN's masked decode kernel is the fastest: there every backend may run (`fixed_shapes`).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_fixed_shapes = contextvars.ContextVar("attnlens_fixed_shapes", default=False)


@contextlib.contextmanager
def fixed_shapes():
    """Within this block the attention shapes are fixed (a CUDA graph capture): any backend."""
    token = _fixed_shapes.set(True)
    try:
        yield
    finally:
        _fixed_shapes.reset(token)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention; on CUDA one of CUDA_SDPA_BACKENDS unless in `fixed_shapes`."""
    if not q.is_cuda or _fixed_shapes.get():
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(CUDA_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def causal_mask(n_queries: int, n_keys: int, device=None) -> torch.Tensor:
    """(T, S) boolean mask, True where query i (at absolute position S - T + i) may look."""
    offset = n_keys - n_queries
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=offset)


class MultiHeadAttention(nn.Module):
    """softmax(Q K^T / sqrt(D) + mask) V per head, then an output projection.

    The input projection is one fused (3C, C) matrix `qkv` (rows: q, then k, then v), the
    layout of GPT-2's c_attn and of nn.MultiheadAttention's in_proj_weight. Self-attention
    projects x through all of it; cross-attention projects x through the q rows and
    `memory` through the k and v rows.

    Masking: `mask` (bool, broadcastable to (B, H, T, S), True = may attend) and `causal`
    (query i, at absolute position S - T + i, sees keys up to that position) both apply
    when both are given. A masked key gets exactly zero probability.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.d_head = config.d_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def project(self, x: torch.Tensor, memory: torch.Tensor | None, memory_kv=None):
        """q (B, H, T, D) from x; k, v (B, H, S, D) from x, or from memory for cross-attention
        (or `memory_kv`, memory's keys and values already projected by `project_memory`)."""
        B, T, C = x.shape
        H, D = self.n_heads, self.d_head
        if memory is None and memory_kv is None:
            # (B, T, 3C) -> (B, T, 3, H, D) -> (3, B, H, T, D): q, k, v as views
            return self.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        w, b = self.qkv.weight, self.qkv.bias
        q = F.linear(x, w[:C], None if b is None else b[:C])  # (B, T, C)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)
        k, v = memory_kv if memory_kv is not None else self.project_memory(memory)
        return q, k, v

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values (B, H, S, D) of memory (B, S, C): computed once per
        source and reused at every decoding step (the encoder-decoder's cross K/V cache)."""
        B, S, C = memory.shape
        w, b = self.qkv.weight, self.qkv.bias
        kv = F.linear(memory, w[C:], None if b is None else b[C:])  # (B, S, 2C)
        k, v = kv.view(B, S, 2, self.n_heads, self.d_head).permute(2, 0, 3, 1, 4).unbind(0)  # 2 x (B, H, S, D)
        return k, v

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, C) output and, with return_attention, the (B, H, T, S) probabilities (else None)."""
        B, T, C = x.shape
        q, k, v = self.project(x, memory, memory_kv)
        if kv_update is not None:
            k, v = kv_update(k, v)  # (B, H, S, D): the cached keys/values followed by the new ones
        S = k.shape[2]
        dropout_p = self.dropout if self.training else 0.0
        # causality at T == 1 lets the single newest query see every key: nothing to mask
        causal = causal and T > 1

        if return_attention:
            y, probs = self.explicit_attention(q, k, v, mask, causal, dropout_p)
        else:
            probs = None
            if mask is None and causal and S == T:
                y = sdpa(q, k, v, dropout_p=dropout_p, is_causal=True)
            elif T == 1 and mask is not None and not q.is_cuda and dropout_p == 0.0:
                y = self.one_query_attention(q, k, v, mask)  # a batched decode step on the CPU
            else:
                y = sdpa(q, k, v, attn_mask=self.full_mask(mask, causal, T, S, q.device), dropout_p=dropout_p)

        y = self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, H, T, D) -> (B, T, C), project
        if self.training:  # dropout is the identity at inference; skip the call when decoding
            y = self.resid_dropout(y)
        return y, probs

    @staticmethod
    def full_mask(mask: torch.Tensor | None, causal: bool, T: int, S: int, device) -> torch.Tensor | None:
        """One boolean mask (True = may attend) from `mask` and `causal`; None = all visible."""
        if not causal:
            return mask
        tri = causal_mask(T, S, device=device)  # (T, S)
        return tri if mask is None else mask & tri

    @staticmethod
    def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per row over keys with a mask (rows of different lengths decoding together):
        (B, H, 1, D). On the CPU, MKL's batched products (scale and mask fused into one baddbmm)
        run this faster than SDPA's kernel: the default model's batch-16 step, 7.08 against 7.52 ms
        (bench/README.md). Keys and values stay views of the cache (B and H merge without a copy)."""
        B, H, _, D = q.shape
        S = k.shape[2]
        bias = torch.zeros(B, H, 1, S, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        scores = torch.baddbmm(bias.view(B * H, 1, S), q.reshape(B * H, 1, D), k.reshape(B * H, S, D).transpose(1, 2),
                               alpha=1.0 / math.sqrt(D))  # (B*H, 1, S): q k^T / sqrt(D) + mask
        return torch.bmm(torch.softmax(scores, dim=-1), v.reshape(B * H, S, D)).view(B, H, 1, D)

    def explicit_attention(self, q, k, v, mask, causal: bool, dropout_p: float):
        """The textbook formula, keeping the probabilities: (B, H, T, D), (B, H, T, S)."""
        T, S = q.shape[2], k.shape[2]
        scores = (q @ k.transpose(-2, -1)).mul_(1.0 / math.sqrt(self.d_head))  # (B, H, T, S)
        full = self.full_mask(mask, causal, T, S, q.device)
        if full is not None:
            scores = scores.masked_fill(~full, float("-inf"))  # exp(-inf) = 0: masked keys get exactly 0
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        weights = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
        return weights @ v, probs


def activate(x: torch.Tensor, name: str) -> torch.Tensor:
    """The config's activation: "gelu" (tanh approximation, GPT-2), "gelu_exact" (erf, BERT) or "relu"."""
    if name == "gelu":
        return F.gelu(x, approximate="tanh")
    if name == "gelu_exact":
        return F.gelu(x)
    return F.relu(x)


class FeedForward(nn.Module):
    """Position-wise FFN: Linear(C -> d_ff), activation (see `activate`), Linear(d_ff -> C)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.activation = config.activation
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # (B, T, d_ff)
        h = activate(h, self.activation)
        h = self.proj(h)  # (B, T, C)
        return self.dropout(h) if self.training else h


class BlockOutput(NamedTuple):
    x: torch.Tensor  # (B, T, C)
    self_attention: torch.Tensor | None  # (B, H, T, T or S) with return_attention, else None
    cross_attention: torch.Tensor | None  # (B, H, T, S_memory); None without cross-attention


class Block(nn.Module):
    """Self-attention [+ cross-attention] + FFN, each a residual sub-layer with its LayerNorm.

    pre-LN:  x = x + sub(ln(x));  post-LN:  x = ln(x + sub(x)).
    Parameter names (ln1, attn, ln2, ffn) are those of the saved checkpoints and GPT-2 interop;
    the cross-attention sub-layer (ln_cross, cross_attn) exists only with cross_attention=True.
    """

    def __init__(self, config: ModelConfig, *, causal: bool = True, cross_attention: bool = False):
        super().__init__()
        self.causal = causal
        self.pre_norm = config.norm == "pre"
        self.ln1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = MultiHeadAttention(config)
        if cross_attention:  # the encoder-decoder's decoder: attend to the encoder's output
            self.ln_cross = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
            self.cross_attn = MultiHeadAttention(config)
        else:
            self.ln_cross = self.cross_attn = None
        self.ln2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
        self.ffn = FeedForward(config)

    def _input(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """What a sub-layer reads: ln(x) before the sum (pre-LN), x itself (post-LN)."""
        return norm(x) if self.pre_norm else x

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
    ) -> BlockOutput:
        out, self_probs = self.attn(self._input(x, self.ln1), mask=mask, causal=self.causal, kv_update=kv_update,
                                    return_attention=return_attention)
        x = self._residual(x, out, self.ln1)
        cross_probs = None
        if self.cross_attn is not None:
            if memory is None and memory_kv is None:
                raise ValueError("this block has cross-attention: pass the encoder output as memory "
                                 "(or its projected keys/values as memory_kv)")
            out, cross_probs = self.cross_attn(self._input(x, self.ln_cross), memory, mask=memory_mask,
                                               return_attention=return_attention, memory_kv=memory_kv)
            x = self._residual(x, out, self.ln_cross)
        x = self._residual(x, self.ffn(self._input(x, self.ln2)), self.ln2)
        return BlockOutput(x, self_probs, cross_probs)

"""How attention is computed on a device: softmax(q k^T * scale + mask) v, chosen once per device
(vLLM's attention backends). MultiHeadAttention asks `backend_for(device)` and calls `attend`;
the paths that keep the probabilities (maps, hook points) and a decode step over the KV blocks
where they lie (the cache's own: model/paged_kv_cache.py) are the layer's, not a backend's.

    TorchAttention  any device: PyTorch's SDPA
    CpuAttention    a causal prompt by our C kernel where it applies (causal_attention.py, an
                    Emit's maps too),
                    a decode step with a mask or grouped heads by MKL's batched products
                    (one_query_attention), else SDPA
    CudaAttention   SDPA restricted to the kernels that need no set-up per shape, unless the
                    shapes are fixed (a CUDA graph capture: `fixed_shapes`)

Shapes: q (B, H, T, D); k, v (B, K, S, D), K key/value heads (H / K = G query heads each);
`mask` bool, broadcastable to (B, H, T, S), True = may attend; `causal`: query i, at absolute
position S - T + i, sees keys up to it. Returns (B, H, T, D).

`emitting(emits)` asks, for the forwards in its block, some attention modules' maps reduced by the
kernel that computes their attention (causal_attention.Emit, by the module's path): a backend that
can (CpuAttention, by our C kernel) makes them and sets emit.done; the others leave them undone.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnlens.model.parts import causal_attention


def causal_mask(n_queries: int, n_keys: int, device=None) -> torch.Tensor:
    """(T, S) boolean mask, True where query i (at absolute position S - T + i) may look."""
    offset = n_keys - n_queries
    return torch.ones(n_queries, n_keys, dtype=torch.bool, device=device).tril(diagonal=offset)


def full_mask(mask: torch.Tensor | None, causal: bool, T: int, S: int, device) -> torch.Tensor | None:
    """One boolean mask (True = may attend) from `mask` and `causal`; None = all visible."""
    if not causal:
        return mask
    tri = causal_mask(T, S, device=device)  # (T, S)
    return tri if mask is None else mask & tri


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scale: float | None = None) -> torch.Tensor:
    """One query per row over keys (rows of different lengths decoding together, with a mask; or a
    grouped-query step): (B, H, 1, D). On the CPU, MKL's batched products (scale and mask fused into
    one baddbmm) run this faster than SDPA's kernel: the default model's batch-16 step, 7.08 against
    7.52 ms (bench/README.md). The G query heads of a key/value head are the G rows of one product,
    so grouped keys are read once, never repeated. Keys and values stay views of the cache (B and K
    merge without a copy). `scale`: 1/sqrt(D) unless given."""
    B, H, _, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    K, S = k.shape[1], k.shape[2]
    G = H // K
    qg = q.reshape(B * K, G, D)  # (B, H, 1, D) -> (B*K, G, D): a group's queries side by side
    keys_t = k.reshape(B * K, S, D).transpose(1, 2)  # (B*K, D, S)
    if mask is None:
        scores = torch.bmm(qg, keys_t).mul_(scale)  # (B*K, G, S)
    else:
        blocked = ~mask
        if blocked.dim() == 4 and blocked.shape[1] != 1:  # a mask per query head: (B, H, 1, S) -> (B, K, G, S)
            blocked = blocked.expand(B, H, 1, S).reshape(B, K, G, S)
        bias = torch.zeros(B, K, G, S, dtype=q.dtype, device=q.device).masked_fill_(blocked, float("-inf"))
        scores = torch.baddbmm(bias.view(B * K, G, S), qg, keys_t, alpha=scale)  # (B*K, G, S): q k^T * scale + mask
    return torch.bmm(torch.softmax(scores, dim=-1), v.reshape(B * K, S, D)).view(B, H, 1, D)


_emits: contextvars.ContextVar[dict[str, causal_attention.Emit] | None] = contextvars.ContextVar(
    "attnlens_emits", default=None)


@contextlib.contextmanager
def emitting(emits: dict[str, causal_attention.Emit]):
    """Within this block (on this thread) the attention modules at these paths ("blocks.2.attn") pass
    their Emit to the backend (model/analysis/attention_maps.py's fused maps)."""
    token = _emits.set(emits)
    try:
        yield
    finally:
        _emits.reset(token)


def emit_for(module: str) -> causal_attention.Emit | None:
    """The Emit asked of the attention module at this path, or None."""
    emits = _emits.get()
    return None if emits is None else emits.get(module)


class TorchAttention:
    """PyTorch's SDPA, on any device (an Emit is left undone)."""

    name = "torch"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None, causal: bool,
               scale: float, dropout_p: float = 0.0, emit: causal_attention.Emit | None = None) -> torch.Tensor:
        T, S = q.shape[2], k.shape[2]
        causal = causal and T > 1  # the single newest query sees every key: nothing to mask
        gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        if mask is None and causal and S == T:
            return self.sdpa(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, **gqa)
        return self.sdpa(q, k, v, attn_mask=full_mask(mask, causal, T, S, q.device), dropout_p=dropout_p,
                         scale=scale, **gqa)

    def sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


class CpuAttention(TorchAttention):
    """Our C kernel for a causal prompt where it applies, MKL's products for a masked or grouped
    decode step, else SDPA."""

    name = "cpu"

    def attend(self, q, k, v, *, mask, causal, scale, dropout_p=0.0, emit=None):
        T = q.shape[2]
        if mask is None and causal and T > 1 and dropout_p == 0.0:
            y = causal_attention.causal_attention(q, k, v, scale, emit)  # None where the kernel does not apply
            if y is not None:
                return y
        if T == 1 and dropout_p == 0.0 and (mask is not None or q.shape[1] != k.shape[1]):
            return one_query_attention(q, k, v, mask, scale)  # a decode step
        return super().attend(q, k, v, mask=mask, causal=causal, scale=scale, dropout_p=dropout_p)


# On CUDA, the fused attention kernels that need no set-up per shape. cuDNN's attention builds
# an execution plan for each new (batch, length) shape, 80 ms on average on an H100 and up to
# 160 (bench/README.md), which a prefill of every new prompt length would pay. Where the shapes
# never change (a decode step captured in a CUDA graph) the plan is built once, at capture, and
# cuDNN's masked decode kernel is the fastest: there every backend may run (`fixed_shapes`).
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_fixed_shapes = contextvars.ContextVar("attnlens_fixed_shapes", default=False)


@contextlib.contextmanager
def fixed_shapes():
    """Within this block (on this thread) the attention shapes are fixed (a CUDA graph capture):
    CudaAttention lets every SDPA kernel run."""
    token = _fixed_shapes.set(True)
    try:
        yield
    finally:
        _fixed_shapes.reset(token)


class CudaAttention(TorchAttention):
    """SDPA with CUDA_SDPA_BACKENDS, or any kernel while the shapes are fixed (fixed_shapes)."""

    name = "cuda"

    def sdpa(self, q, k, v, **kwargs):
        if _fixed_shapes.get():
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        with sdpa_kernel(CUDA_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)


AttentionBackend = TorchAttention


@functools.cache
def backend_for(device_type: str) -> AttentionBackend:
    """The attention backend of a device kind ("cpu", "cuda", ...), made once."""
    return {"cpu": CpuAttention, "cuda": CudaAttention}.get(device_type, TorchAttention)()


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention through q's device's backend (on CUDA: its kernel choice)."""
    return backend_for(q.device.type).sdpa(q, k, v, **kwargs)

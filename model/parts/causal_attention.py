"""A prefill's causal attention on the CPU by our C kernel (model/native/causal_attention.c):
softmax(q k^T * scale, causal) v for T queries at the last T of S positions, grouped-query heads
read in place, the output laid out as the output projection reads it.

    causal_attention   q (B, H, T, D), k, v (B, K, S, D) -> (B, H, T, D), a view of a (B, T, H, D)
                       tensor (so y.transpose(1, 2).reshape(B, T, H D) is a view, no copy); None
                       where the kernel does not apply (the caller takes torch's SDPA)

Where it applies: float32 on the CPU, no autograd, at least MIN_QUERIES queries and MIN_SCORES
queries x keys, dims contiguous in each row, and the kernels built here. On this project's 2-core machine (2 threads, one of
SmolLM2's layers at 2,048 tokens: 9 query heads, 3 key/value heads, D = 64) it takes 18.1-20.7 ms
where torch's flash kernel (F.scaled_dot_product_attention, is_causal) takes 22.8-25.7 ms (at 512
tokens 1.76 against 3.04 ms; 8,192 keys after a 2,048-token piece 131 against 191 ms, SDPA with a
mask there): its
products run at the machine's peak, and its softmax reads the row maxima the score products leave
in registers (bench/README.md). The numbers agree with SDPA's to float32 rounding
(tests/model/test_causal_attention.py: within 2e-6 of a float64 reference).
"""

from __future__ import annotations

import torch

from attnlens.model.native import library as native

# Smaller products stay with SDPA, faster there (2 threads, SmolLM2's heads: 64 queries over 64 keys
# 0.73x SDPA's speed, 96 over 96 1.07x, 128 over 128 1.28x, 32 over 512 1.17x, 16 over 1,024 0.76x)
MIN_QUERIES = 32
MIN_SCORES = 128 * 128  # queries x keys


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether causal_attention may take these: see the module docstring."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and not torch.is_grad_enabled()
            and q.shape[2] >= MIN_QUERIES and k.shape[2] >= q.shape[2] and q.shape[2] * k.shape[2] >= MIN_SCORES
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and native.available()[0])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q (B, H, T, D), k, v (B, K, S, D), S >= T: query t at position S - T + t sees keys 0 .. S - T + t.
    -> (B, H, T, D) as a view of (B, T, H, D); None where the kernel refuses the shapes (D not a
    multiple of the vector width, or over 256)."""
    if not applies(q, k, v):
        return None
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    out = torch.empty(B, T, H, D, dtype=q.dtype)  # (B, T, H, D)
    lib = native.load()
    for b in range(B):
        qb, kb, vb = q[b], k[b], v[b]  # (H, T, D), (K, S, D): the strides of each head and row
        failed = lib.causal_attention(qb.data_ptr(), qb.stride(0), qb.stride(1), kb.data_ptr(), kb.stride(0),
                                      kb.stride(1), vb.data_ptr(), vb.stride(0), vb.stride(1), H, K, T, S, D, scale,
                                      out[b].data_ptr())
        if failed == 1:
            return None
        if failed:
            raise MemoryError("causal_attention: out of memory")
    return out.transpose(1, 2)  # (B, H, T, D), a view

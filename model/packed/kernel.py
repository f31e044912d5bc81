"""The packed-weights products (model/native/packed_matmul.c) as torch functions.

Why our own kernel: torch's weight-only kernels fit two of the three formats on paper
(`_weight_int4pack_mm_for_cpu`: groups of 32 with a scale and a zero, exactly Q4_0 and Q4_1;
`_weight_int8pack_mm`: one scale per row, not Q8_0's one per block), but on this 2-core AVX2
machine (torch 2.13, bench/README.md) the int4 one is 7-8x slower than the float32 product it
would replace at one row, the int8 one 3.7x: they would make decoding slower, not faster.
The kernel is built with the others in model/native/ (model/native/library.py).

    available()            whether the kernel can be built and loaded here, and if not why
    matmul(x, w, fmt, K)   (..., K) float32 x packed (N, row_bytes) -> (..., N)
    dequantize(w, fmt, K)  packed rows (all, or `rows`) -> float32 (R, K)
"""

from __future__ import annotations

import torch

from attnlens.model.native.library import NativeUnavailable, available, load

__all__ = ["BLOCK_BYTES", "FORMATS", "NativeUnavailable", "available", "dequantize", "matmul"]

FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # the codes packed_matmul.c takes
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per block of 32 weights


def matmul(x: torch.Tensor, w: torch.Tensor, fmt: str, K: int) -> torch.Tensor:
    """x (..., K) float32 on the CPU times the packed matrix w (N, K/32 blocks as uint8) transposed:
    (..., N), as F.linear(x, dequantize(w)) up to the order of the sums."""
    lib = load()
    lead = x.shape[:-1]
    rows = x.reshape(-1, K).contiguous()  # (M, K)
    M, N = rows.shape[0], w.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if lib.packed_matmul(rows.data_ptr(), M, K, w.data_ptr(), N, FORMATS[fmt], y.data_ptr()) != 0:
        raise MemoryError("packed_matmul: out of memory")
    return y.view(*lead, N)


def dequantize(w: torch.Tensor, fmt: str, K: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of the packed matrix w (all, or the int64 `rows`) as float32 (R, K), exactly as gguf's
    dequantizer computes them."""
    lib = load()
    if rows is not None:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
    R = w.shape[0] if rows is None else rows.numel()
    out = torch.empty(R, K, dtype=torch.float32)
    lib.packed_dequantize(w.data_ptr(), K, FORMATS[fmt], 0 if rows is None else rows.data_ptr(), R,
                          out.data_ptr())
    return out

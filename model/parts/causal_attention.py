"""A prefill's causal attention on the CPU by our C kernel (model/native/causal_attention.c):
softmax(q k^T * scale, causal) v for T queries at the last T of S positions, grouped-query heads
read in place, the output laid out as the output projection reads it.

    causal_attention   q (B, H, T, D), k, v (B, K, S, D) -> (B, H, T, D), a view of a (B, T, H, D)
                       tensor (so y.transpose(1, 2).reshape(B, T, H D) is a view, no copy); None
                       where the kernel does not apply (the caller takes torch's SDPA)
    Emit               what the same call also makes of some heads' maps from the scores it
                       computes anyway (causal_attention_reduced in the C kernel): each row's
                       probability on column bins, its top k keys, a window of probabilities

Where it applies: float32 on the CPU, no autograd, at least MIN_QUERIES queries and MIN_SCORES
queries x keys (a call with an Emit: any size, one row of a batch), dims contiguous in each row, and
the kernels built here. On this project's 2-core machine (2 threads, one of
SmolLM2's layers at 2,048 tokens: 9 query heads, 3 key/value heads, D = 64) it takes 18.1-20.7 ms
where torch's flash kernel (F.scaled_dot_product_attention, is_causal) takes 22.8-25.7 ms (at 512
tokens 1.76 against 3.04 ms; 8,192 keys after a 2,048-token piece 131 against 191 ms, SDPA with a
mask there): its
products run at the machine's peak, and its softmax reads the row maxima the score products leave
in registers (bench/README.md). The numbers agree with SDPA's to float32 rounding
(tests/model/test_causal_attention.py: within 2e-6 of a float64 reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlens.model.native import library as native

# Smaller products stay with SDPA, faster there (2 threads, SmolLM2's heads: 64 queries over 64 keys
# 0.73x SDPA's speed, 96 over 96 1.07x, 128 over 128 1.28x, 32 over 512 1.17x, 16 over 1,024 0.76x)
MIN_QUERIES = 32
MIN_SCORES = 128 * 128  # queries x keys


@dataclass
class Emit:
    """What a call also makes of the asked `heads`' maps (H' of them), for query positions rows
    [a, b) and key positions cols [c, d), R = b - a rows, each from the call's own scores:

        bin_sums     (H', R, len(col_edges) - 1) float32: each row's probability summed over each
                     column bin [col_edges[i], col_edges[i + 1]) (zeros made by the call if None)
        top_weights  (H', R, k) float32 and top_positions (H', R, k) int32: each row's k heaviest
                     keys within the columns, heaviest first, position -1 where the weight is 0
        window       (H', R, d - c) float32, float16, or uint8 steps of window_scale: the
                     probabilities at full resolution

    Rows outside the call's queries are left as they are (a later piece's call fills them). `done`:
    a call made them; else the caller makes them another way."""

    heads: list[int]
    rows: tuple[int, int]
    cols: tuple[int, int]
    col_edges: list[int] | None = None
    bin_sums: torch.Tensor | None = None
    top_weights: torch.Tensor | None = None
    top_positions: torch.Tensor | None = None
    window: torch.Tensor | None = None
    window_scale: float = 1.0
    done: bool = False


_STORES = {torch.float32: 0, torch.float16: 1, torch.uint8: 2}  # the kernel's window_store


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, emit: Emit | None = None) -> bool:
    """Whether causal_attention may take these: see the module docstring."""
    sized = q.shape[0] == 1 if emit is not None else (
        q.shape[2] >= MIN_QUERIES and q.shape[2] * k.shape[2] >= MIN_SCORES)
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and not torch.is_grad_enabled()
            and sized and k.shape[2] >= q.shape[2] and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and native.available()[0])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     emit: Emit | None = None) -> torch.Tensor | None:
    """q (B, H, T, D), k, v (B, K, S, D), S >= T: query t at position S - T + t sees keys 0 .. S - T + t.
    -> (B, H, T, D) as a view of (B, T, H, D); None where the kernel refuses the shapes (D not a
    multiple of the vector width, or over 256). With `emit` (B = 1), its maps too (emit.done)."""
    if not applies(q, k, v, emit):
        return None
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    out = torch.empty(B, T, H, D, dtype=q.dtype)  # (B, T, H, D)
    lib = native.load()
    request, held = (_request(lib.ffi, emit, H, S) if emit is not None else (None, ()))
    for b in range(B):
        qb, kb, vb = q[b], k[b], v[b]  # (H, T, D), (K, S, D): the strides of each head and row
        args = (qb.data_ptr(), qb.stride(0), qb.stride(1), kb.data_ptr(), kb.stride(0), kb.stride(1), vb.data_ptr(),
                vb.stride(0), vb.stride(1), H, K, T, S, D, scale, out[b].data_ptr())
        if request is None:
            failed = lib.causal_attention(*args)
        else:
            failed = lib.causal_attention_reduced(*args, int(lib.ffi.cast("intptr_t", request)))
        if failed == 1:
            return None
        if failed:
            raise MemoryError("causal_attention: out of memory")
    del held  # the request's arrays, alive until the call is over
    if emit is not None:
        emit.done = True
    return out.transpose(1, 2)  # (B, H, T, D), a view


def _request(ffi, emit: Emit, H: int, S: int) -> tuple[object, tuple]:
    """emit as the kernel's attention_reduction (a cffi struct), and the tensors it points into (to
    hold while the call runs); emit.bin_sums made here, zeros, when bins are asked."""
    (a, b), (c, d) = emit.rows, emit.cols
    n, R = len(emit.heads), b - a
    assert 0 <= a <= b and 0 <= c <= d, (emit.rows, emit.cols)  # d may pass S: a piece's rows see none past it
    slot = torch.full((H,), -1, dtype=torch.int64)
    slot[torch.tensor(emit.heads, dtype=torch.long)] = torch.arange(n)
    red = ffi.new("attention_reduction *")
    red.slot = ffi.cast("int64_t *", slot.data_ptr())
    red.row0, red.row1, red.col0, red.col1 = a, b, c, d
    held: list[torch.Tensor] = [slot]
    if emit.col_edges is not None:
        edges = torch.tensor(emit.col_edges, dtype=torch.int64)
        if emit.bin_sums is None:
            emit.bin_sums = torch.zeros(n, R, len(emit.col_edges) - 1)
        red.col_edges, red.bins = ffi.cast("int64_t *", edges.data_ptr()), len(emit.col_edges) - 1
        red.bin_sums = ffi.cast("float *", _checked(emit.bin_sums, (n, R, red.bins), torch.float32))
        held.append(edges)
    if emit.top_weights is not None and emit.top_positions is not None:
        red.k = emit.top_weights.shape[-1]
        red.top_weights = ffi.cast("float *", _checked(emit.top_weights, (n, R, red.k), torch.float32))
        red.top_positions = ffi.cast("int32_t *", _checked(emit.top_positions, (n, R, red.k), torch.int32))
    if emit.window is not None:
        red.window = ffi.cast("void *", _checked(emit.window, (n, R, d - c), emit.window.dtype))
        red.window_store, red.window_scale = _STORES[emit.window.dtype], emit.window_scale
    return red, tuple(held)


def _checked(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """t's address, once it is a contiguous CPU tensor of this shape and type (the kernel writes it)."""
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu", (t.shape, shape)
    return t.data_ptr()

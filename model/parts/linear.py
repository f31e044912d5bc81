"""Linear: nn.Linear (the same parameters, names, shapes and initialisation) whose float32
inference forward on the CPU picks the fastest product for its rows.

Which product (float32 inference on the CPU; `cpu_product`):
* one row: our matrix-vector kernel (model/native/float_matvec.c), below;
* 2 to FEW_ROWS rows: our few-row kernel (float_matmul_few, the same file): each weight row read
  once and met by every row of x, SmolLM2's four products of a layer at 2 / 4 / 8 rows 0.33 /
  0.38 / 0.63 ms against W x^T's 0.82 / 0.65 / 0.68 (2-core Xeon, 2 threads). The fused decode
  step (model/fused_decode.py) takes the tiles up to 64 rows. Our kernel would be faster here up
  to 16 rows too (bench_products.py at 16: 92-94 GMAC/s against oneDNN's 73-80), but a product
  that one path computes with it and another with oneDNN differs in the last bits: /attention's
  maps from kept queries and keys then differed from the forward's by 3.5e-6 (tests/api/test_client.py);
* ONEDNN_MIN_ROWS rows or more: oneDNN's matmul (`onednn_linear`, the library torch's CPU build
  carries), on the weight as it lies, no reordered copy. Its kernels are chosen by instruction
  set, where MKL, torch's default for F.linear, runs generic ones on AMD processors. On a
  2-core EPYC (AVX-512; the project's machine until 2026-11-27), against what ran before (W x^T to 64 rows, F.linear above), each pair
  in turns in one process: a batch-16 decode step of the default model 1.12-1.13x faster, of
  SmolLM2 at 24-32 rows 1.27x, at 64 rows 1.13x; SmolLM2's prefill of 512 and 2,048 tokens
  1.14x and 1.12x. At 8 rows it was slower (0.85-0.89x: it packs the weight as a sgemm's right
  operand every call). At 9-15 rows W x^T would be a little faster (Xeon, 12-16 rows: 0.67-0.72
  ms against 0.83-0.90), but its bits change with the threads (below);
* where torch has no oneDNN: W x^T up to MAX_ROWS rows, F.linear above; without our kernels,
  W x^T below ONEDNN_MIN_ROWS.

Every product above gives the same bits whatever the number of threads (a thread computes each
output whole, in a fixed order), so the same request gets the same answer however busy the
machine. MKL does not: through torch.mm or F.linear, products over 1,024 inputs (the default
model's down projection) from 2 rows up differ in the last bits between 1 and 2 threads, and on
an Intel Xeon, where MKL is otherwise ~8% faster than oneDNN at 2,048 rows, a test run with
F.linear taking those products had an explanation asked twice of a busy server differ by 5e-6
(tests/api/test_client_explain.py). MKL is used only where neither our kernels nor oneDNN exist.

nn.Linear computes y = x W^T with W stored (out, in). On the CPU, BLAS runs that product as a
small-by-large sgemm whose large operand is transposed, and for the few rows of a decode step it
streams the weights at a fraction of the memory's speed. The same numbers come faster as
y^T = W x^T: W, row-major, is the product's left operand as it lies in memory, and x^T is a
thin right one. SmolLM2's 30 layers at batch 1 (2 threads; bench/README.md): gate-and-up
projections 14.8 -> 12.2 ms a token, down 10.6 -> 3.8, qkv 5.0 -> 2.2, the 49,152-word head
5.6 -> 3.5; at 16 and 32 rows still 15-35% faster. From about 128 rows (a prefill) F.linear's
own product is as fast or faster, so only the few rows of decode steps (at most MAX_ROWS) take
this path. One row (a decode step of one stream) goes to our own matrix-vector kernel
(model/native/float_matvec.c: 31-32 GB/s against BLAS's 23-31 on SmolLM2's matrices, 2 threads)
where it is built; without it, one row is padded to two: BLAS answers a single column with a
matrix-vector routine that is slower than the two-column product.

Only float32 inference on the CPU takes these paths (no autograd: training and every GPU keep
F.linear). The results are F.linear's numbers summed in another order: equal to rounding.

    Linear          the module
    cpu_product     the product for float32 inference on the CPU, chosen as above
    cpu_linear      W x^T: (..., in) x (out, in) [+ (out,)] -> (..., out)
    onednn_linear   oneDNN's x W^T, or None where this torch has no oneDNN
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlens.model.native import library as native

MAX_ROWS = 64  # rows (batch x positions) up to which W x^T is faster than F.linear (bench/README.md)
FEW_ROWS = 8  # rows up to which our few-row kernel is the faster (module docstring)
ONEDNN_MIN_ROWS = FEW_ROWS + 1  # rows from which oneDNN's product is used (module docstring)
USE_ONEDNN = True  # bench/ switches it to measure the products against each other


def _onednn_op():
    """torch.ops.mkldnn._linear_pointwise (what torch's compiler emits for a CPU linear), or None."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_ONEDNN = _onednn_op()


def onednn_available() -> bool:
    """Whether this torch carries oneDNN's matmul (onednn_linear)."""
    return _ONEDNN is not None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) by oneDNN's matmul: x (..., in), weight (out, in) float32 on the CPU."""
    assert _ONEDNN is not None, "this torch has no oneDNN"
    return _ONEDNN(x, weight, bias, "none", [], "")


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x^T)^T: x (..., in), weight (out, in); up to
    FEW_ROWS rows by our kernel where it is built."""
    lead, d_in = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d_in)  # (M, in)
    M = rows.shape[0]
    if M <= FEW_ROWS and native.available()[0]:  # our kernels, where they are built (one row: matrix-vector)
        y = torch.empty(M, weight.shape[0], dtype=x.dtype)
        xs, b = rows.contiguous(), None if bias is None else bias.contiguous()  # held while the kernel reads them
        native.load().float_matmul_few(xs.data_ptr(), M, d_in, weight.data_ptr(), weight.shape[0],
                                       0 if b is None else b.data_ptr(), y.data_ptr())
        return y.view(*lead, weight.shape[0])  # (..., out)
    if M == 1:  # two columns: BLAS's one-column routine is the slow one
        rows = torch.cat((rows, rows))
    if bias is None:
        y = torch.mm(weight, rows.t())  # (out, M), (out, 2) for one row
    else:
        y = torch.addmm(bias[:, None], weight, rows.t())  # (out, M)
    if M == 1:  # the first column: one call fewer than through the transpose (121 a SmolLM2 token)
        return y[:, 0].contiguous().view(*lead, weight.shape[0])  # (..., out)
    return y.t().contiguous().view(*lead, weight.shape[0])  # (..., out)


def cpu_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x through weight takes cpu_product: float32 on the CPU, no autograd, a row-major weight."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_grad_enabled() and weight.is_contiguous())


def cpu_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for float32 inference on the CPU, by the product the module docstring
    picks for x's rows."""
    rows = x.numel() // max(1, x.shape[-1])
    if rows >= ONEDNN_MIN_ROWS and _ONEDNN is not None and USE_ONEDNN:
        return onednn_linear(x, weight, bias)
    if rows <= MAX_ROWS:
        return cpu_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear; in float32 inference on the CPU, the fastest product for the rows (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_inference(x, self.weight):
            return cpu_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

"""Linear: nn.Linear (the same parameters, names, shapes and initialisation) whose inference
forward on the CPU takes the product the other way round.

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

Only float32 inference on the CPU takes this path (no autograd: training and every GPU keep
F.linear). The results are F.linear's numbers summed in another order: equal to rounding.

    Linear        the module
    cpu_linear    the product: (..., in) x (out, in) [+ (out,)] -> (..., out)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlens.model.native import library as native

MAX_ROWS = 64  # rows (batch x positions) up to which W x^T is the faster product (bench/README.md)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x^T)^T: x (..., in), weight (out, in)."""
    lead, d_in = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, d_in)  # (M, in)
    M = rows.shape[0]
    if M == 1 and native.available()[0]:  # one row: our matrix-vector kernel, where it is built
        y = torch.empty(weight.shape[0], dtype=x.dtype)
        row, b = rows.contiguous(), None if bias is None else bias.contiguous()  # held while the kernel reads them
        native.load().float_matvec(row.data_ptr(), d_in, weight.data_ptr(), weight.shape[0],
                                   None if b is None else b.data_ptr(), y.data_ptr())
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


def fast_cpu_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x through weight takes cpu_linear: float32 on the CPU, no autograd, a row-major weight,
    at most MAX_ROWS rows."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_grad_enabled() and weight.is_contiguous() and x.numel() <= MAX_ROWS * x.shape[-1])


class Linear(nn.Linear):
    """nn.Linear; in float32 inference on the CPU, y^T = W x^T (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fast_cpu_path(x, self.weight):
            return cpu_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

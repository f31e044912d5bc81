"""Linear layers and the token embedding with their weights in a GGUF block format.

    PackedMatrix     (N, K) weights as N rows of K/32 blocks (uint8, the file's bytes), its format
    PackedLinear     Linear's forward from a PackedMatrix: the packed kernel for the few rows of a
                     decode step, float32 tiles and oneDNN or BLAS for a prefill
                     (model/parts/linear.py's cpu_product)
    PackedEmbedding  nn.Embedding's lookup from a PackedMatrix (the rows asked for, dequantized)

Both keep the names and shapes their float32 counterparts show: `in_features`, `out_features`,
`num_embeddings`, `embedding_dim`, and `weight`, which here is the whole matrix dequantized on
each access (float32, (N, K): for code that reads the values; the forward never builds it).
A tied head and embedding share one PackedMatrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from attnlens.model.packed import kernel
from attnlens.model.parts.linear import cpu_product

# Rows of x up to which the packed kernel runs (every decode step the fused step takes, so a row's
# logits do not depend on the rows beside it); above, each tile of TILE_ROWS weight rows is
# dequantized to float32 and multiplied by BLAS (a prefill: BLAS's blocked sgemm outruns the
# kernel from about 32 rows, 1.6x at 128; bench/README.md, issue 50).
MAX_KERNEL_ROWS = 64
TILE_ROWS = 4096


@dataclass(eq=False)
class PackedMatrix:
    """(rows, cols) weights in block format `fmt` ("Q4_0", "Q4_1", "Q8_0"): `data` (rows,
    cols / 32 * block bytes) uint8, each row its blocks in column order, as the file stores them."""

    data: torch.Tensor
    fmt: str
    cols: int

    def __post_init__(self) -> None:
        if self.fmt not in kernel.FORMATS:
            raise ValueError(f"block format {self.fmt!r} is not packed here (packed: {', '.join(kernel.FORMATS)})")
        want = self.cols // 32 * kernel.BLOCK_BYTES[self.fmt]
        if self.cols % 32 or self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != want:
            raise ValueError(f"{self.fmt} matrix of {self.cols} columns needs (rows, {want}) uint8 blocks, "
                             f"got {tuple(self.data.shape)} {self.data.dtype}")
        self.data = self.data.contiguous()

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(R, cols) float32: every row, or the int64 `rows`."""
        return kernel.dequantize(self.data, self.fmt, self.cols, rows)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., cols) -> (..., rows) = x W^T."""
        n = x.numel() // self.cols
        if n <= MAX_KERNEL_ROWS:
            return kernel.matmul(x, self.data, self.fmt, self.cols)
        flat = x.reshape(n, self.cols)
        if self.rows <= TILE_ROWS:  # one tile: its product is the answer (no copy through a cat)
            return cpu_product(flat, self.dequantize()).view(*x.shape[:-1], self.rows)
        tiles = [cpu_product(flat, self.dequantize(torch.arange(r, min(r + TILE_ROWS, self.rows))))
                 for r in range(0, self.rows, TILE_ROWS)]
        return torch.cat(tiles, dim=-1).view(*x.shape[:-1], self.rows)


def _check_cpu_float32(x: torch.Tensor, what: str) -> None:
    if x.device.type != "cpu" or x.dtype != torch.float32:
        raise ValueError(f"{what}: packed weights take float32 inputs on the CPU, got {x.dtype} on {x.device}")


class PackedLinear(nn.Module):
    """y = x W^T + b with W a PackedMatrix (inference only: no gradient flows to W)."""

    def __init__(self, packed: PackedMatrix, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = packed
        self.register_buffer("blocks", packed.data, persistent=False)  # counted as the model's memory
        self.in_features, self.out_features = packed.cols, packed.rows
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The whole (out, in) matrix dequantized to float32 (built on each access)."""
        return self.packed.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_cpu_float32(x, "PackedLinear")
        y = self.packed.matmul(x)  # (..., out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.packed.fmt}"


class PackedEmbedding(nn.Module):
    """nn.Embedding's lookup, each asked-for row dequantized from a PackedMatrix."""

    def __init__(self, packed: PackedMatrix):
        super().__init__()
        self.packed = packed
        self.register_buffer("blocks", packed.data, persistent=False)  # a tied head's is the same tensor
        self.num_embeddings, self.embedding_dim = packed.rows, packed.cols

    @property
    def weight(self) -> torch.Tensor:
        """The whole (V, C) table dequantized to float32 (built on each access)."""
        return self.packed.dequantize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.device.type != "cpu":
            raise ValueError(f"PackedEmbedding: ids on {ids.device}, packed weights live on the CPU")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        return self.packed.dequantize(ids).view(*ids.shape, self.embedding_dim)  # (..., C)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.packed.fmt}"

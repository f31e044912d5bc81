"""How the weights of a loaded model lie in memory on the CPU.

Every `nn.Linear` computes y = x W^T with W stored (out, in). Decoding one token per row
makes that a matrix-vector product that reads the whole weight once per token, so at
batch 1 the decode step is bound by how fast the weights stream from memory (the default
model's 4.3M fp32 parameters are about 17 MB per token, near the L3 cache's share on a
small machine). On the CPU the BLAS routine streams W^T in its (in, out) row-major layout
about 2.5x faster than W in its own layout (bench/README.md: 26 GB/s against 9.5 GB/s
from memory, one thread), which is why GPT-2's original Conv1D stores (in, out).

`store_linear_weights_transposed` keeps every name, shape and value and only changes the
strides: W (out, in) becomes a view of a contiguous (in, out) tensor. Products and sums are
the same numbers taken in a different order, so results agree to float rounding. Saving
(`model_state`) and the Hugging Face exports make contiguous copies as before.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def store_linear_weights_transposed(model: nn.Module) -> nn.Module:
    """Re-lay every Linear weight of `model` column-major (W.t() contiguous), in place.

    Only for inference on the CPU; a weight tied to an embedding (the LM head) moves with it.
    Idempotent: a weight already stored this way is left alone.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                w = module.weight
                if w.device.type == "cpu" and w.dim() == 2 and not w.t().is_contiguous():
                    w.data = w.data.t().contiguous().t()  # (out, in) view of an (in, out) tensor
    return model

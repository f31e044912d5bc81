"""The position-wise feed-forward network, plain or gated.

Shapes: (..., C) -> (..., C), C = d_model, F = d_ff.

    plain  proj(act(fc(x)))                      fc: (F, C)   GPT-2, BERT, GPT-NeoX
    gated  proj(act(x W_gate) * (x W_up))        fc: (2F, C), rows W_gate then W_up (one matmul);
                                                 act = silu: SwiGLU (Llama, Qwen2, Mistral), in
                                                 float32 inference on the CPU one C pass
                                                 (model/native/swiglu.c);
                                                 act = gelu / gelu_exact: GeGLU (Shazeer 2020)
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlens.model.config import ModelConfig
from attnlens.model.native import library as native
from attnlens.model.parts.linear import Linear


def activate(x: torch.Tensor, name: str) -> torch.Tensor:
    """The config's activation: "gelu" (tanh approximation, GPT-2), "gelu_exact" (erf, BERT),
    "silu" (x * sigmoid(x), Llama's gate) or "relu"."""
    if name == "gelu":
        return F.gelu(x, approximate="tanh")
    if name == "gelu_exact":
        return F.gelu(x)
    if name == "silu":
        return F.silu(x)
    return F.relu(x)


def native_swiglu(h: torch.Tensor) -> bool:
    """Whether silu(gate) * up of h (..., 2F) takes model/native/swiglu.c (one pass where torch makes
    three): float32 inference on the CPU, contiguous, and the kernels built here."""
    return (h.device.type == "cpu" and h.dtype == torch.float32 and not torch.is_grad_enabled() and h.is_contiguous()
            and native.available()[0])


class FeedForward(nn.Module):
    """Linear(C -> F) [gated: two of them, fused], activation, Linear(F -> C)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gated = config.ffn == "gated"
        bias = config.bias_of("ffn")
        self.fc = Linear(config.d_model, (2 if self.gated else 1) * config.d_ff, bias=bias)
        self.proj = Linear(config.d_ff, config.d_model, bias=bias)
        self.activation = config.activation
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # (B, T, F), gated: (B, T, 2F)
        if self.gated and self.activation == "silu" and native_swiglu(h):
            out = torch.empty(*h.shape[:-1], h.shape[-1] // 2, dtype=h.dtype)  # (B, T, F)
            native.load().swiglu(h.data_ptr(), h.numel() // h.shape[-1], h.shape[-1] // 2, out.data_ptr())
            return self.proj(out)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)  # 2 x (B, T, F)
            h = activate(gate, self.activation) * up
        else:
            h = activate(h, self.activation)
        h = self.proj(h)  # (B, T, C)
        return self.dropout(h) if self.training else h

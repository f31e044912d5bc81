"""The norms: LayerNorm (torch's) and RMSNorm, chosen by config.norm_type.

    LayerNorm  (x - mean) / sqrt(var + eps) * weight + bias        GPT-2, BERT, GPT-NeoX
    RMSNorm    x / sqrt(mean(x^2) + eps) * weight                  Llama, Qwen2, Mistral

Both normalise over the last dim C = d_model of (..., C).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlens.model.config import ModelConfig
from attnlens.model.native import library as native

NATIVE_ROWS = 16  # rows up to which the C kernel takes non-contiguous inputs too (copied first)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): no centring, no bias.

    The statistic is taken in float32 whatever the input's dtype (as Llama's reference code and
    transformers do), then the normalised value is cast back before the weight multiplies it:
    a bf16 model normalises like the original. In float32 there is nothing to cast, and the same
    formula runs as torch's one fused operator (F.rms_norm) instead of seven: 61 norms a token in
    SmolLM2's decode step (bench/README.md, issue 34); in inference on the CPU our C kernel
    (model/native/rms_norm.c), where it is built: a decode step's few rows ~15 us a call faster, a
    prefill's rows shared by the threads (SmolLM2's 2,048 rows, 2 threads: 0.24 ms against 1.07).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if x.device.type == "cpu" and (x.is_contiguous() or x.numel() <= NATIVE_ROWS * x.shape[-1]) \
                    and not torch.is_grad_enabled() and native.available()[0]:  # model/native/rms_norm.c
                xc, out = x.contiguous(), torch.empty_like(x, memory_format=torch.contiguous_format)
                native.load().rms_norm(xc.data_ptr(), xc.numel() // xc.shape[-1], xc.shape[-1],
                                       self.weight.data_ptr(), self.eps, out.data_ptr())
                return out
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()  # (..., C)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class HeadLayerNorm(nn.Module):
    """A LayerNorm without bias over each head's D dims, each head with its own weights (StableLM 2's
    q/k layernorm): (B, N, T, D) -> (B, N, T, D), weight (N, D)."""

    def __init__(self, n_heads: int, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n_heads, dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)  # (B, N, T, D)
        return h * self.weight[:, None, :]


def make_norm(config: ModelConfig) -> nn.Module:
    """The config's norm over d_model: LayerNorm (with a bias when config.bias) or RMSNorm."""
    if config.norm_type == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)

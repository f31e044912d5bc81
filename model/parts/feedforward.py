"""The position-wise feed-forward network, plain or gated.

Shapes: (..., C) -> (..., C), C = d_model, F = d_ff.

    plain  proj(act(fc(x)))                      fc: (F, C)   GPT-2, BERT, GPT-NeoX
    gated  proj(act(x W_gate) * (x W_up))        fc: (2F, C), rows W_gate then W_up (one matmul);
                                                 act = silu: SwiGLU (Llama, Qwen2, Mistral), in
                                                 float32 inference on the CPU one C pass
                                                 (model/native/swiglu.c);
                                                 act = gelu / gelu_exact: GeGLU (Shazeer 2020)
    experts  sum over the top k of E experts      router: (E, C); each expert a FeedForward;
             of weight_e * expert_e(x)            weights: softmax of the router's probabilities
                                                  renormalised over the k kept (Mixtral)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlens.model import hooks as _hooks
from attnlens.model.config import ModelConfig
from attnlens.model.hooks import HookPoint
from attnlens.model.native import library as native
from attnlens.model.parts.linear import Linear

Apply = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # how a mixture runs its router and experts


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
        self.macs_per_row = (3 if self.gated else 2) * config.d_model * config.d_ff  # a position's multiply-adds

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


class MixtureOfExperts(nn.Module):
    """A sparse mixture of experts (Mixtral): `router` scores the E experts of each token, the k
    (config.experts_per_token) most probable are kept, and their FFN outputs are summed weighed by
    their probabilities renormalised over the k (= the softmax of their k router logits).

    Each expert computes only its own tokens. Inside a CUDA graph capture (no host reads there)
    every expert computes every token with weight 0 for those not routed to it: the same sums.

    Hook points (model/hooks.py), called only under active hooks: hook_router [B, T, E] the
    router's probabilities over every expert (what the choice is made from: an edit reroutes),
    hook_experts [B, T, k] the chosen experts' indices, most probable first (int64).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.experts_per_token
        self.router = Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(config) for _ in range(config.n_experts))
        self.hook_router = HookPoint()  # [B, T, E]
        self.hook_experts = HookPoint()  # [B, T, k]

    def route(self, x: torch.Tensor, apply: Apply | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> (N, k) weights (float32) and chosen experts, N = B * T tokens."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        probs = torch.softmax((self.router(flat) if apply is None else apply(self.router, flat)).float(), dim=-1)  # (N, E)
        hooks = _hooks.active()
        if hooks is not None:
            probs = self.hook_router(probs.view(B, T, -1)).reshape(B * T, -1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if hooks is not None:
            chosen = self.hook_experts(chosen.view(B, T, -1)).reshape(B * T, -1)
        return weights, chosen

    def forward(self, x: torch.Tensor, apply: Apply | None = None) -> torch.Tensor:
        """`apply(part, t)`: how the router and each expert run on their rows (default part(t));
        model/analysis/block_runs.py passes its forms differentiable in t alone."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        weights, chosen = self.route(x, apply)
        run = (lambda part, t: part(t)) if apply is None else apply
        out = torch.zeros_like(flat)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():  # no host reads: every expert, weight 0 if unrouted
            for e, expert in enumerate(self.experts):
                w = (weights * (chosen == e)).sum(dim=-1, keepdim=True)  # (N, 1)
                out += run(expert, flat) * w.to(x.dtype)
            return out.view(B, T, C)
        for e in torch.unique(chosen).tolist():  # the experts some token chose, in order
            rows, slot = torch.where(chosen == e)  # (n,), (n,)
            y = run(self.experts[e], flat[rows]) * weights[rows, slot, None].to(x.dtype)  # (n, C)
            out.index_add_(0, rows, y)
        return out.view(B, T, C)

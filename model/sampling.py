"""Sampling many rows at once, each by its own rules and its own random numbers.

Every sampled row draws exactly one uniform number per step from its own generator (a CPU
`torch.Generator` seeded by the request, or torch's global one), so what a seeded request
samples never depends on the other rows of the batch, nor on the device. The tokens are then
picked for all rows together, on the logits' device, with no read back to the host:

    x = logits / temperature                          (N, V), each row its own temperature
    top-k / top-p (only when a row asks for them):    a mask: each row's k best, then the
                                                      smallest prefix of them reaching p
                                                      (always the best token)
    token = the first index, in vocabulary order, where the cumulative probability of
            softmax(x) exceeds u x total (inverse CDF)

This is `filter_logits` + a draw from the resulting distribution (one difference: top-k keeps
exactly k tokens, where filter_logits keeps every token tied with the k-th).
"""

from __future__ import annotations

import math

import torch


def draw_uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """One U[0, 1) number per row, from the row's own generator (None: torch's global one)."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])


def sample_batch(logits: torch.Tensor, params: list, uniforms: torch.Tensor) -> torch.Tensor:
    """(N,) token ids drawn from (N, V) logits, row i by params[i] (a SamplingParams with
    temperature > 0) with uniforms[i] in [0, 1); stays on the logits' device."""
    V = logits.shape[-1]
    device = logits.device
    x = logits.float() / torch.tensor([[max(p.temperature, 1e-8)] for p in params], device=device)  # (N, V)
    if any((p.top_k is not None and p.top_k < V) or p.top_p < 1.0 for p in params):
        x = x.masked_fill(~nucleus(x, params), float("-inf"))
    # the inverse CDF runs over the vocabulary in its own order (never a sorted one), so the
    # token a row's number falls on depends on that row alone, not on the others' rules
    cdf = torch.softmax(x, dim=-1).double().cumsum(dim=-1)  # (N, V); float64: u x total stays below the end
    target = uniforms.to(device=device, dtype=torch.float64)[:, None] * cdf[:, -1:]  # (N, 1)
    # the first index whose cumulative probability exceeds the target: a token of probability
    # 0 never is one (its cdf equals its predecessor's)
    return torch.searchsorted(cdf, target, right=True).clamp_(max=V - 1)[:, 0]


def nucleus(x: torch.Tensor, params: list) -> torch.Tensor:
    """(N, V) bool, True = kept: each row's k best of the scaled logits x, then the smallest
    prefix of those reaching probability top_p (the best token always). Rows without top-k
    or top-p keep everything. Only the candidates are ranked: top-k alone never sorts a row."""
    V = x.shape[-1]
    device = x.device
    ks = [min(p.top_k or V, V) for p in params]
    ranked, order = torch.topk(x, max(ks), dim=-1)  # (N, K): each row's K best, best first
    keep = torch.arange(ranked.shape[-1], device=device)[None, :] < torch.tensor(ks, device=device)[:, None]
    if any(p.top_p < 1.0 for p in params):
        probs = torch.softmax(ranked.masked_fill(~keep, float("-inf")), dim=-1)
        # top_p 1 must keep every token: no comparison against a cumulative sum that rounds to 1
        top_p = torch.tensor([[p.top_p if p.top_p < 1.0 else math.inf] for p in params], device=device)
        keep &= (probs.cumsum(dim=-1) - probs) < top_p  # drop once the tokens ranked above reach p
        keep[:, 0] = True  # the nucleus always keeps the best token
    return torch.zeros_like(x, dtype=torch.bool).scatter_(-1, order, keep)  # back to vocabulary order

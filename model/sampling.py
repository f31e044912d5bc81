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
    ks = [min(p.top_k or V, V) for p in params]
    filtered = any(k < V for k in ks) or any(p.top_p < 1.0 for p in params)
    # every row's rules and number in one host-to-device copy: temperature, k, top_p, u
    # (top_p 1 becomes inf: no comparison against a cumulative sum that rounds to 1)
    rules = torch.tensor([[max(p.temperature, 1e-8), k, p.top_p if p.top_p < 1.0 else math.inf, 0.0]
                          for p, k in zip(params, ks)], dtype=torch.float64)
    rules[:, 3] = uniforms
    rules = rules.to(logits.device)
    x = logits.float() / rules[:, 0:1].float()  # (N, V)
    if filtered:
        x = x.masked_fill(~nucleus(x, max(ks), rules[:, 1:2], rules[:, 2:3]), float("-inf"))
    # the inverse CDF runs over the vocabulary in its own order (never a sorted one), so the
    # token a row's number falls on depends on that row alone, not on the others' rules
    cdf = torch.softmax(x, dim=-1).double().cumsum(dim=-1)  # (N, V); float64: u x total stays below the end
    target = rules[:, 3:4] * cdf[:, -1:]  # (N, 1)
    # the first index whose cumulative probability exceeds the target: a token of probability
    # 0 never is one (its cdf equals its predecessor's)
    return torch.searchsorted(cdf, target, right=True).clamp_(max=V - 1)[:, 0]


def nucleus(x: torch.Tensor, k_max: int, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(N, V) bool, True = kept: each row's k best of the scaled logits x (k (N, 1)), then the
    smallest prefix of those reaching probability top_p (N, 1) (the best token always). Only
    the k_max best of each row are ranked: top-k alone never sorts a whole row."""
    ranked, order = torch.topk(x, k_max, dim=-1)  # (N, K): each row's K best, best first
    keep = torch.arange(k_max, device=x.device)[None, :] < k
    probs = torch.softmax(ranked.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= (probs.cumsum(dim=-1) - probs).double() < top_p  # drop once the tokens ranked above reach p
    keep[:, 0] = True  # the nucleus always keeps the best token
    return torch.zeros_like(x, dtype=torch.bool).scatter_(-1, order, keep)  # back to vocabulary order

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

A request's rules are chosen field by field (`choose`: the request's, else the model's recommended
SamplingDefaults of its generation_config.json, model/generation_config.py, else the API's).
The rows' rules (SamplingParams), each row's sampler (RowSampler: its rules, its generator, its
penalty counts) and the tokens picked (GeneratedToken, sample_rows) are here too, below the
decode loop (model/decoding.py) and the CUDA-graphed step (model/cuda_graphs.py) that both use them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

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


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling fields a request may leave unset; None: not set at this level (the next applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0: every token (no top-k)

    def over(self, base: SamplingDefaults) -> SamplingDefaults:
        """Each field of this one where it is set, else base's."""
        return SamplingDefaults(*(a if a is not None else b for a, b in
                                  zip(asdict(self).values(), asdict(base).values())))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def empty(self) -> bool:
        return self == SamplingDefaults()


def choose(request: SamplingDefaults, model: SamplingDefaults, api: SamplingDefaults) -> dict[str, Any]:
    """SamplingParams' temperature, top_p and top_k for a request: each field the request's, else
    the model's, else the API's own default (top_k 0 or less: None, every token)."""
    picked = request.over(model).over(api)
    assert picked.temperature is not None and picked.top_p is not None, "the API's defaults set both"
    top_k = picked.top_k if picked.top_k is not None and picked.top_k > 0 else None
    return {"temperature": picked.temperature, "top_p": picked.top_p, "top_k": top_k}


@dataclass
class SamplingParams:
    temperature: float = 0.8  # 0 = greedy
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    # OpenAI's (and vLLM's) logit adjustments, applied before temperature, top-k/p and greedy
    # picks alike: logit_bias[t] is added to token t's logit; each token already generated in
    # this row loses presence_penalty once and frequency_penalty per time it was generated
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GeneratedToken:
    id: int
    logprob: float  # under the model's own distribution (temperature 1, no filtering)
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # The attention rows of the position that produced this token, from the family's step groups
    # (GenerationSpec.step_groups): its self-attention, per layer (H, positions so far), and, for
    # a family whose step reads another sequence (a cross group), that row, per layer (H, source
    # positions)
    attention: list[torch.Tensor] | None = None
    cross_attention: list[torch.Tensor] | None = None


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to (..., V) logits; removed entries become -inf."""
    logits = logits.float() / max(params.temperature, 1e-8)
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= params.top_p
        # the nucleus always keeps the most likely token (a top_p below float32's range,
        # e.g. 1e-300, rounds to 0 and would otherwise drop every token)
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def make_generator(seed: int | None) -> torch.Generator | None:
    """A request's own random generator (on the CPU whatever the model's device: a sampled row
    draws one number per step from it, see model.sampling), or None for torch's global one."""
    if seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(int(seed))
    return gen


@dataclass
class RowSampler:
    """How one cache row picks its next token: its parameters and its own random generator
    (and, for penalties, how often it has generated each token)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    n_logprobs: int = 0  # alternatives to report
    return_attention: bool = False
    counts: torch.Tensor | None = None  # (V,) times each token was generated (penalties only)
    bias: torch.Tensor | None = None  # (V,) the dense logit_bias (made at the first step)
    vocab_limit: int | None = None  # ids >= this have no token (a vocabulary padded past the tokenizer's)

    @property
    def adjusts_logits(self) -> bool:
        return self.params.adjusts_logits


def adjust_logits(logits: torch.Tensor, samplers: list[RowSampler]) -> torch.Tensor:
    """(B, V) logits with each row's logit_bias added and its presence / frequency penalties
    subtracted over the tokens that row has generated (vLLM's penalties); rows that ask for
    none are left as they are. The counts of tokens generated so far live on each sampler."""
    rows = [i for i, s in enumerate(samplers) if s.adjusts_logits]
    if not rows:
        return logits
    B, V = logits.shape
    row_counts, row_bias = [], []
    for i in rows:
        s = samplers[i]
        if s.counts is None or s.counts.shape[0] != V or s.counts.device != logits.device:
            s.counts = torch.zeros(V, dtype=torch.float32, device=logits.device)
            bias = torch.zeros(V, dtype=torch.float32)
            for token, value in (s.params.logit_bias or {}).items():
                if 0 <= token < V:
                    bias[token] = value
            s.bias = bias.to(logits.device)
        assert s.bias is not None  # made with the counts
        row_counts.append(s.counts)
        row_bias.append(s.bias)
    picked = [samplers[i] for i in rows]
    counts = torch.stack(row_counts)  # (R, V)
    rules = torch.tensor([[s.params.frequency_penalty, s.params.presence_penalty] for s in picked],
                         dtype=torch.float32).to(logits.device)  # (R, 2)
    delta = torch.stack(row_bias) - rules[:, :1] * counts - rules[:, 1:] * (counts > 0)
    out = logits.clone()
    out[rows] += delta
    return out


def count_generated(samplers: list[RowSampler], ids: torch.Tensor) -> None:
    """Each row that penalises repeats counts the token it just took (ids (B,), same device)."""
    for i, s in enumerate(samplers):
        if s.counts is not None:
            s.counts[ids[i]] += 1


def sample_rows(logits: torch.Tensor, samplers: list[RowSampler]) -> list[GeneratedToken]:
    """Pick one token per row of (B, V) logits, each row by its own sampler.

    Rows with a logit_bias or penalties get them first (adjust_logits). Greedy rows share one
    argmax; sampled rows are drawn together (model.sampling), each by its own rules with one
    number from its own generator, so a seeded request draws the same tokens whatever else is
    in the batch. Log-probabilities are under the model's own distribution (temperature 1, no
    filtering, no bias or penalty: vLLM's raw log-probabilities).
    """
    logits = logits.float()
    limit = min((s.vocab_limit for s in samplers if s.vocab_limit is not None), default=None)
    if limit is not None and limit < logits.shape[-1]:
        # Qwen2's embedding has rows past its tokenizer's last id: never pick one, never count it
        logits = logits.clone()
        logits[:, limit:] = float("-inf")
    scores = adjust_logits(logits, samplers)  # logit_bias and penalties, for the rows that ask
    ids = scores.argmax(dim=-1)  # (B,): the greedy choice of every row
    sampled = [i for i, s in enumerate(samplers) if s.params.temperature != 0]
    if sampled:
        rows = [samplers[i] for i in sampled]
        ids = ids.clone()
        uniforms = draw_uniforms([s.generator for s in rows])  # one number per sampled row, from its generator
        ids[sampled] = sample_batch(scores[sampled], [s.params for s in rows], uniforms)
    if scores is not logits:
        count_generated(samplers, ids)
    # log p(token) under the model's own distribution; one fused log-softmax (cheaper than
    # logsumexp), one read back to the host for ids and log-probs together
    logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
    chosen = logprobs.gather(1, ids[:, None])[:, 0]  # (B,)
    ids, chosen = torch.stack((ids.to(chosen.dtype), chosen)).tolist()  # V < 2^24: ids exact as floats
    tokens = [GeneratedToken(id=int(t), logprob=lp) for t, lp in zip(ids, chosen)]
    k = max((s.n_logprobs for s in samplers), default=0)
    if k > 0:
        top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)  # (B, k)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
        for i, s in enumerate(samplers):
            if s.n_logprobs > 0:
                tokens[i].top_ids = top_ids[i][: s.n_logprobs]
                tokens[i].top_logprobs = top_values[i][: s.n_logprobs]
    return tokens

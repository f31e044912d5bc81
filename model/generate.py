"""Autoregressive decoding with a KV cache: sampling rules and a token-by-token generator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from .transformer import Transformer


@dataclass
class SamplingParams:
    temperature: float = 0.8  # 0 = greedy
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None

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
    # attention of the position that produced this token: per layer (H, positions so far)
    attention: list[torch.Tensor] | None = None


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


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from a (V,) logit vector."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate_tokens(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams | None = None,
    *,
    n_logprobs: int = 0,
    return_attention: bool = False,
) -> Iterator[GeneratedToken]:
    """Yield up to `max_new_tokens` tokens after `prompt_ids`, one model step each.

    The caller decides when to stop early (stop strings, EOS, a disconnected client):
    it simply stops iterating.
    """
    params = params or SamplingParams()
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    device = model.tok_emb.weight.device
    generator = make_generator(params.seed, device)
    cache = model.new_kv_cache(1)
    inputs = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    remaining = min(max_new_tokens, model.config.context_length - len(prompt_ids) + 1)
    for step in range(remaining):
        out = model(inputs, kv_cache=cache, return_attention=return_attention, last_only=True)
        logits, attn = out if return_attention else (out, None)
        row = logits[0, -1].float()
        token = choose_token(row, params, generator)
        logprobs = torch.log_softmax(row, dim=-1)
        result = GeneratedToken(id=token, logprob=float(logprobs[token]))
        if n_logprobs > 0:
            top = torch.topk(logprobs, min(n_logprobs, logprobs.shape[-1]))
            result.top_ids = top.indices.tolist()
            result.top_logprobs = top.values.tolist()
        if attn is not None:
            result.attention = [a[0, :, -1, :].float().cpu() for a in attn]  # (H, S) per layer
        yield result
        if step + 1 < remaining:
            inputs = torch.tensor([[token]], dtype=torch.long, device=device)

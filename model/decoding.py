"""Autoregressive decoding with a KV cache: sampling rules, the one decode step (a batch of
cache rows, each sampled by its own rules), and a token-by-token generator built on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from .kv_cache import KVCache, pageable
from .sampling import draw_uniforms, sample_batch

from .families.contract import GenerativeModel, family_of

if TYPE_CHECKING:
    from .cuda_graphs import GraphedDecoder


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
    for i in rows:
        s = samplers[i]
        if s.counts is None or s.counts.shape[0] != V or s.counts.device != logits.device:
            s.counts = torch.zeros(V, dtype=torch.float32, device=logits.device)
            bias = torch.zeros(V, dtype=torch.float32)
            for token, value in (s.params.logit_bias or {}).items():
                if 0 <= token < V:
                    bias[token] = value
            s.bias = bias.to(logits.device)
    picked = [samplers[i] for i in rows]
    counts = torch.stack([s.counts for s in picked])  # (R, V)
    rules = torch.tensor([[s.params.frequency_penalty, s.params.presence_penalty] for s in picked],
                         dtype=torch.float32).to(logits.device)  # (R, 2)
    delta = torch.stack([s.bias for s in picked]) - rules[:, :1] * counts - rules[:, 1:] * (counts > 0)
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


@dataclass
class StepOutput:
    tokens: list[GeneratedToken]  # one per row, in row order
    output: tuple  # the family's forward output: logits (for prompt scoring) and attentions


def decode_step(
    model: GenerativeModel,
    cache: KVCache,
    inputs: torch.Tensor,
    samplers: list[RowSampler],
    *,
    rows: slice | None = None,
    last_only: bool = True,
    n_new: list[int] | None = None,
    graphs: "GraphedDecoder | None" = None,
    while_running: Callable[[], None] | None = None,
) -> StepOutput:
    """One step for a batch of cache rows: feed (B, T) new ids to rows `rows` (default
    0 .. B-1), then pick each row's next token. The single decode step of both
    `generate_tokens` and the service's engine; T > 1 is a prefill. With `n_new`, row b's
    real tokens are inputs[b, :n_new[b]] (right-padded prompts of different lengths,
    prefilled together) and its next token comes from its last real position.

    A row whose sampler asks for attention gets, per layer, the (H, length) attention row of
    its last position: its own keys only, never the padding of longer rows.

    With `graphs` (model.cuda_graphs.GraphedDecoder on the same cache), a one-token step over
    rows 0 .. B-1 replays a captured CUDA graph instead, with or without attention (its
    inputs best stay on the host: the graph copies them in with the rows' lengths at once).

    `while_running` is called once the step's work is launched and before its results are
    read back: on a GPU the caller's own work there overlaps the device's.
    """
    want_attention = any(s.return_attention for s in samplers)
    if (graphs is not None and inputs.shape[1] == 1 and n_new is None
            and cache.row_slice(rows, inputs.shape[0]).start == 0):
        step, tokens = graphs.decode(inputs, samplers, while_running)
        out = family_of(model).output(step.logits, step.attentions)  # attentions (B, H, 1, P): zeros past each row
    else:
        inputs = inputs.to(model.tok_emb.weight.device)  # ids may come from the host (a no-op when already there)
        valid = torch.tensor(n_new) if n_new is not None else None
        out = model(inputs, kv_cache=cache, rows=rows, return_attention=want_attention, last_only=last_only,
                    valid=valid)
        if while_running is not None:
            while_running()
        if valid is None or last_only:
            last = out.logits[:, -1]  # (B, V)
        else:
            last = out.logits[torch.arange(len(n_new)), valid - 1]  # each row's last real position
        tokens = sample_rows(last, samplers)
    if want_attention:
        rows = cache.row_slice(rows, inputs.shape[0])
        # each row's newest query (an encoder-decoder's prefill has one query: the decoder's start
        # token; its prompt was the source)
        queries = [-1 if n_new is None or out.attentions[0].shape[2] == 1 else n - 1
                   for n in (n_new or [0] * inputs.shape[0])]
        family = family_of(model)
        for tok, s, maps in zip(tokens, samplers, model.step_attention(out, cache, rows, queries)):
            if s.return_attention:
                for name in family.generation.step_groups:
                    host = [m.float().cpu() for m in maps[name]]  # per layer (H, keys of this row)
                    if family.group(name).is_cross:
                        tok.cross_attention = host
                    else:
                        tok.attention = host
    return StepOutput(tokens, out)


@torch.inference_mode()
def generate_tokens(
    model: GenerativeModel,
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
    sampler = RowSampler(params, make_generator(params.seed), n_logprobs, return_attention)
    # on the CPU the cache takes blocks as the tokens come instead of zeroing the whole context up
    # front: SmolLM2's 8,192 positions are 377 MB, 100 ms of memset before the first token
    cache = model.new_kv_cache(1, paged=True) if device.type == "cpu" and pageable(model) else model.new_kv_cache(1)
    inputs = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    remaining = min(max_new_tokens, model.config.context_length - len(prompt_ids) + 1)
    for step in range(remaining):
        token = decode_step(model, cache, inputs, [sampler]).tokens[0]
        yield token
        if step + 1 < remaining:
            inputs = torch.tensor([[token.id]], dtype=torch.long, device=device)

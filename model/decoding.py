"""Autoregressive decoding with a KV cache: sampling rules, the one decode step (a batch of
cache rows, each sampled by its own rules), and a token-by-token generator built on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from attnlens.model.families.contract import GenerativeModel, family_of
from attnlens.model.kv_cache import RowCache, pageable

# each row's sampling rules and the tokens they pick (model/sampling.py), named here too: the
# decode loop's vocabulary, and where callers have always imported them from
from attnlens.model.sampling import (  # noqa: F401
    GeneratedToken,
    RowSampler,
    SamplingParams,
    filter_logits,
    make_generator,
    sample_rows,
)

if TYPE_CHECKING:
    from attnlens.model.cuda_graphs import GraphedDecoder


@dataclass
class StepOutput:
    tokens: list[GeneratedToken]  # one per row, in row order
    output: tuple  # the family's forward output: logits (for prompt scoring) and attentions


def decode_step(
    model: GenerativeModel,
    cache: RowCache,
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
        inputs = inputs.to(model.device)  # ids may come from the host (a no-op when already there)
        valid = torch.tensor(n_new) if n_new is not None else None
        out = model(inputs, kv_cache=cache, rows=rows, return_attention=want_attention, last_only=last_only,
                    valid=valid)
        if while_running is not None:
            while_running()
        if n_new is None or valid is None or last_only:
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
        generation = family.generation
        assert generation is not None  # a model that decodes steps is of a family that generates
        for tok, s, maps in zip(tokens, samplers, model.step_attention(out, cache, rows, queries)):
            if s.return_attention:
                for name in generation.step_groups:
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
    device = model.device
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

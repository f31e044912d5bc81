"""Ablation on the batched decode path: an ablated generation shares its decode batch with
unablated ones, its edit applies to its own row only, and each row equals that request run alone
(zero ablation: a full recompute of every token; mean: the prompt's mean held at prefill)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from attnlens.app.engine import Engine, EngineProcess, GenerationParams
from attnlens.model import SamplingParams, load_checkpoint
from attnlens.model.decoding import generate_tokens
from attnlens.model.families import family_of
from attnlens.model.hooks import HeadAblation, Hooks, ablation_targets, hooked
from attnlens.app.schemas import StreamToken
from helpers import DEVICES, run_async
from test_hooks import full_recompute_ids

@pytest.fixture(scope="module", params=DEVICES)
def ckpt(request, tiny_checkpoint):
    """The tiny checkpoint on the CPU and, where there is one, on CUDA (where a step with an ablated
    row leaves the captured graphs for the eager step)."""
    return load_checkpoint(tiny_checkpoint, device=request.param)


PROMPTS = ["To be, or not to be", "Whether 'tis nobler in the mind to suffer", "The slings"]


def edits_of(model, *ablations):
    return ablation_targets(family_of(model), model.config, list(ablations))


def alone(model, prompt, n, edits, **sampling) -> list[tuple[int, float]]:
    """(id, logprob) of each token the request generates run by itself (up to its EOS)."""
    with hooked(model, Hooks(ablate=edits) if edits else None):
        return [(t.id, t.logprob) for t in generate_tokens(model, prompt, n, SamplingParams(**sampling))]


async def tokens_of(generation) -> list[tuple[int, float]]:
    return [(e.id, e.logprob) async for e in generation.events() if isinstance(e, StreamToken)]


@pytest.mark.parametrize("kind,how", [("thread", "zero"), ("thread", "mean"), ("process", "mean")])
def test_an_ablated_row_shares_the_batch_and_equals_itself_alone(ckpt, tiny_checkpoint, kind, how):
    """Three generations decode in one batch (thread: the engine here; process: its own process, the
    ablations pickled across); row 0 unablated, rows 1 (sampled) and 2 (greedy) ablated."""
    model = ckpt.model
    edits = edits_of(model, HeadAblation(0, 1, how), HeadAblation(1, 3, how))
    prompts = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    n = 12
    sampling = [dict(temperature=0.0), dict(temperature=0.9, seed=7), dict(temperature=0.0)]
    rows = [(), edits, edits]  # row 0 unablated, rows 1 and 2 ablated (one sampled, one greedy)
    engine = (Engine(ckpt, max_concurrent=4) if kind == "thread" else
              EngineProcess(ckpt, model_dir=tiny_checkpoint, device=str(ckpt.model.tok_emb.weight.device),
                            dtype="float32", max_concurrent=4))
    try:
        async def main():
            gens = engine.submit_all([GenerationParams(prompt_ids=p, max_new_tokens=n, sampling=SamplingParams(**s),
                                                       ablate=e) for p, s, e in zip(prompts, sampling, rows)])
            return await asyncio.gather(*(tokens_of(g) for g in gens))

        results = run_async(main())
    finally:
        engine.close()
    for got, p, s, e in zip(results, prompts, sampling, rows):
        ref = alone(model, p, n, e, **s)[: len(got)]  # the engine's stream ends at an EOS
        assert [i for i, _ in got] == [i for i, _ in ref]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in ref], abs=1e-4)
    if how == "zero":  # the greedy ablated row equals a full recompute of every token
        ids = [i for i, _ in results[2]]
        assert ids == full_recompute_ids(model, prompts[2], n, edits)[: len(ids)]
    # the ablation changed the ablated rows' numbers, and only theirs
    clean = alone(model, prompts[2], n, (), temperature=0.0)
    assert max(abs(a[1] - b[1]) for a, b in zip(results[2], clean)) > 1e-3

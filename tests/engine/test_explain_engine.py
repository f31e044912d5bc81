"""Ablation on the batched decode path: an ablated generation shares its decode batch with
unablated ones, its edit applies to its own row only, and each row equals that request run alone
(zero ablation: a full recompute of every token; mean: the prompt's mean held at prefill)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import DEVICES, run_async
from test_hooks import full_recompute_ids

from attnlens.app.engine import Engine, EngineProcess, GenerationParams
from attnlens.app.engine.outputs import TokenEvent
from attnlens.model import SamplingParams, load_checkpoint
from attnlens.model.decoding import generate_tokens
from attnlens.model.families import family_of
from attnlens.model.hooks import HeadAblation, Hooks, ablation_targets, hooked


@pytest.fixture(scope="module", params=DEVICES)
def ckpt(request, tiny_checkpoint):
    """The tiny checkpoint on the CPU and, where there is one, on CUDA (where a step with an ablated
    row leaves the captured graphs for the eager step)."""
    return load_checkpoint(tiny_checkpoint, device=request.param)


PROMPTS = ["To be, or not to be", "Whether 'tis nobler in the mind to suffer", "The slings"]


def edits_of(model, *ablations):
    return ablation_targets(family_of(model), model.config, list(ablations))


def alone(model, prompt, n, edits, means: list | None = None, **sampling) -> list[tuple[int, float]]:
    """(id, logprob) of each token the request generates run by itself (up to its EOS); `means`, when
    given, gets the mean z the mean ablations held (taken at the prompt's prefill)."""
    hooks = Hooks(ablate=edits) if edits else None
    with hooked(model, hooks):
        out = [(t.id, t.logprob) for t in generate_tokens(model, prompt, n, SamplingParams(**sampling))]
    if means is not None and hooks is not None:
        means.append(hooks.row_means[0] if hooks.row_means else {})
    return out


def assert_same_means(held: dict, reference: dict) -> None:
    """The mean z a batched row held equals the one its prompt alone gives (its padding left out)."""
    assert held.keys() == reference.keys()
    for key in held:
        torch.testing.assert_close(held[key], reference[key], atol=1e-5, rtol=0)


async def tokens_of(generation) -> list[tuple[int, float]]:
    return [(e.id, e.logprob) async for e in generation.events() if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("kind,how", [("thread", "zero"), ("thread", "mean"), ("process", "mean")])
def test_an_ablated_row_shares_the_batch_and_equals_itself_alone(ckpt, tiny_checkpoint, kind, how):
    """Three generations decode in one batch (thread: the engine here; process: its own process, the
    ablations pickled across); rows 0 and 2 (greedy) ablated, row 1 (sampled) not."""
    model = ckpt.model
    edits = edits_of(model, HeadAblation(0, 1, how), HeadAblation(1, 3, how))
    prompts = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    n = 12
    sampling = [dict(temperature=0.0), dict(temperature=0.9, seed=7), dict(temperature=0.0)]
    # rows 0 and 2 ablated: row 0's prompt is prefilled with row 1's, right-padded to its length
    # (its mean is over its own positions); row 1 (sampled) unablated
    rows = [edits, (), edits]
    held = []
    engine = (Engine(ckpt, max_concurrent=4) if kind == "thread" else
              EngineProcess(ckpt, model_dir=tiny_checkpoint, device=str(ckpt.model.tok_emb.weight.device),
                            dtype="float32", max_concurrent=4))
    try:
        async def main():
            gens = engine.submit_all([GenerationParams(prompt_ids=p, max_new_tokens=n, sampling=SamplingParams(**s),
                                                       ablate=e) for p, s, e in zip(prompts, sampling, rows)])
            held.extend(gens)
            return await asyncio.gather(*(tokens_of(g) for g in gens))

        results = run_async(main())
    finally:
        engine.close()
    for got, p, s, e, g in zip(results, prompts, sampling, rows, held):
        means = []
        ref = alone(model, p, n, e, means, **s)[: len(got)]  # the engine's stream ends at an EOS
        if kind == "thread" and e and how == "mean":  # the prompt's own positions, not the batch's padding
            assert_same_means(g.generation.ablation_means, means[0])
        assert [i for i, _ in got] == [i for i, _ in ref]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in ref], abs=1e-4)
    if how == "zero":  # the greedy ablated row equals a full recompute of every token
        ids = [i for i, _ in results[2]]
        assert ids == full_recompute_ids(model, prompts[2], n, edits)[: len(ids)]
    # the ablation changed the ablated rows' numbers, and only theirs
    clean = alone(model, prompts[2], n, (), temperature=0.0)
    assert max(abs(a[1] - b[1]) for a, b in zip(results[2], clean)) > 1e-3


def test_translator_rows_ablate_each_group_in_one_batch(tmp_path):
    """An encoder-decoder's prompts are sources of different lengths, prefilled together (the encoder
    reads them right-padded: a mean is over each row's own positions); rows ablate heads of the
    encoder, the decoder and the cross group, each equal to itself run alone."""
    from translator_helpers import make_tiny_translator

    ckpt = load_checkpoint(make_tiny_translator(tmp_path / "tr"))
    model = ckpt.model
    with torch.no_grad():  # sharp attention, so that a head's z moves away from its mean
        for block in [*model.encoder.blocks, *model.decoder.blocks]:
            for attn in (block.attn, block.cross_attn):
                if attn is not None:
                    attn.qkv.weight.mul_(8)
    sources = [[6, 10, 12], [5, 9, 12, 7, 30, 31, 8], [11, 4, 17, 9]]  # row 0's source is padded in the batch
    rows = [edits_of(model, HeadAblation(1, 2, "mean", "encoder"), HeadAblation(0, 1, "mean", "cross")),
            (), edits_of(model, HeadAblation(1, 0, "mean", "decoder"), HeadAblation(0, 3, "zero", "encoder"))]
    n = 8
    held = []
    engine = Engine(ckpt, max_concurrent=4)
    try:
        async def main():
            gens = engine.submit_all([GenerationParams(prompt_ids=s, max_new_tokens=n,
                                                       sampling=SamplingParams(temperature=0.0), ablate=e)
                                      for s, e in zip(sources, rows)])
            held.extend(gens)
            return await asyncio.gather(*(tokens_of(g) for g in gens))

        results = run_async(main())
    finally:
        engine.close()
    for got, s, e, g in zip(results, sources, rows, held):
        means = []
        ref = alone(model, s, n, e, means, temperature=0.0)[: len(got)]
        if e:
            assert_same_means(g.generation.ablation_means, means[0])
        assert [i for i, _ in got] == [i for i, _ in ref]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in ref], abs=1e-4)
    for row in (0, 2):  # the ablations changed something
        clean = alone(model, sources[row], n, (), temperature=0.0)
        assert max(abs(a[1] - b[1]) for a, b in zip(results[row], clean)) > 1e-4

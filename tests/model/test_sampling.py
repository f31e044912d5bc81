"""Batched sampling (model/sampling.py): the distribution it draws from is softmax(filter_logits)
(checked by frequencies over many draws), each row is independent of the batch around it, and
the inverse CDF picks the token a uniform number falls on."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import DEVICES

from attnlens.model.decoding import SamplingParams, filter_logits
from attnlens.model.sampling import draw_uniforms, sample_batch

CASES = [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=1.3, top_p=0.8),
         dict(temperature=0.9, top_k=8, top_p=0.6)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_frequencies_follow_the_filtered_softmax(case, device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 20, generator=g) * 2
    params = SamplingParams(**case)
    want = torch.softmax(filter_logits(logits[0], params), dim=-1)
    n = 40_000
    ids = sample_batch(logits.to(device).expand(n, -1), [params] * n, torch.rand(n, generator=g, dtype=torch.float64))
    assert ids.device.type == device
    got = torch.bincount(ids.cpu(), minlength=20).double() / n
    assert (got[want == 0] == 0).all()  # filtered tokens are never drawn
    assert (got - want.double()).abs().max() < 4 * math.sqrt(0.25 / n)


@pytest.mark.parametrize("device", DEVICES)
def test_each_row_is_independent_of_the_batch(device):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g).to(device)
    params = [SamplingParams(**c) for c in CASES] + [SamplingParams(temperature=0.5), SamplingParams(top_p=0.3)]
    u = torch.rand(6, generator=g, dtype=torch.float64)
    together = sample_batch(logits, params, u)
    alone = torch.cat([sample_batch(logits[i : i + 1], [params[i]], u[i : i + 1]) for i in range(6)])
    assert together.tolist() == alone.tolist()


def test_the_uniform_number_falls_on_its_token():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    p = SamplingParams(temperature=1.0)
    picks = [sample_batch(logits, [p], torch.tensor([u], dtype=torch.float64)).item() for u in (0.0, 0.49, 0.51, 0.74,
                                                                                                  0.76, 0.999999)]
    assert picks == [0, 0, 1, 1, 2, 2]


def test_top_k_1_and_a_tiny_top_p_keep_only_the_best_token():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 30, generator=g)
    u = torch.rand(4, generator=g, dtype=torch.float64)
    for p in (SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-300)):
        assert sample_batch(logits, [p] * 4, u).tolist() == logits.argmax(-1).tolist()


def test_seeded_generators_repeat_and_unseeded_rows_use_the_global_generator():
    a = draw_uniforms([torch.Generator().manual_seed(5), None])
    b = draw_uniforms([torch.Generator().manual_seed(5), None])
    assert a[0] == b[0] and a.dtype == torch.float64 and ((a >= 0) & (a < 1)).all()


def test_sample_rows_draws_its_sampled_rows_from_their_own_generators():
    """sample_rows: greedy rows take the argmax, each sampled row the token its generator's next
    number falls on (drawn here again from an identically seeded generator), and every row's
    log-probability is that of its token under the model's own softmax."""
    from attnlens.model.decoding import RowSampler, make_generator, sample_rows

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(10, 40, generator=g)
    params = [SamplingParams(temperature=0)] * 2 + [SamplingParams(temperature=1.5, seed=10 + i) for i in range(7)]
    params.append(SamplingParams(temperature=1.2, top_k=5, seed=99))
    tokens = sample_rows(logits, [RowSampler(p, make_generator(p.seed)) for p in params])
    want = logits.argmax(-1).tolist()
    for i in range(2, 10):
        u = draw_uniforms([make_generator(params[i].seed)])
        want[i] = sample_batch(logits[i : i + 1], [params[i]], u).item()
    assert [t.id for t in tokens] == want
    lp = torch.log_softmax(logits, -1)
    assert [t.logprob for t in tokens] == pytest.approx([lp[i, t].item() for i, t in enumerate(want)], abs=1e-6)


def test_ids_past_the_tokenizer_are_never_picked_and_take_no_probability():
    """A vocabulary padded past its tokenizer's last id (Qwen2: 151936 rows, 151646 tokens):
    those ids have no text, so the engine's samplers (vocab_limit) never choose them, greedy or
    sampled, and the log-probabilities are over the real tokens alone."""
    from attnlens.model.decoding import RowSampler, make_generator, sample_rows

    logits = torch.zeros(2, 12)
    logits[:, 10:] = 50.0  # the padding rows would win everything
    logits[:, 3] = 1.0
    greedy = RowSampler(SamplingParams(temperature=0.0), vocab_limit=10, n_logprobs=3)
    sampled = RowSampler(SamplingParams(temperature=1.0, seed=1), make_generator(1), vocab_limit=10)
    for _ in range(20):
        a, b = sample_rows(logits.clone(), [greedy, sampled])
        assert a.id == 3 and b.id < 10 and all(i < 10 for i in a.top_ids)
    want = torch.log_softmax(logits[0, :10], dim=-1)[3].item()
    assert abs(a.logprob - want) < 1e-6

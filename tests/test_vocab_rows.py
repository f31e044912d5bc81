"""model/analysis/vocab_rows.py against torch's own operations: the striped top-k equals torch.topk, the
rank count equals a boolean count, the statistics equal log_softmax's, and the row slices cover
every row once."""

import pytest
import torch

from attnlens.model.analysis import vocab_rows


@pytest.mark.parametrize("vocab", [50, 4096, 4099, 50257])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k_equals_torch_topk(vocab, k):
    g = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(37, vocab, generator=g) * 4
    # the largest entries packed into a few stripes' columns and into the ids past the last stripe
    x[0, :k] += 100
    x[1, vocab - k:] += 100
    stripe_starts = torch.arange(k) * (vocab // vocab_rows.STRIPES)
    x[2, stripe_starts[stripe_starts < vocab]] += 100
    values, ids = vocab_rows.top_k(x, k)
    want = torch.topk(x, k, dim=-1)
    assert torch.equal(ids, want.indices) and torch.equal(values, want.values)


def test_top_k_takes_at_most_the_vocabulary():
    x = torch.randn(3, 4)
    values, ids = vocab_rows.top_k(x, 9)
    assert ids.shape == (3, 4) and torch.equal(values, torch.sort(x, descending=True).values)


def test_top_k_with_ties_gives_equal_values():
    x = torch.zeros(4, 4096)
    x[:, 7] = x[:, 900] = x[:, 4000] = 1.0
    values, ids = vocab_rows.top_k(x, 2)
    assert torch.equal(values, torch.ones(4, 2)) and all(set(r) <= {7, 900, 4000} for r in ids.tolist())


def test_count_greater_counts_strictly_greater_entries():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0], [0.0, -1.0, 5.0, 5.0]])
    floor = torch.tensor([[2.0], [5.0]])
    assert vocab_rows.count_greater(x, floor).tolist() == [1, 0]
    y = torch.randn(64, 1000)
    f = y[:, 10:11]
    assert torch.equal(vocab_rows.count_greater(y, f), (y > f).sum(-1))


def test_next_token_stats_equal_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 3000, generator=g) * 5
    picks = torch.randint(0, 3000, (20, 1), generator=g)
    stats = vocab_rows.next_token_stats(logits, picks, 4)
    ref = torch.log_softmax(logits, dim=-1)
    top = torch.topk(ref, 4, dim=-1)
    assert torch.equal(stats.top_ids, top.indices)
    torch.testing.assert_close(stats.top_logprobs, top.values, atol=1e-5, rtol=0)
    torch.testing.assert_close(stats.picked_logprob, ref.gather(1, picks)[:, 0], atol=1e-5, rtol=0)
    assert torch.equal(stats.picked_rank, (ref > ref.gather(1, picks)).sum(-1))


@pytest.mark.parametrize("rows,vocab", [(1, 10), (256, 4096), (300, 151936), (5, 1 << 22)])
def test_row_slices_cover_every_row_once(rows, vocab):
    slices = vocab_rows.row_slices(rows, vocab)
    assert [i for s in slices for i in range(rows)[s]] == list(range(rows))
    assert all((s.stop - s.start) * vocab <= max(vocab, vocab_rows.SLICE_FLOATS) for s in slices)

"""model/analysis/vocab_rows.py against torch's own operations: the striped top-k equals torch.topk, the
rank count equals a boolean count, the statistics equal log_softmax's, and the row slices cover
every row once."""

import pytest
import torch

from attnlens.model.analysis import vocab_rows
from attnlens.model.native import library as native


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


native_built = pytest.mark.skipif(not native.available()[0], reason=f"no C kernels here: {native.available()[1]}")


def _torch_stats(logits, picks, k):
    """The statistics by torch's own operations alone: log_softmax, topk, a boolean count."""
    ref = torch.log_softmax(logits.double(), dim=-1)
    top = torch.topk(ref, k, dim=-1)
    chosen = ref.gather(1, picks)
    return top, chosen[:, 0], (logits > logits.gather(1, picks)).sum(-1)


@native_built
@pytest.mark.parametrize("vocab", [3, 50, 4096, 4099, 49152])
@pytest.mark.parametrize("k", [1, 5, 20])
@pytest.mark.parametrize("rank", [True, False])
def test_the_c_kernel_gives_log_softmax_topk_and_the_rank(vocab, k, rank):
    g = torch.Generator().manual_seed(vocab * 7 + k)
    logits = torch.randn(29, vocab, generator=g) * 6
    logits[0, :k] += 50  # the top in the first entries, the last ones, and one masked entry per row
    logits[1, -k:] += 50
    logits[2, vocab // 2] = float("-inf")
    picks = torch.randint(0, vocab, (29, 1), generator=g)
    picks[3, 0] = int(logits[3].argmax())  # the most likely: rank 0
    stats = vocab_rows.native_stats(logits, picks, k, rank)
    assert stats is not None
    top, chosen, ranks = _torch_stats(logits, picks, min(k, vocab))
    assert torch.equal(stats.top_ids, top.indices)
    torch.testing.assert_close(stats.top_logprobs.double(), top.values, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(stats.picked_logprob.double(), chosen, atol=2e-6, rtol=1e-6)
    if rank:
        assert torch.equal(stats.picked_rank, ranks) and stats.picked_rank[3] == 0
    else:
        assert stats.picked_rank is None


@native_built
def test_the_c_kernel_keeps_the_lower_id_first_among_equal_logits():
    x = torch.zeros(2, 4096)
    x[:, [7, 900, 4000]] = 1.0
    stats = vocab_rows.native_stats(x, torch.tensor([[900], [3]]), 4, True)
    assert stats.top_ids.tolist() == [[7, 900, 4000, 0]] * 2
    assert stats.picked_rank.tolist() == [0, 3]  # strictly above: the equal ones do not count


@native_built
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_rows_the_c_kernel_leaves_to_torch(bad):
    """A NaN anywhere in a block, or an infinite maximum: torch's rules (the block goes through its
    operations, which give NaNs as torch does)."""
    logits = torch.randn(4, 1000)
    logits[2, 123] = bad
    picks = torch.zeros(4, 1, dtype=torch.long)
    assert vocab_rows.native_stats(logits, picks, 5) is None
    assert vocab_rows.native_stats(logits[:2], picks[:2], 5) is not None
    unembed = torch.nn.Identity()
    stats = vocab_rows.unembedded_stats(unembed, logits, picks, 1000, 5)
    want = vocab_rows.cat_stats([vocab_rows.next_token_stats(logits, picks, 5)])
    assert torch.equal(stats.top_ids, want.top_ids)
    torch.testing.assert_close(stats.top_logprobs, want.top_logprobs, equal_nan=True)


def test_the_c_kernel_is_not_asked_for_what_it_cannot_read():
    x = torch.randn(3, 100)
    picks = torch.tensor([[1], [2], [100]])  # past the vocabulary
    assert vocab_rows.native_stats(x, picks, 5) is None
    assert vocab_rows.native_stats(x.double(), picks.clamp(max=99), 5) is None


@pytest.mark.parametrize("c_kernel", [True, False])
def test_the_unembedding_reports_after_each_block(c_kernel, monkeypatch):
    """A long lens's heartbeat (model/analysis/explain.py's progress): once per block of rows."""
    if not c_kernel:
        monkeypatch.setattr(vocab_rows, "native_stats", lambda *a, **k: None)
    monkeypatch.setattr(vocab_rows, "BLOCK_FLOATS", 3 * 100)  # blocks of 3 rows of 100 logits
    rows = torch.randn(10, 100)
    reports: list[int] = []
    stats = vocab_rows.unembedded_stats(torch.nn.Identity(), rows, torch.zeros(10, 1, dtype=torch.long), 100, 2,
                                        progress=lambda: reports.append(1))
    assert len(reports) == 4 and stats.top_ids.shape == (10, 2)

"""A prefill's causal attention by our C kernel (model/native/causal_attention.c through
model/parts/causal_attention.py), against a float64 recompute, PyTorch's SDPA, and the same
model's forward by SDPA, in one piece and in pieces after a KV cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import small_config_model

from attnlens.model.native import library as native
from attnlens.model.parts import causal_attention as ca

pytestmark = pytest.mark.skipif(not native.available()[0], reason=f"no C kernels here: {native.available()[1]}")


def reference(q, k, v, scale):
    """float64 softmax(q k^T scale, causal at the last T of S positions) v, each key/value head repeated."""
    H, K, T, S = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    kk, vv = (t.double().repeat_interleave(H // K, dim=1) for t in (k, v))
    scores = (q.double() @ kk.transpose(-1, -2)) * scale
    sees = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    return (scores.masked_fill(~sees, float("-inf")).softmax(-1) @ vv).float()


def assert_as_exact_as_sdpa(got, sdpa, exact):
    """got within float32 rounding of the float64 answer: no further from it than SDPA's float32
    answer is (both round q k^T in float32: scores near 10 carry ~1e-6 of error into e^x)."""
    ours, theirs = (got - exact).abs().max().item(), (sdpa - exact).abs().max().item()
    assert ours <= 1.5 * theirs + 1e-6, (ours, theirs)
    torch.testing.assert_close(got, sdpa, atol=2 * theirs + 1e-6, rtol=0)


@pytest.mark.parametrize("B,H,K,T,S,D", [
    (1, 9, 3, 300, 300, 64),   # SmolLM2's heads, a prompt over several tiles (300 = 4 x 64 + 44)
    (2, 4, 4, 128, 128, 32),   # multi-head, two whole tiles, a batch of two
    (1, 6, 2, 60, 300, 128),   # a later piece after 240 cached positions, D over one register row
    (1, 3, 1, 130, 1000, 48),  # multi-query, D = 3 vectors of 16
    (1, 2, 2, 32, 512, 16),    # the fewest queries it takes
])
def test_equals_a_float64_recompute_and_sdpa(B, H, K, T, S, D):
    torch.manual_seed(T + S)
    q, k, v = torch.randn(B, H, T, D) * 2, torch.randn(B, K, S, D) * 2, torch.randn(B, K, S, D)
    scale = D ** -0.5
    with torch.no_grad():
        got = ca.causal_attention(q, k, v, scale)
        assert got is not None
        sees = torch.ones(T, S, dtype=torch.bool).tril(S - T)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=sees, scale=scale, enable_gqa=True)
    assert got.shape == (B, H, T, D)
    assert_as_exact_as_sdpa(got, sdpa, reference(q, k, v, scale))
    assert got.transpose(1, 2).is_contiguous()  # (B, T, H, D) underneath: the projection reads it as it lies


def test_reads_heads_where_the_fused_projection_leaves_them():
    """q, k, v as MultiHeadAttention.project makes them: strided views of one (T, H + 2K, D) tensor."""
    T, H, K, D = 200, 9, 3, 64
    x = torch.randn(1, T, H + 2 * K, D).transpose(1, 2)  # (1, H + 2K, T, D), rows (H + 2K) D apart
    q, k, v = x[:, :H], x[:, H:H + K], x[:, H + K:]
    with torch.no_grad():
        got = ca.causal_attention(q, k, v, 0.125)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    assert_as_exact_as_sdpa(got, sdpa, reference(q, k, v, 0.125))


def test_extreme_scores_stay_finite_and_exact():
    """Scores in the hundreds (one key dominating each row, rows whose maximum comes late): the
    online softmax rescales without overflow, as exact as SDPA (both ~3e-4 from float64 here)."""
    T, D = 256, 64
    q = torch.randn(1, 2, T, D) * 6
    k = torch.randn(1, 2, T, D) * 6
    v = torch.randn(1, 2, T, D)
    with torch.no_grad():
        got = ca.causal_attention(q, k, v, 1.0)
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    assert torch.isfinite(got).all()
    assert_as_exact_as_sdpa(got, sdpa, reference(q, k, v, 1.0))


def test_leaves_to_sdpa_what_it_does_not_take():
    q, k, v = torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64)
    with torch.no_grad():
        assert ca.causal_attention(q[:, :, :ca.MIN_QUERIES - 1], k, v, 0.1) is None  # a short piece
        assert ca.causal_attention(q[:, :, :64], k[:, :, :64], v[:, :, :64], 0.1) is None  # a small product
        assert ca.causal_attention(q.double(), k.double(), v.double(), 0.1) is None
        odd = torch.randn(1, 2, 128, 12)
        assert ca.causal_attention(odd, odd, odd, 0.1) is None  # 12 dims: no whole vector
        assert ca.causal_attention(q, k[:, :, :100], v[:, :, :100], 0.1) is None  # fewer keys than queries
        assert ca.causal_attention(q, k, v, 0.1) is not None
    assert ca.causal_attention(q, k, v, 0.1) is None  # autograd: training keeps torch's kernels


@pytest.mark.parametrize("overrides", [
    dict(n_heads=6, n_kv_heads=2, positional="rotary", norm_type="rmsnorm", ffn="gated", activation="silu",
         bias=False),
    dict(n_heads=2),
], ids=["llama-gqa", "gpt"])
def test_a_model_prefill_equals_sdpa_in_one_piece_and_in_pieces(overrides, monkeypatch):
    """A decoder (D = 16 and 48) over 400 tokens: the kernel's logits equal SDPA's (the kernel switched
    off), and a prefill in pieces of 200, 150 and 50 after the cache (S > T: every piece through the
    kernel) equals one piece."""
    model = small_config_model(context_length=400, d_model=96, **overrides)
    ids = torch.randint(0, model.config.vocab_size, (1, 400))
    calls = []
    kernel = ca.causal_attention
    monkeypatch.setattr(ca, "causal_attention", lambda *a: calls.append(a[0].shape[2]) or kernel(*a))
    with torch.no_grad():
        got = model(ids).logits
        cache = model.new_kv_cache(1)
        pieces = [model(ids[:, s:e], kv_cache=cache).logits for s, e in ((0, 200), (200, 350), (350, 400))]
        assert calls == [400] * 2 + [200] * 2 + [150] * 2 + [50] * 2  # two layers a forward
        monkeypatch.setattr(ca, "MIN_QUERIES", 10**9)  # every path back to torch's SDPA
        want = model(ids).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(torch.cat(pieces, dim=1), want, atol=2e-5, rtol=0)

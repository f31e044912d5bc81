"""The attention backends (model/parts/attention_backends.py): one per device kind, made once,
each computing softmax(q k^T * scale + mask) v as a float64 recompute does, on every path it
takes (a causal prompt, the next piece of one, a masked prompt, a decode step grouped or masked)."""

from __future__ import annotations

import pytest
import torch

from attnlens.model.parts import MultiHeadAttention, sliding_window_mask
from attnlens.model.parts.attention_backends import (
    CpuAttention,
    TorchAttention,
    backend_for,
    full_mask,
)


def reference(q, k, v, mask, causal, scale):
    """float64, keys repeated per group: the textbook formula."""
    G = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    scores = (q.double() @ k.transpose(-2, -1)) * scale
    full = full_mask(mask, causal and q.shape[2] > 1, q.shape[2], k.shape[2], q.device)
    if full is not None:
        scores = scores.masked_fill(~full, float("-inf"))
    return torch.softmax(scores, -1) @ v


def test_one_backend_per_device_kind_made_once():
    assert backend_for("cpu") is backend_for("cpu") and isinstance(backend_for("cpu"), CpuAttention)
    assert backend_for("cuda").name == "cuda" and type(backend_for("meta")) is TorchAttention


CASES = {  # (B, H, K, T, S, masked, causal)
    "prompt, our kernel": (1, 6, 2, 160, 160, False, True),
    "prompt, small: SDPA": (2, 4, 4, 8, 8, False, True),
    "next piece of a prompt": (1, 6, 2, 64, 320, False, True),
    "masked prompt (a window)": (2, 4, 2, 40, 40, True, True),
    "decode step, grouped": (3, 6, 2, 1, 50, False, True),
    "decode step, masked rows": (3, 4, 4, 1, 50, True, True),
    "not causal (an encoder)": (2, 4, 4, 12, 12, True, False),
}


@pytest.mark.parametrize("backend", [CpuAttention(), TorchAttention()], ids=lambda b: b.name)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_path_computes_the_formula(backend, case):
    B, H, K, T, S, masked, causal = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    q = torch.randn(B, H, T, 32, generator=g)
    k, v = torch.randn(B, K, S, 32, generator=g), torch.randn(B, K, S, 32, generator=g)
    mask = None
    if masked and T > 1:  # a window of 5 behind each query (Mistral's sliding window)
        mask = sliding_window_mask(torch.arange(S - T, S), S, 5)  # (T, S)
    elif masked:  # rows of different lengths decoding together: row b sees keys 0 .. S - 1 - 7b
        mask = torch.arange(S)[None, None, None, :] < S - 7 * torch.arange(B)[:, None, None, None]
    with torch.inference_mode():
        got = backend.attend(q, k, v, mask=mask, causal=causal, scale=32 ** -0.5)
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, causal, 32 ** -0.5), atol=2e-5, rtol=0)


def test_the_layer_takes_its_devices_backend(monkeypatch):
    """MultiHeadAttention computes through backend_for(device).attend, unless it must keep the
    probabilities (the explicit path)."""
    from attnlens.model.config import ModelConfig

    seen = []
    real = CpuAttention.attend

    def spy(self, *a, **kw):
        seen.append(type(self).__name__)
        return real(self, *a, **kw)

    monkeypatch.setattr(CpuAttention, "attend", spy)
    layer = MultiHeadAttention(ModelConfig(vocab_size=32, d_model=32, n_heads=4, n_layers=1, context_length=16))
    x = torch.randn(1, 5, 32)
    with torch.inference_mode():
        y, probs = layer(x, causal=True)
        assert seen == ["CpuAttention"] and probs is None
        y2, probs = layer(x, causal=True, return_attention=True)
    assert seen == ["CpuAttention"] and probs is not None
    torch.testing.assert_close(y, y2, atol=1e-5, rtol=0)

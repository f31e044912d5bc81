"""The parts of newer decoders, each checked on its own against an independent reference:
PyTorch's modules, or transformers' own implementation of that part on identical weights
(rotary positions and their scalings, RMSNorm, grouped- and multi-query attention, gated
FFNs, the GPT-NeoX parallel block, Mistral's sliding window, Qwen3's per-head q/k norm), plus
what their config fields accept and refuse."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlens.model.config import ConfigError, ModelConfig
from attnlens.model.families.decoder import Transformer
from attnlens.model.kv_cache import bytes_per_row
from attnlens.model.parts import (
    Block,
    FeedForward,
    MultiHeadAttention,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    rotary_inv_freq,
    sliding_window_mask,
)

transformers = pytest.importorskip("transformers")
from transformers.models.gpt_neox import modeling_gpt_neox as neox  # noqa: E402
from transformers.models.llama import modeling_llama as llama  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3 as qwen3  # noqa: E402

SMALL = dict(vocab_size=50, context_length=40, d_model=32, n_layers=2, n_heads=4, d_ff=64)
LLAMA_PARTS = dict(positional="rotary", norm_type="rmsnorm", ffn="gated", activation="silu", bias=False)


def llama_config(**overrides) -> "transformers.LlamaConfig":
    fields = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64)
    fields.update(overrides)
    config = transformers.LlamaConfig(**fields)
    config._attn_implementation = "eager"
    return config


# --- rotary positions --------------------------------------------------------------------------

ROPES = {
    "default": (None, {"rope_type": "default", "rope_theta": 10000.0}),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16},
               {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rotary_positions_equal_transformers_llama(kind):
    """Our angles and rotation of (B, H, T, D) queries and keys, at each row's own positions,
    against LlamaRotaryEmbedding + apply_rotary_pos_emb with the same rope parameters."""
    ours_scaling, theirs = ROPES[kind]
    config = ModelConfig(**{**SMALL, **LLAMA_PARTS, "rope_scaling": ours_scaling})
    rope = RotaryEmbedding(config)
    ref = llama.LlamaRotaryEmbedding(llama_config(rope_parameters=theirs))
    torch.testing.assert_close(rope.inv_freq, ref.inv_freq, atol=0, rtol=0)
    positions = torch.tensor([[0, 1, 2, 3, 4], [30, 31, 32, 33, 34]])  # (B, T): rows at their own positions
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    cos, sin = ref(q, positions)
    want_q, want_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    angles = rope(positions, q.dtype)
    torch.testing.assert_close(apply_rotary(q, angles), want_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rotary(k, angles), want_k, atol=1e-6, rtol=0)
    shared = rope(positions[1], q.dtype)  # (T,) positions shared by the batch: the same rotation
    torch.testing.assert_close(apply_rotary(q, shared)[1], want_q[1], atol=1e-6, rtol=0)


def test_scalings_change_the_frequencies_as_their_definitions_say():
    """Written out: linear divides every frequency by the factor; llama3 keeps the short
    wavelengths, divides the long ones by the factor and blends the band between."""
    base = rotary_inv_freq(8, 10000.0)
    torch.testing.assert_close(base, torch.tensor([10000.0 ** (-i / 8) for i in (0, 2, 4, 6)]))
    torch.testing.assert_close(rotary_inv_freq(8, 10000.0, {"rope_type": "linear", "factor": 4.0}), base / 4)
    llama3 = rotary_inv_freq(8, 10000.0, {**ROPES["llama3"][0], "original_max_position_embeddings": 64})
    wavelength = 2 * math.pi / base  # [6.3, 62.8, 628, 6283]: short, medium (64/4 .. 64/1), long, long
    assert wavelength[0] < 64 / 4 and llama3[0] == base[0]
    assert (wavelength[2:] > 64).all() and torch.equal(llama3[2:], base[2:] / 8)
    smooth = (64 / wavelength[1] - 1) / (4 - 1)
    assert 64 / 4 < wavelength[1] < 64
    torch.testing.assert_close(llama3[1], (1 - smooth) * base[1] / 8 + smooth * base[1])


@pytest.mark.parametrize("B,T", [(1, 1), (2, 37), (1, 600)])
def test_rotary_in_c_gives_torchs_floats(B, T):
    """model/native/rotary.c against apply_rotary's torch operators (x * cos + roll * signed_sin) on
    the fused projection's strided views: the same floats, not merely close; and the path the
    model takes in float32 inference on the CPU."""
    from attnlens.model.native import library as native
    from attnlens.model.parts import positions

    if not native.available()[0]:
        pytest.skip(f"C kernels: {native.available()[1]}")
    config = ModelConfig(**{**SMALL, **LLAMA_PARTS, "n_heads": 6, "n_kv_heads": 2, "d_model": 384})
    angles = RotaryEmbedding(config)(torch.arange(100, 100 + T), torch.float32)
    heads = (torch.randn(B, T, 6 + 2 * 2, 64) * 3).transpose(1, 2)  # (B, H + 2K, T, D) as attention.py views it
    qk = heads[:, :8]
    with torch.no_grad():
        assert positions.native_rotary(qk, angles.cos, angles.signed_sin)
        got = positions.apply_rotary(qk, angles)
    want = qk * angles.cos + qk.roll(32, dims=-1) * angles.signed_sin  # autograd on: torch's operators
    assert torch.equal(got, want)
    assert got.transpose(1, 2).is_contiguous()


def test_rotary_scores_depend_only_on_the_distance():
    """The point of rotary positions: q.k after rotating q to position m and k to position n is
    a function of m - n alone (here with theta and a linear scaling)."""
    config = ModelConfig(**{**SMALL, **LLAMA_PARTS, "rope_theta": 500.0,
                            "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    rope = RotaryEmbedding(config)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    rope.inv_freq = rope.inv_freq.double()

    def score(m: int, n: int) -> float:
        qm = apply_rotary(q, rope(torch.tensor([m]), torch.float64))
        kn = apply_rotary(k, rope(torch.tensor([n]), torch.float64))
        return float((qm * kn).sum())

    assert score(7, 3) == pytest.approx(score(20, 16), abs=1e-9)
    assert score(7, 3) == pytest.approx(score(4, 0), abs=1e-9)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


def test_partial_rotary_equals_gpt_neox():
    """rotary_pct 0.25: the first quarter of each head rotated, the rest passed through, as
    GPT-NeoX (Pythia) does."""
    config = ModelConfig(**{**SMALL, "d_model": 64, "positional": "rotary", "rotary_pct": 0.25})
    assert config.rotary_dims == 4
    ref_config = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, rotary_pct=0.25,
                                            max_position_embeddings=64)
    ref = neox.GPTNeoXRotaryEmbedding(ref_config)
    positions = torch.arange(6)[None]
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 4, 6, 16)
    cos, sin = ref(q, positions)
    want_q, want_k = neox.apply_rotary_pos_emb(q, k, cos, sin)
    angles = RotaryEmbedding(config)(positions[0], q.dtype)
    torch.testing.assert_close(apply_rotary(q, angles), want_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rotary(k, angles), want_k, atol=1e-6, rtol=0)
    assert torch.equal(apply_rotary(q, angles)[..., 4:], q[..., 4:])


def test_rotary_frequencies_stay_float32_in_a_bf16_model():
    """model.to(bf16) casts every floating buffer; the rotary frequencies are put back in float32
    (recomputed, not rounded through bf16), as transformers keeps them."""
    model = Transformer(ModelConfig(**{**SMALL, **LLAMA_PARTS})).to(torch.bfloat16)
    assert model.rotary.inv_freq.dtype == torch.float32
    torch.testing.assert_close(model.rotary.inv_freq, rotary_inv_freq(8, 10000.0), atol=0, rtol=0)
    assert model.tok_emb.weight.dtype == torch.bfloat16
    assert model(torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16


# --- RMSNorm -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_torch_and_transformers(dtype):
    ours = RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
    ref = llama.LlamaRMSNorm(32, eps=1e-5)
    ref.load_state_dict(ours.state_dict())
    x = (torch.randn(3, 7, 32) * 3).to(dtype)
    ours, ref = ours.to(dtype), ref.to(dtype)
    torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=0)  # the same float32 statistic
    if dtype == torch.float32:
        torch_norm = nn.RMSNorm(32, eps=1e-5)
        torch_norm.load_state_dict(ours.state_dict())
        torch.testing.assert_close(ours(x), torch_norm(x), atol=1e-6, rtol=1e-6)


def test_norm_type_builds_rms_norms_without_biases_everywhere():
    model = Transformer(ModelConfig(**{**SMALL, **LLAMA_PARTS}))
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, nn.LayerNorm))]
    assert len(norms) == 2 * 2 + 1 and all(isinstance(m, RMSNorm) for m in norms)
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))


# --- grouped-query and multi-query attention ---------------------------------------------------


def llama_attention_pair(n_kv: int, *, seed: int = 0):
    """Our attention and LlamaAttention (eager) with the same weights: q_proj, k_proj, v_proj are
    the row blocks of our fused qkv."""
    torch.manual_seed(seed)
    ours = MultiHeadAttention(ModelConfig(**{**SMALL, **LLAMA_PARTS, "n_kv_heads": n_kv})).eval()
    ref = llama.LlamaAttention(llama_config(num_key_value_heads=n_kv), layer_idx=0).eval()
    with torch.no_grad():
        ours.qkv.weight[:32 + 8 * n_kv].mul_(3)  # q and k rows: sharper maps, so heads differ
        q, k, v = ours.qkv.weight.split([32, 8 * n_kv, 8 * n_kv])
        for lin, w in ((ref.q_proj, q), (ref.k_proj, k), (ref.v_proj, v), (ref.o_proj, ours.proj.weight)):
            lin.weight.copy_(w)
    return ours, ref


@pytest.mark.parametrize("n_kv", [4, 2, 1], ids=["multi-head", "grouped-query", "multi-query"])
def test_grouped_query_attention_equals_transformers_llama(n_kv):
    """Outputs and one probability map per query head, against LlamaAttention (which repeats each
    key/value head for its group); both the fast path and the explicit path."""
    ours, ref = llama_attention_pair(n_kv)
    assert ours.qkv.weight.shape == ((4 + 2 * n_kv) * 8, 32)
    x = torch.randn(2, 9, 32)
    positions = torch.arange(9)[None].expand(2, 9)
    rope = RotaryEmbedding(ModelConfig(**{**SMALL, **LLAMA_PARTS}))
    cos, sin = llama.LlamaRotaryEmbedding(llama_config())(x, positions)
    blocked = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, want_probs = ref(x, position_embeddings=(cos, sin), attention_mask=blocked)
        got, probs = ours(x, causal=True, return_attention=True, rope=rope(positions[0], x.dtype))
        fast, _ = ours(x, causal=True, rope=rope(positions[0], x.dtype))
    assert probs.shape == (2, 4, 9, 9)  # one map per query head
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(probs, want_probs, atol=1e-6, rtol=0)
    if n_kv < 4:  # the heads of one group share keys, not maps
        assert (probs[:, 0] - probs[:, 1]).abs().max() > 1e-3


def test_grouped_query_attention_is_repeated_keys_for_pytorch_sdpa():
    """The same attention written with PyTorch alone: each key/value head repeated for the G
    query heads of its group (h // G), then F.scaled_dot_product_attention."""
    torch.manual_seed(3)
    attn = MultiHeadAttention(ModelConfig(**{**SMALL, "n_kv_heads": 2, "qkv_bias": True})).eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        q, k, v = attn.qkv(x).split([32, 16, 16], dim=-1)
        q = q.view(2, 7, 4, 8).transpose(1, 2)
        k, v = (t.view(2, 7, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1) for t in (k, v))
        want = attn.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 7, 32))
        got, _ = attn(x, causal=True)
        explicit, _ = attn(x, causal=True, return_attention=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(explicit, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("n_kv", [2, 1])
def test_one_query_step_over_grouped_cache_views_equals_sdpa(n_kv):
    """The CPU's decode step for grouped heads (G queries of a group in one product, keys read as
    views of a (R, K, P, D) cache), with and without a per-row mask, against SDPA's enable_gqa."""
    R, B, H, P, D, S = 5, 3, 4, 16, 8, 11
    cache_k, cache_v = torch.randn(R, n_kv, P, D), torch.randn(R, n_kv, P, D)
    k, v = cache_k[1:1 + B, :, :S], cache_v[1:1 + B, :, :S]
    q = torch.randn(B, H, 1, D)
    mask = (torch.arange(S)[None, :] < torch.tensor([4, 11, 7])[:, None])[:, None, None, :]
    for m in (mask, None):
        got = MultiHeadAttention.one_query_attention(q, k, v, m)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_the_kv_cache_holds_the_key_value_heads():
    model = Transformer(ModelConfig(**{**SMALL, **LLAMA_PARTS, "n_kv_heads": 1, "head_dim": 16}))
    cache = model.new_kv_cache(3)
    assert cache.keys[0].shape == (3, 1, 40, 16)  # (rows, K, P, D): a quarter of multi-head's
    held = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    assert bytes_per_row(2, 1, 40, 16, torch.float32) * 3 == held == 2 * 2 * 3 * 40 * 16 * 4
    assert bytes_per_row(2, 1, 40, 16, torch.bfloat16) * 2 == bytes_per_row(2, 1, 40, 16, torch.float32)
    assert model.blocks[0].attn.qkv.weight.shape == ((4 + 2) * 16, 32)
    assert model.blocks[0].attn.proj.weight.shape == (32, 4 * 16)


# --- Qwen3's q/k norm -----------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv", [4, 2], ids=["multi-head", "grouped-query"])
def test_qk_norm_attention_equals_transformers_qwen3(n_kv):
    """config.qk_norm: an RMSNorm over each head's D dims on q and on k, after the projection and
    before rotary positions, against Qwen3Attention (eager) on the same weights, head_dim 16 wider
    than d_model / n_heads; the fast path, the explicit path and its maps."""
    torch.manual_seed(4)
    cfg = ModelConfig(**{**SMALL, **LLAMA_PARTS, "n_kv_heads": n_kv, "head_dim": 16, "qk_norm": True,
                         "layer_norm_eps": 1e-6})
    ours = MultiHeadAttention(cfg).eval()
    hf_config = transformers.Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=n_kv, head_dim=16,
                                         max_position_embeddings=64, rms_norm_eps=1e-6)
    hf_config._attn_implementation = "eager"
    ref = qwen3.Qwen3Attention(hf_config, layer_idx=0).eval()
    assert ours.q_norm.weight.shape == ours.k_norm.weight.shape == (16,) and ours.q_norm.eps == 1e-6
    with torch.no_grad():
        ours.q_norm.weight.copy_(torch.rand(16) + 0.5)
        ours.k_norm.weight.copy_(torch.rand(16) * 4 + 1)  # sharp maps: the norm leaves q.k at most D * |w|^2
        q, k, v = ours.qkv.weight.split([64, 16 * n_kv, 16 * n_kv])
        for lin, w in ((ref.q_proj, q), (ref.k_proj, k), (ref.v_proj, v), (ref.o_proj, ours.proj.weight)):
            lin.weight.copy_(w)
        ref.q_norm.weight.copy_(ours.q_norm.weight)
        ref.k_norm.weight.copy_(ours.k_norm.weight)
    x = torch.randn(2, 9, 32) * 3
    positions = torch.arange(9)[None].expand(2, 9)
    rope = RotaryEmbedding(cfg)
    cos, sin = qwen3.Qwen3RotaryEmbedding(hf_config)(x, positions)
    blocked = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, want_probs = ref(x, position_embeddings=(cos, sin), attention_mask=blocked)
        got, probs = ours(x, causal=True, return_attention=True, rope=rope(positions[0], x.dtype))
        fast, _ = ours(x, causal=True, rope=rope(positions[0], x.dtype))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(probs, want_probs, atol=1e-6, rtol=0)
    assert (probs[:, 0] - probs[:, 1]).abs().max() > 1e-3


def test_qk_norm_applies_to_cross_attention_and_exists_only_when_asked():
    """Every attention module normalises what it projects: the encoder-decoder's cross-attention
    its queries (from x) and its keys (from memory, project_memory: what the cross K/V cache keeps);
    without qk_norm there is no q_norm / k_norm, and no tensor for them in the state."""
    torch.manual_seed(6)
    attn = MultiHeadAttention(ModelConfig(**{**SMALL, "qk_norm": True})).eval()
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.rand(8) + 0.5)
        attn.k_norm.weight.copy_(torch.rand(8) + 0.5)
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 7, 32)

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    with torch.no_grad():
        q, k, v = attn.qkv(x).split(32, dim=-1)[0], *attn.qkv(memory).split(32, dim=-1)[1:]
        q, k, v = (t.view(2, -1, 4, 8).transpose(1, 2) for t in (q, k, v))
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
        want = attn.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32))
        got, _ = attn(x, memory)
        cached, _ = attn(x, memory_kv=attn.project_memory(memory))
        self_q, self_k, _ = attn.project(x, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(cached, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(self_q, rms(attn.qkv(x)[..., :32].view(2, 5, 4, 8).transpose(1, 2),
                                           attn.q_norm.weight), atol=1e-6, rtol=0)
    plain = MultiHeadAttention(ModelConfig(**SMALL))
    assert plain.q_norm is None and plain.k_norm is None
    assert not any("norm" in n for n in plain.state_dict())
    assert {n for n in attn.state_dict() if "norm" in n} == {"q_norm.weight", "k_norm.weight"}
    ModelConfig(**{**SMALL, "family": "encoder", "qk_norm": True})  # a part of every family's attention
    ModelConfig(**{**SMALL, "family": "encoder-decoder", "qk_norm": True})


# --- gated FFNs, biases, untied embeddings -------------------------------------------------------


def test_swiglu_equals_transformers_llama_mlp():
    torch.manual_seed(4)
    ffn = FeedForward(ModelConfig(**{**SMALL, **LLAMA_PARTS})).eval()
    ref = llama.LlamaMLP(llama_config())
    with torch.no_grad():
        gate, up = ffn.fc.weight.chunk(2)
        ref.gate_proj.weight.copy_(gate), ref.up_proj.weight.copy_(up), ref.down_proj.weight.copy_(ffn.proj.weight)
        x = torch.randn(2, 5, 32)
        torch.testing.assert_close(ffn(x), ref(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_swiglus_c_pass_equals_torchs_silu_times_up(rows):
    """model/native/swiglu.c (a prefill's rows shared by the threads) against F.silu(gate) * up, on
    gates from -200 to 200 (e^-g clamped at +-88: still silu to float32's resolution), d_ff not a
    multiple of the vector width."""
    from attnlens.model.native import library as native
    from attnlens.model.parts import feedforward

    if not native.available()[0]:
        pytest.skip(f"C kernels: {native.available()[1]}")
    F_ = 1000 + 3  # 1,003: whole vectors, then the rest one by one
    h = torch.randn(rows, 2 * F_) * 4
    h[0, :8] = torch.tensor([-200.0, -88.5, -20.0, -1e-3, 0.0, 1e-3, 30.0, 200.0])
    with torch.no_grad():
        assert feedforward.native_swiglu(h)
    assert not feedforward.native_swiglu(h)  # autograd on: torch's operators
    out = torch.empty(rows, F_)
    native.load().swiglu(h.data_ptr(), rows, F_, out.data_ptr())
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=2e-6)


@pytest.mark.parametrize("activation, torch_act", [("gelu_exact", nn.GELU()), ("gelu", nn.GELU("tanh"))])
def test_geglu_is_gelu_of_the_gate_times_the_up_projection(activation, torch_act):
    torch.manual_seed(5)
    ffn = FeedForward(ModelConfig(**{**SMALL, "ffn": "gated", "activation": activation})).eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        gate = x @ ffn.fc.weight[:64].T + ffn.fc.bias[:64]
        up = x @ ffn.fc.weight[64:].T + ffn.fc.bias[64:]
        want = (torch_act(gate) * up) @ ffn.proj.weight.T + ffn.proj.bias
        torch.testing.assert_close(ffn(x), want, atol=1e-5, rtol=1e-5)


def test_linear_biases_follow_their_own_fields():
    """Qwen2: q, k and v biased, o_proj and the MLP not; None follows `bias`."""
    block = Block(ModelConfig(**{**SMALL, **LLAMA_PARTS, "qkv_bias": True}))
    assert block.attn.qkv.bias is not None and block.attn.qkv.bias.shape == (96,)
    assert block.attn.proj.bias is None and block.ffn.fc.bias is None and block.ffn.proj.bias is None
    block = Block(ModelConfig(**{**SMALL, "attn_out_bias": False, "ffn_bias": False}))
    assert block.attn.qkv.bias is not None and block.ln1.bias is not None
    assert block.attn.proj.bias is None and block.ffn.fc.bias is None


def test_untied_embeddings_are_their_own_parameter(tmp_path):
    from helpers import TINY_TEXT

    from attnlens.model import Tokenizer, load_checkpoint, save_checkpoint

    tok = Tokenizer.train([TINY_TEXT] * 4, vocab_size=300)
    model = Transformer(ModelConfig(**{**SMALL, **LLAMA_PARTS, "vocab_size": tok.vocab_size, "tie_embeddings": False}))
    assert model.lm_head.weight is not model.tok_emb.weight
    back = load_checkpoint(save_checkpoint(tmp_path / "untied", model, tok)).model
    assert torch.equal(back.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(back.lm_head.weight, back.tok_emb.weight)


# --- the parallel block, the sliding window --------------------------------------------------------


@pytest.mark.parametrize("parallel", [True, False])
def test_block_equals_transformers_gpt_neox_layer(parallel):
    """GPT-NeoX's layer (partial rotary, LayerNorms with biases, exact GELU), parallel residual
    x + attn(ln1(x)) + mlp(ln2(x)) or sequential, on identical weights."""
    torch.manual_seed(6)
    config = ModelConfig(**{**SMALL, "d_model": 64, "positional": "rotary", "rotary_pct": 0.25,
                            "activation": "gelu_exact", "parallel_residual": parallel})
    ours = Block(config).eval()
    ref_config = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, intermediate_size=64,
                                            rotary_pct=0.25, use_parallel_residual=parallel)
    ref_config._attn_implementation = "eager"
    ref = neox.GPTNeoXLayer(ref_config, 0).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.2)
        w = ours.attn.qkv.weight.view(3, 4, 16, 64).transpose(0, 1).reshape(192, 64)  # per head q|k|v
        b = ours.attn.qkv.bias.view(3, 4, 16).transpose(0, 1).reshape(192)
        ref.attention.query_key_value.weight.copy_(w), ref.attention.query_key_value.bias.copy_(b)
        for mine, theirs in ((ours.attn.proj, ref.attention.dense), (ours.ffn.fc, ref.mlp.dense_h_to_4h),
                             (ours.ffn.proj, ref.mlp.dense_4h_to_h), (ours.ln1, ref.input_layernorm),
                             (ours.ln2, ref.post_attention_layernorm)):
            theirs.load_state_dict(mine.state_dict())
        x = torch.randn(2, 6, 64)
        positions = torch.arange(6)[None]
        cos, sin = neox.GPTNeoXRotaryEmbedding(ref_config)(x, positions)
        blocked = torch.full((6, 6), float("-inf")).triu(1)[None, None]
        want = ref(x, attention_mask=blocked, position_embeddings=(cos, sin))
        want = want[0] if isinstance(want, tuple) else want
        got = ours(x, rope=RotaryEmbedding(config)(positions[0], x.dtype)).x
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_sliding_window_mask_equals_transformers_definition():
    from transformers.masking_utils import sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(4)
    T = 10
    idx = [torch.tensor(i) for i in range(T)]
    want = torch.tensor([[bool(fn(idx[0], idx[0], q, k)) for k in idx] for q in idx])
    got = sliding_window_mask(torch.arange(T), T, 4) & torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(got, want)
    assert got[9].tolist() == [False] * 6 + [True] * 4  # the query and the 3 before it
    rows = sliding_window_mask(torch.tensor([[3, 4], [9, 10]]), 11, 4)  # (B, T) positions -> (B, T, S)
    assert rows.shape == (2, 2, 11) and rows[1, 1].nonzero().flatten().tolist() == [7, 8, 9, 10]


def test_a_sliding_window_model_forgets_what_is_out_of_its_window():
    """Logits at position t do not depend on tokens more than `window` - 1 back, however many
    layers (here one: the window is per layer), and the maps are exactly zero there."""
    torch.manual_seed(7)
    model = Transformer(ModelConfig(**{**SMALL, **LLAMA_PARTS, "n_layers": 1, "sliding_window": 5})).eval()
    ids = torch.randint(0, 50, (1, 20))
    other = ids.clone()
    other[0, :10] = torch.randint(0, 50, (10,))
    with torch.no_grad():
        a, maps = model(ids, return_attention=True)
        b = model(other).logits
    torch.testing.assert_close(a[0, 14:], b[0, 14:], atol=1e-6, rtol=0)  # position 14 sees 10 .. 14
    assert not torch.allclose(a[0, 13], b[0, 13])
    assert (maps[0][0, :, 19, :15] == 0).all() and (maps[0][0, :, 19, 15:] > 0).all()


# --- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"n_kv_heads": 3}, r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"),
    ({"n_kv_heads": 0}, "n_kv_heads must be a positive integer"),
    ({"head_dim": -1}, "head_dim must be a positive integer"),
    ({"norm_type": "scalenorm"}, "norm_type must be one of"),
    ({"ffn": "moe"}, "ffn must be one of"),
    ({"activation": "gelu_fast"}, "activation must be one of"),
    ({"positional": "rotary", "rotary_pct": 0.0}, r"rotary_pct must be in \(0, 1\]"),
    ({"positional": "rotary", "rotary_pct": 0.1}, "must be even and at least 2"),
    ({"positional": "rotary", "rope_theta": 0}, "rope_theta must be a positive number"),
    ({"positional": "rotary", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling rope_type 'yarn' is not supported \(supported: linear, llama3\)"),
    ({"positional": "rotary", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
    ({"positional": "rotary", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "needs a positive number 'low_freq_factor'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "needs positional='rotary'"),
    ({"parallel_residual": True, "norm": "post"}, "parallel_residual .* needs norm='pre'"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"qkv_bias": "yes"}, "qkv_bias must be true, false or null"),
    ({"qk_norm": 1}, "qk_norm must be true or false"),
    ({"family": "encoder", "positional": "rotary"}, "the encoder family does not build rotary"),
    ({"family": "encoder-decoder", "n_kv_heads": 2}, "the encoder-decoder family does not build grouped_query"),
    ({"family": "encoder", "norm_type": "rmsnorm"}, "the encoder family does not build rmsnorm"),
    ({"family": "encoder-decoder", "parallel_residual": True}, "does not build parallel_residual"),
    ({"family": "decoder", "labels": ["a", "b"]}, "the decoder family does not build classifier"),
])
def test_invalid_part_choices_raise_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**SMALL, **overrides})


def test_old_config_json_loads_with_every_new_field_at_its_default():
    """A config.json written before these fields existed (the bundled default model's) loads,
    and means what it meant: GPT-2's parts."""
    old = {"activation": "gelu", "bias": True, "context_length": 256, "d_ff": 1024, "d_model": 256, "dropout": 0.0,
           "layer_norm_eps": 1e-05, "n_heads": 8, "n_layers": 4, "norm": "pre", "positional": "learned",
           "scale_embeddings": False, "tie_embeddings": True, "vocab_size": 4096}
    config = ModelConfig.from_dict(old)
    assert (config.kv_heads, config.d_head, config.norm_type, config.ffn, config.rotary_dims) == (8, 32, "layernorm",
                                                                                                  "plain", 0)
    assert not config.parallel_residual and config.sliding_window is None and config.architecture is None
    assert not config.qk_norm
    assert config.is_gpt2_shaped() == []
    llama_like = ModelConfig(**{**SMALL, **LLAMA_PARTS, "n_kv_heads": 2})
    assert ModelConfig.from_json(llama_like.to_json()) == llama_like
    assert "GPT-2 uses LayerNorm (norm_type='layernorm')" in llama_like.is_gpt2_shaped()


@pytest.mark.parametrize("overrides", [
    {**LLAMA_PARTS, "n_kv_heads": 2, "sliding_window": 6, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"d_model": 64, "positional": "rotary", "rotary_pct": 0.25, "parallel_residual": True, "tie_embeddings": False},
    {**LLAMA_PARTS, "n_kv_heads": 1, "head_dim": 16, "qkv_bias": True, "dropout": 0.1},
    {**LLAMA_PARTS, "n_kv_heads": 2, "head_dim": 16, "qk_norm": True},
], ids=["llama-gqa-window", "neox-parallel", "qwen-mqa-dropout", "qwen3-qk-norm"])
def test_the_new_parts_train_on_a_tiny_repeated_batch(overrides):
    """Gradients flow through rotary angles, grouped heads, RMSNorm, gated FFNs, the parallel
    residual, the window mask and the q/k norm: a decoder built from them learns a repeated batch."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**SMALL, "context_length": 16, **overrides})).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, 50, (4, 16))
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(model(batch[:, :-1]).logits.reshape(-1, 50), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert math.isfinite(losses[-1]) and losses[-1] < 0.7 * losses[0], losses


# --- Linear: y^T = W x^T in float32 inference on the CPU ------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 16, 64, 300])
def test_linear_products_on_the_cpu_give_the_same_bits_with_any_threads(rows):
    """The products Linear picks (our kernels, oneDNN) answer the same bits with 1 and 2 threads, at
    1,024 inputs, where MKL's (torch.mm, F.linear) differ: the same request, the same answer."""
    from attnlens.model.native import library as native
    from attnlens.model.parts import linear

    if not native.available()[0] or linear._ONEDNN is None:
        pytest.skip("our C kernels and oneDNN are both needed here")
    torch.manual_seed(rows)
    w, x = torch.randn(256, 1024), torch.randn(rows, 1024)
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            answers = []
            for threads in (2, 1, 2):
                torch.set_num_threads(threads)
                answers.append(linear.cpu_product(x, w))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(answers[0], answers[1]) and torch.equal(answers[0], answers[2])


@pytest.mark.parametrize("product", ["onednn", "w-xt", "w-xt-no-c-kernel"])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, 32, 65, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_products_on_the_cpu_equal_torchs_linear(rows, bias, product, monkeypatch):
    """Linear's inference products on the CPU (model/parts/linear.py: one row by
    model/native/float_matvec.c, or padded to two without it; more rows by oneDNN, or without it
    W x^T up to MAX_ROWS and F.linear above) against nn.Linear on the same weights, for 2-d and 3-d
    inputs; with autograd on it is nn.Linear's own product, and its gradients are."""
    from attnlens.model.native import library as native
    from attnlens.model.parts import linear

    if product == "onednn" and linear._ONEDNN is None:
        pytest.skip("this torch has no oneDNN")
    if product == "w-xt" and not native.available()[0]:
        pytest.skip(f"C kernels: {native.available()[1]}")
    if product != "onednn":
        monkeypatch.setattr(linear, "USE_ONEDNN", False)
    if product == "w-xt-no-c-kernel":
        monkeypatch.setattr(native, "available", lambda: (False, "this test"))
    used: list[str] = []
    for name in ("onednn_linear", "cpu_linear"):
        monkeypatch.setattr(linear, name, lambda *a, f=getattr(linear, name), n=name: used.append(n) or f(*a))

    torch.manual_seed(rows)
    ours, ref = linear.Linear(48, 80, bias=bias), nn.Linear(48, 80, bias=bias)
    ref.load_state_dict(ours.state_dict())
    for x in (torch.randn(rows, 48), torch.randn(2, rows, 48)):
        used.clear()
        with torch.no_grad():
            assert linear.cpu_inference(x, ours.weight)
            got = ours(x)
            assert got.shape == x.shape[:-1] + (80,) and got.is_contiguous()
            torch.testing.assert_close(got, ref(x), atol=1e-5, rtol=1e-5)
        n = x.numel() // 48
        want = ("onednn_linear" if product == "onednn" and n >= linear.ONEDNN_MIN_ROWS else
                "cpu_linear" if n <= linear.MAX_ROWS else None)  # None: F.linear itself
        assert used == ([want] if want else [])
    x = torch.randn(rows, 48, requires_grad=True)
    assert not linear.cpu_inference(x, ours.weight)  # autograd on
    assert torch.equal(ours(x), ref(x))  # F.linear itself
    ours(x).sum().backward()
    assert ours.weight.grad is not None and x.grad is not None
    with torch.no_grad():
        assert not linear.cpu_inference(x.double(), ours.weight.double())  # float32 only


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 3, 64), (16, 48), (1, 17, 48), (1, 1, 37)])
def test_rmsnorm_of_a_few_rows_by_the_c_kernel_equals_torchs(shape):
    """model/native/rms_norm.c (a decode step's rows, float32 inference on the CPU) against F.rms_norm."""
    from attnlens.model.native import library as native
    from attnlens.model.parts.norms import RMSNorm

    if not native.available()[0]:
        pytest.skip(f"C kernels: {native.available()[1]}")
    norm = RMSNorm(shape[-1], eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = 3 * torch.randn(shape)
    strided = 3 * torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]  # not contiguous: copied first
    with torch.no_grad():
        for v in (x, strided):
            torch.testing.assert_close(norm(v), F.rms_norm(v, (shape[-1],), norm.weight, 1e-5), atol=1e-5, rtol=1e-5)

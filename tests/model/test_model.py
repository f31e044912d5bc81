"""The transformer itself: attention maths, KV cache, variants, config validation, decoding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import copy_attention_into_torch

from attnlens.model.config import ConfigError, ModelConfig
from attnlens.model.decoding import SamplingParams, filter_logits, generate_tokens
from attnlens.model.families.decoder import (
    ContextLengthError,
    Transformer,
    sinusoidal_table,
)
from attnlens.model.parts import MultiHeadAttention

SMALL = dict(vocab_size=50, context_length=40, d_model=32, n_layers=2, n_heads=4, d_ff=64)


def make_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**SMALL, **overrides})).eval()
    # Non-trivial LayerNorm parameters, so a mixed-up norm cannot hide behind weight=1, bias=0.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                if m.bias is not None:
                    m.bias.normal_(0.0, 0.1)
    return model


def make_attention(seed: int = 0, **overrides) -> MultiHeadAttention:
    torch.manual_seed(seed)
    attn = MultiHeadAttention(ModelConfig(**{**SMALL, **overrides})).eval()
    with torch.no_grad():  # nn.Linear's default init is fine, but make biases non-zero too
        attn.qkv.bias.normal_(0.0, 0.2)
        attn.proj.bias.normal_(0.0, 0.2)
    return attn


# --- attention -----------------------------------------------------------------------------


def test_attention_equals_sdpa():
    attn = make_attention()
    B, T, C, H = 2, 9, 32, 4
    x = torch.randn(B, T, C)
    with torch.no_grad():
        q, k, v = attn.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref = attn.proj(ref.transpose(1, 2).reshape(B, T, C))
        fast, none = attn(x, causal=True)
        explicit, probs = attn(x, causal=True, return_attention=True)
    assert none is None
    torch.testing.assert_close(fast, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(explicit, ref, atol=1e-6, rtol=0)
    assert probs.shape == (B, H, T, T)


def test_one_query_attention_over_cache_views_equals_sdpa():
    """The CPU's batched-decode path (one query per row, rows of different lengths, keys and
    values read as views of a KV cache) against PyTorch's SDPA with the same mask, also with
    a mask shared by every row (the cross-attention's shape)."""
    R, B, H, P, D, S = 6, 4, 3, 20, 8, 13
    cache_k, cache_v = torch.randn(R, H, P, D), torch.randn(R, H, P, D)
    k, v = cache_k[1:1 + B, :, :S], cache_v[1:1 + B, :, :S]  # (B, H, S, D) strided views, as decoding reads them
    q = torch.randn(B, H, 1, D)
    lengths = torch.tensor([3, 13, 7, 1])
    row_mask = (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, S)
    shared_mask = (torch.arange(S) < 9)[None, None, None, :]  # (1, 1, 1, S)
    for mask in (row_mask, shared_mask):
        got = MultiHeadAttention.one_query_attention(q, k, v, mask)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_attention_equals_torch_multihead_attention():
    attn = make_attention(seed=1)
    B, T, C, H = 2, 7, 32, 4
    mha = nn.MultiheadAttention(C, H, bias=True, batch_first=True).eval()
    copy_attention_into_torch(attn, mha)
    x = torch.randn(B, T, C)
    blocked = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)  # True = may NOT attend
    with torch.no_grad():
        ref_out, ref_per_head = mha(x, x, x, attn_mask=blocked, need_weights=True, average_attn_weights=False)
        _, ref_avg = mha(x, x, x, attn_mask=blocked, need_weights=True, average_attn_weights=True)
        ours_fast, _ = attn(x, causal=True)
        ours, probs = attn(x, causal=True, return_attention=True)
    torch.testing.assert_close(ours, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_fast, ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(probs, ref_per_head, atol=1e-6, rtol=0)
    torch.testing.assert_close(probs.mean(dim=1), ref_avg, atol=1e-6, rtol=0)


def test_attention_scale_is_inverse_sqrt_d_head():
    """One hand-computed attention row: softmax(q.k / sqrt(D))."""
    attn = make_attention(seed=2)
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        _, probs = attn(x, causal=True, return_attention=True)
        q, k, _ = attn.qkv(x).split(32, dim=2)
    D = 8
    q2, k0, k1, k2 = q[0, 2, :D], k[0, 0, :D], k[0, 1, :D], k[0, 2, :D]  # head 0, query 2
    scores = [float(q2 @ kj) / math.sqrt(D) for kj in (k0, k1, k2)]
    z = sum(math.exp(s) for s in scores)
    expected = [math.exp(s) / z for s in scores]
    assert probs[0, 0, 2].tolist() == pytest.approx(expected, abs=1e-6)


def test_explicit_path_equals_fast_path_in_the_model_with_and_without_cache():
    model = make_model(seed=3)
    ids = torch.randint(0, 50, (2, 15))
    with torch.no_grad():
        fast = model(ids).logits
        explicit, attentions = model(ids, return_attention=True)
        torch.testing.assert_close(explicit, fast, atol=1e-5, rtol=0)
        assert len(attentions) == model.config.n_layers
        # cached: a 10-token prefix, then a 4-token chunk, then one token
        c1, c2 = model.new_kv_cache(2), model.new_kv_cache(2)
        for chunk in (ids[:, :10], ids[:, 10:14], ids[:, 14:15]):
            a = model(chunk, kv_cache=c1).logits
            b, _ = model(chunk, kv_cache=c2, return_attention=True)
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def _check_rows(probs: torch.Tensor, start: int) -> None:
    """probs (B, H, T, S): query t sits at absolute position start + t."""
    B, H, T, S = probs.shape
    assert S == start + T
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, T), atol=1e-6, rtol=0)
    for t in range(T):
        pos = start + t
        assert torch.all(probs[:, :, t, pos + 1 :] == 0), f"query at {pos} sees the future"
        assert torch.all(probs[:, :, t, : pos + 1] > 0)


def test_attention_rows_sum_to_one_and_never_look_ahead():
    model = make_model(seed=4)
    ids = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        _, attentions = model(ids, return_attention=True)
    for probs in attentions:
        _check_rows(probs, start=0)


def test_attention_rows_with_a_kv_cache_prefix_use_absolute_positions():
    model = make_model(seed=5)
    ids = torch.randint(0, 50, (1, 13))
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        model(ids[:, :8], kv_cache=cache)
        _, chunk_att = model(ids[:, 8:12], kv_cache=cache, return_attention=True)
        _, step_att = model(ids[:, 12:13], kv_cache=cache, return_attention=True)
        _, full_att = model(ids, return_attention=True)
    for layer, probs in enumerate(chunk_att):
        _check_rows(probs, start=8)
        torch.testing.assert_close(probs, full_att[layer][:, :, 8:12, :12], atol=1e-6, rtol=0)
    for layer, probs in enumerate(step_att):
        _check_rows(probs, start=12)
        torch.testing.assert_close(probs, full_att[layer][:, :, 12:13, :], atol=1e-6, rtol=0)


# --- KV cache ------------------------------------------------------------------------------


def test_kv_cache_decoding_equals_full_recompute():
    model = make_model(seed=6)
    ids = torch.randint(0, 50, (1, 30))
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        full = model(ids).logits
        logits = model(ids[:, :5], kv_cache=cache).logits
        torch.testing.assert_close(logits, full[:, :5], atol=1e-5, rtol=0)
        for t in range(5, 30):  # 25 single-token steps
            step = model(ids[:, t : t + 1], kv_cache=cache).logits
            recompute = model(ids[:, : t + 1]).logits[:, -1:]
            torch.testing.assert_close(step, recompute, atol=1e-5, rtol=0)
            torch.testing.assert_close(step, full[:, t : t + 1], atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [30]


def test_kv_cache_multi_token_chunk_and_last_only():
    model = make_model(seed=7)
    ids = torch.randint(0, 50, (3, 25))
    cache = model.new_kv_cache(3)
    with torch.no_grad():
        full = model(ids).logits
        model(ids[:, :10], kv_cache=cache)
        chunk = model(ids[:, 10:17], kv_cache=cache).logits
        last = model(ids[:, 17:25], kv_cache=cache, last_only=True).logits
    torch.testing.assert_close(chunk, full[:, 10:17], atol=1e-5, rtol=0)
    assert last.shape == (3, 1, 50)
    torch.testing.assert_close(last, full[:, 24:25], atol=1e-5, rtol=0)


def test_context_overflow_raises_without_a_cache():
    model = make_model(seed=8)
    with torch.no_grad():
        assert model(torch.zeros(1, 40, dtype=torch.long)).logits.shape == (1, 40, 50)  # exactly fits
        with pytest.raises(ContextLengthError, match="41 tokens exceeds the context length 40"):
            model(torch.zeros(1, 41, dtype=torch.long))


def test_context_overflow_raises_with_a_cache_and_leaves_it_intact():
    model = make_model(seed=9)
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        model(torch.zeros(1, 36, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ContextLengthError, match="41 tokens"):
            model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
        assert cache.lengths.tolist() == [36]
        model(torch.zeros(1, 4, dtype=torch.long), kv_cache=cache)  # exactly fills it
        with pytest.raises(ContextLengthError, match="41 tokens"):
            model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)
    assert cache.lengths.tolist() == [40]


# --- positions, variants, embeddings -------------------------------------------------------


@pytest.mark.parametrize("pos, col", [(0, 0), (0, 1), (1, 0), (1, 1), (5, 6), (5, 7), (17, 30), (39, 63)])
def test_sinusoidal_table_matches_the_formula(pos, col):
    d = 64
    i2 = col - (col % 2)  # the "2i" of this column
    angle = pos / 10000 ** (i2 / d)
    expected = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    table = sinusoidal_table(40, d)
    assert table.shape == (40, d)
    assert float(table[pos, col]) == pytest.approx(expected, abs=1e-6)
    model = Transformer(ModelConfig(**{**SMALL, "d_model": 64, "positional": "sinusoidal"}))
    assert model.pos_emb is None
    assert float(model.pos_table[pos, col]) == pytest.approx(expected, abs=1e-6)


def test_sinusoidal_model_adds_the_table_to_token_embeddings():
    model = make_model(seed=10, positional="sinusoidal")
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    ids = torch.tensor([[3, 3, 7]])
    with torch.no_grad():
        model(ids)
    expected = model.tok_emb.weight[ids[0]].detach().clone()
    for p in range(3):
        for c in range(32):
            a = p / 10000 ** ((c - c % 2) / 32)
            expected[p, c] += math.sin(a) if c % 2 == 0 else math.cos(a)
    torch.testing.assert_close(seen["x"][0], expected, atol=1e-6, rtol=0)


def test_scale_embeddings_multiplies_token_embeddings_by_sqrt_d_model():
    plain = make_model(seed=11)
    scaled = make_model(seed=11, scale_embeddings=True)
    scaled.load_state_dict(plain.state_dict())
    seen = {}
    for name, m in (("plain", plain), ("scaled", scaled)):
        m.blocks[0].register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, args[0]))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        a, b = plain(ids).logits, scaled(ids).logits
    tok = plain.tok_emb.weight[ids[0]].detach()
    pos = plain.pos_emb.weight[:4].detach()
    torch.testing.assert_close(seen["plain"][0], tok + pos)
    torch.testing.assert_close(seen["scaled"][0], tok * math.sqrt(32) + pos)
    assert not torch.allclose(a, b)


def test_post_ln_normalises_after_the_residual_and_has_no_final_norm():
    model = make_model(seed=12, norm="post")
    assert isinstance(model.ln_f, nn.Identity)
    block = model.blocks[0]
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        out = block(x).x
        a, _ = block.attn(x, causal=True)
        h = block.ln1(x + a)
        expected = block.ln2(h + block.ffn(h))
    torch.testing.assert_close(out, expected)


def test_pre_ln_block_formula():
    block = make_model(seed=13).blocks[1]
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        out = block(x).x
        h = x + block.attn(block.ln1(x), causal=True)[0]
        expected = h + block.ffn(block.ln2(h))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_ffn_activation(activation):
    ffn = make_model(seed=14, activation=activation).blocks[0].ffn
    x = torch.randn(4, 32) * 3
    h = ffn.fc(x)
    if activation == "relu":
        act = torch.clamp(h, min=0)
    else:  # GPT-2's tanh approximation, written out
        act = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    with torch.no_grad():
        torch.testing.assert_close(ffn(x), ffn.proj(act), atol=1e-5, rtol=1e-5)


def test_untied_head_and_no_bias():
    model = make_model(seed=15, tie_embeddings=False, bias=False)
    assert model.lm_head.weight is not model.tok_emb.weight
    assert all(m.bias is None for m in model.modules() if isinstance(m, (nn.Linear, nn.LayerNorm)))
    tied = make_model(seed=15)
    assert tied.lm_head.weight is tied.tok_emb.weight


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"norm": "post"},
        {"activation": "relu"},
        {"norm": "post", "activation": "relu", "positional": "sinusoidal", "scale_embeddings": True},
        {"bias": False, "tie_embeddings": False},
    ],
)
def test_variants_train_on_a_tiny_repeated_batch(overrides):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**SMALL, "context_length": 16, **overrides})).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = torch.randint(0, 50, (4, 16))
    losses = []
    for _ in range(25):
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, 50), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert math.isfinite(losses[-1])
    assert losses[-1] < 0.7 * losses[0], losses


# --- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"d_model": 30, "n_heads": 4}, "divisible by n_heads"),
        ({"positional": "rope"}, "positional must be one of"),
        ({"norm": "middle"}, "norm must be one of"),
        ({"activation": "swiglu"}, "activation must be one of"),
        ({"n_layers": 0}, "n_layers must be a positive integer"),
        ({"vocab_size": 1.5}, "vocab_size must be a positive integer"),
        ({"d_ff": True}, "d_ff must be a positive integer"),
        ({"dropout": 1.0}, "dropout"),
        ({"layer_norm_eps": 0.0}, "layer_norm_eps"),
        ({"positional": "sinusoidal", "d_model": 9, "n_heads": 3}, "even d_model"),
    ],
)
def test_invalid_configs_raise_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**SMALL, **overrides})


def test_unknown_json_field_raises_config_error():
    data = ModelConfig(**SMALL).to_dict()
    data["n_shared_experts"] = 8
    with pytest.raises(ConfigError, match="unknown config field.*n_shared_experts"):
        ModelConfig.from_dict(data)
    import json

    with pytest.raises(ConfigError, match="n_shared_experts"):
        ModelConfig.from_json(json.dumps(data))


def test_config_json_round_trip(tmp_path):
    cfg = ModelConfig(**{**SMALL, "norm": "post", "activation": "relu", "dropout": 0.1, "layer_norm_eps": 1e-6})
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    cfg.save(tmp_path / "c.json")
    assert ModelConfig.load(tmp_path / "c.json") == cfg
    assert ModelConfig.load(tmp_path / "c.json").to_dict() == cfg.to_dict()
    assert ModelConfig().is_gpt2_shaped() == []
    assert len(cfg.is_gpt2_shaped()) == 2


# --- decoding (model.decoding) -------------------------------------------------------------


def test_filter_logits_top_k():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    out = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isfinite(out).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(out[[1, 3]], logits[[1, 3]])
    # top_k >= V keeps everything
    assert torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_k=5))).all()
    assert torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_k=99))).all()


def test_filter_logits_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # unsorted on purpose
    logits = probs.log()
    keep = lambda p: torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=p))).tolist()  # noqa: E731
    assert keep(0.4) == [False, True, False, False]  # 0.5 alone reaches 0.4
    assert keep(0.7) == [False, True, False, True]  # 0.5 + 0.3
    assert keep(0.9) == [False, True, True, True]  # 0.5 + 0.3 + 0.15
    assert keep(1.0) == [True, True, True, True]


def test_filter_logits_temperature_and_batching():
    logits = torch.randn(3, 10)
    out = filter_logits(logits, SamplingParams(temperature=0.5, top_k=3))
    torch.testing.assert_close(torch.softmax(out, -1).sum(-1), torch.ones(3))
    for row_in, row_out in zip(logits, out):
        kept = torch.isfinite(row_out)
        assert kept.sum() == 3
        assert set(kept.nonzero().flatten().tolist()) == set(torch.topk(row_in, 3).indices.tolist())
        torch.testing.assert_close(row_out[kept], row_in[kept] / 0.5)


def test_sampling_params_validation():
    for bad in (dict(temperature=-1), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_greedy_generation_equals_argmax_of_full_recompute():
    model = make_model(seed=20)
    prompt = [1, 2, 3, 4]
    out = list(generate_tokens(model, prompt, 12, SamplingParams(temperature=0)))
    assert len(out) == 12
    ids = list(prompt)
    with torch.no_grad():
        for tok in out:
            logits = model(torch.tensor([ids])).logits[0, -1]
            assert tok.id == int(logits.argmax())
            assert tok.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[tok.id]), abs=1e-5)
            ids.append(tok.id)


def test_same_seed_gives_same_tokens():
    model = make_model(seed=21)
    run = lambda seed: [t.id for t in generate_tokens(model, [5, 6], 25, SamplingParams(temperature=1.0, seed=seed))]  # noqa: E731
    assert run(123) == run(123)
    assert run(123) != run(124)


def test_top_logprobs_are_sorted_and_consistent():
    model = make_model(seed=22)
    tok = next(generate_tokens(model, [7, 8, 9], 1, SamplingParams(temperature=0), n_logprobs=5))
    assert len(tok.top_ids) == 5 and tok.top_ids[0] == tok.id
    assert tok.top_logprobs == sorted(tok.top_logprobs, reverse=True)
    assert tok.top_logprobs[0] == pytest.approx(tok.logprob)


def test_generate_returns_attention_rows_matching_full_recompute():
    model = make_model(seed=23)
    prompt = [3, 1, 4, 1, 5]
    out = list(generate_tokens(model, prompt, 6, SamplingParams(temperature=0), return_attention=True))
    ids = list(prompt)
    for step, tok in enumerate(out):
        n = len(prompt) + step  # positions so far, including the one that produced tok
        assert len(tok.attention) == model.config.n_layers
        with torch.no_grad():
            _, full = model(torch.tensor([ids]), return_attention=True)
        for layer, row in enumerate(tok.attention):
            assert row.shape == (model.config.n_heads, n)
            torch.testing.assert_close(row.sum(-1), torch.ones(model.config.n_heads), atol=1e-6, rtol=0)
            torch.testing.assert_close(row, full[layer][0, :, -1, :], atol=1e-6, rtol=0)
        ids.append(tok.id)


def test_generation_stops_at_the_context_length_without_error():
    model = make_model(seed=24)
    out = list(generate_tokens(model, list(range(37)), 100, SamplingParams(temperature=0)))
    assert len(out) == 40 - 37 + 1  # the last token is produced from position 39, never fed
    with pytest.raises(ValueError):
        list(generate_tokens(model, [], 5))

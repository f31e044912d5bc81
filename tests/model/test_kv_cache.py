"""The per-row KV cache and the shared parts' masking, against full recomputes and PyTorch's own modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import copy_attention_into_torch
from test_model import SMALL, make_model

from attnlens.model import ContextLengthError, ModelConfig
from attnlens.model.decoding import RowSampler, SamplingParams, decode_step, make_generator
from attnlens.model.parts import MultiHeadAttention


def full_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_rows_of_different_lengths_decode_in_one_batch_like_a_full_recompute():
    model = make_model(seed=30)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (3, 11, 7, 1)]
    cache = model.new_kv_cache(4)
    with torch.no_grad():
        for row, ids in enumerate(seqs):  # prefill each row alone, to its own length
            model(torch.tensor([ids]), kv_cache=cache, rows=slice(row, row + 1))
        assert cache.lengths.tolist() == [3, 11, 7, 1]
        for _ in range(6):  # batched single-token steps over all rows at once
            nxt = torch.randint(0, 50, (4, 1), generator=g)
            out = model(nxt, kv_cache=cache, return_attention=True)
            for row, ids in enumerate(seqs):
                ids.append(int(nxt[row, 0]))
                torch.testing.assert_close(out.logits[row, -1], full_last_logits(model, ids), atol=1e-4, rtol=0)
                # the row's attention covers its own keys only: the padding of longer rows gets exactly 0
                n = len(ids)
                full_att = model(torch.tensor([ids]), return_attention=True).attentions
                for layer, probs in enumerate(out.attentions):
                    assert torch.all(probs[row, :, -1, n:] == 0)
                    torch.testing.assert_close(probs[row, :, -1, :n], full_att[layer][0, :, -1], atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [9, 17, 13, 7]


def test_a_multi_token_chunk_on_rows_of_different_lengths():
    model = make_model(seed=31)
    a, b = list(range(1, 9)), list(range(20, 23))
    cache = model.new_kv_cache(2)
    with torch.no_grad():
        model(torch.tensor([a]), kv_cache=cache, rows=slice(0, 1))
        model(torch.tensor([b]), kv_cache=cache, rows=slice(1, 2))
        chunk = torch.tensor([[30, 31, 32], [40, 41, 42]])
        out = model(chunk, kv_cache=cache).logits  # (2, 3, V)
        ref_a = model(torch.tensor([a + [30, 31, 32]])).logits[0, -3:]
        ref_b = model(torch.tensor([b + [40, 41, 42]])).logits[0, -3:]
    torch.testing.assert_close(out[0], ref_a, atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], ref_b, atol=1e-4, rtol=0)


def test_freed_rows_are_reused_without_reallocating_and_rows_move():
    model = make_model(seed=32)
    cache = model.new_kv_cache(2)
    storage = [k.data_ptr() for k in cache.keys]
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5]]), kv_cache=cache, rows=slice(0, 1))
        model(torch.tensor([[9, 8]]), kv_cache=cache, rows=slice(1, 2))
        cache.free(0)  # a new request takes row 0: nothing of the old one may leak in
        out = model(torch.tensor([[7, 7, 6]]), kv_cache=cache, rows=slice(0, 1)).logits
        torch.testing.assert_close(out[0, -1], full_last_logits(model, [7, 7, 6]), atol=1e-4, rtol=0)
        cache.move(1, 0)  # row 1's request now lives in row 0
        assert cache.lengths.tolist() == [2, 0]
        step = model(torch.tensor([[5]]), kv_cache=cache, rows=slice(0, 1)).logits
        torch.testing.assert_close(step[0, -1], full_last_logits(model, [9, 8, 5]), atol=1e-4, rtol=0)
    assert [k.data_ptr() for k in cache.keys] == storage


def test_a_row_that_would_overflow_raises_and_leaves_every_row_intact():
    model = make_model(seed=33)
    cache = model.new_kv_cache(2)
    with torch.no_grad():
        model(torch.zeros(1, 39, dtype=torch.long), kv_cache=cache, rows=slice(0, 1))
        model(torch.zeros(1, 4, dtype=torch.long), kv_cache=cache, rows=slice(1, 2))
        model(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache)  # row 0 reaches exactly 40
        with pytest.raises(ContextLengthError, match="41 tokens exceeds the context length 40"):
            model(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache)
    assert cache.lengths.tolist() == [40, 5]


def test_masked_keys_get_exactly_zero_probability():
    torch.manual_seed(34)
    attn = MultiHeadAttention(ModelConfig(**SMALL)).eval()
    x = torch.randn(2, 5, 32) * 4  # large scores: a leaky mask would show
    mask = torch.tensor([[True, False, True, True, False], [False, True, True, False, True]])[:, None, None, :]
    with torch.no_grad():
        y, probs = attn(x, mask=mask, return_attention=True)  # (B, 1, 1, S): a padding mask
        fast, _ = attn(x, mask=mask)
    assert torch.all(probs.masked_select(~mask.expand_as(probs)) == 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 5), atol=1e-6, rtol=0)
    torch.testing.assert_close(fast, y, atol=1e-5, rtol=0)
    # the same masked attention from nn.MultiheadAttention on the same weights
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    with torch.no_grad():
        copy_attention_into_torch(attn, mha)
        ref, ref_probs = mha(x, x, x, key_padding_mask=~mask[:, 0, 0], average_attn_weights=False)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=0)


def test_cross_attention_equals_torch_multihead_attention():
    torch.manual_seed(35)
    attn = MultiHeadAttention(ModelConfig(**SMALL)).eval()
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    with torch.no_grad():
        copy_attention_into_torch(attn, mha)
        x, memory = torch.randn(2, 3, 32), torch.randn(2, 6, 32)
        ours, probs = attn(x, memory, return_attention=True)
        fast, _ = attn(x, memory)
        ref, ref_probs = mha(x, memory, memory, average_attn_weights=False)
    assert probs.shape == (2, 4, 3, 6)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(probs, ref_probs, atol=1e-6, rtol=0)


def test_one_batched_decode_step_picks_what_each_row_picks_alone():
    """The shared decode step: each row sampled by its own rules and seeded generator."""
    model = make_model(seed=36)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10], [11, 12]]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=0.7, top_k=5, seed=6), SamplingParams(temperature=1.3, top_p=0.8, seed=7)]

    def run(rows: list[int]) -> dict[int, list[int]]:
        cache = model.new_kv_cache(len(rows))
        samplers = [RowSampler(params[r], make_generator(params[r].seed), 3) for r in rows]
        last = []
        with torch.no_grad():
            for i, r in enumerate(rows):
                step = decode_step(model, cache, torch.tensor([prompts[r]]), [samplers[i]], rows=slice(i, i + 1))
                last.append(step.tokens[0].id)
            out = {r: [t] for r, t in zip(rows, last)}
            for _ in range(10):
                step = decode_step(model, cache, torch.tensor([[t] for t in last]), samplers)
                last = [t.id for t in step.tokens]
                for r, t in zip(rows, last):
                    out[r].append(t)
        return out

    together = run([0, 1, 2, 3])
    for r in range(4):
        assert run([r])[r] == together[r]


def test_right_padded_prompts_prefill_together_like_each_alone():
    """Prompts of 2, 9 and 5 tokens in one right-padded forward: each row's logits at its last
    real token, its attention row, and the decoding after it equal a full recompute of that row."""
    model = make_model(seed=37)
    prompts = [[3, 4], [5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18]]
    n_new = [len(p) for p in prompts]
    padded = torch.tensor([p + [0] * (9 - len(p)) for p in prompts])  # (3, 9), pad id 0
    cache = model.new_kv_cache(3)
    samplers = [RowSampler(SamplingParams(temperature=0), return_attention=True) for _ in prompts]
    with torch.no_grad():
        step = decode_step(model, cache, padded, samplers, n_new=n_new)
        assert cache.lengths.tolist() == n_new  # the padding is not kept
        for b, ids in enumerate(prompts):
            ref = full_last_logits(model, ids)
            torch.testing.assert_close(step.output.logits[b, -1], ref, atol=1e-4, rtol=0)
            assert step.tokens[b].id == int(ref.argmax())
            full_att = model(torch.tensor([ids]), return_attention=True).attentions
            for layer, row in enumerate(step.tokens[b].attention):
                torch.testing.assert_close(row, full_att[layer][0, :, -1], atol=1e-5, rtol=0)
        nxt = [t.id for t in step.tokens]
        out = model(torch.tensor([[t] for t in nxt]), kv_cache=cache).logits
        for b, ids in enumerate(prompts):
            torch.testing.assert_close(out[b, -1], full_last_logits(model, ids + [nxt[b]]), atol=1e-4, rtol=0)


def test_fixed_shape_decode_step_equals_the_cached_forward():
    """Transformer.decode_fixed (keys over the whole capacity, masked by each row's length: the
    step CUDA graphs capture) gives the logits and attention rows of a full recompute (exact
    zeros past each row's length) and leaves a usable cache."""
    model = make_model(seed=38)
    seqs = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    cache = model.new_kv_cache(3)
    with torch.no_grad():
        for row, ids in enumerate(seqs):
            model(torch.tensor([ids]), kv_cache=cache, rows=slice(row, row + 1))
        for step in range(4):
            nxt = torch.tensor([[20 + step], [30 + step], [40 + step]])
            logits, att = model.decode_fixed(nxt, cache, cache.lengths.clone(), return_attention=True)
            cache.lengths += 1
            for row, ids in enumerate(seqs):
                ids.append(int(nxt[row, 0]))
                torch.testing.assert_close(logits[row, -1], full_last_logits(model, ids), atol=1e-4, rtol=0)
                full = model(torch.tensor([ids]), return_attention=True).attentions
                for a, f in zip(att, full):  # (B, H, 1, P) against the full recompute's last query
                    torch.testing.assert_close(a[row, :, 0, : len(ids)], f[0, :, -1], atol=1e-5, rtol=0)
                    assert (a[row, :, 0, len(ids):] == 0).all()
        out = model(torch.tensor([[7], [7], [7]]), kv_cache=cache).logits  # the ordinary path goes on from there
    for row, ids in enumerate(seqs):
        torch.testing.assert_close(out[row, -1], full_last_logits(model, ids + [7]), atol=1e-4, rtol=0)


def test_graphed_decoder_pads_a_batch_to_its_bucket_like_the_plain_step():
    """The CUDA-graph decoder's padded bucket path (run eagerly here, without CUDA): 3 rows in the
    bucket of 4 decode exactly as the plain step does (the steps where a row streams its
    attention too: the same rows), and the free 4th row stays free."""
    from attnlens.model.cuda_graphs import GraphedDecoder

    model = make_model(seed=39)
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    plain, graphed = model.new_kv_cache(5), model.new_kv_cache(5)
    decoder = GraphedDecoder(model, graphed, capture=False)
    assert decoder.buckets == [1, 2, 4, 5] and decoder.bucket(3) == 4
    samplers = [RowSampler(SamplingParams(temperature=0)) for _ in prompts]
    with torch.no_grad():
        for cache in (plain, graphed):
            for row, ids in enumerate(prompts):
                model(torch.tensor([ids]), kv_cache=cache, rows=slice(row, row + 1))
        last = torch.tensor([[10], [11], [12]])
        for step in range(5):
            samplers[1].return_attention = step >= 2  # the middle row streams its attention from step 2
            a = decode_step(model, plain, last, samplers)
            b = decode_step(model, graphed, last, samplers, graphs=decoder)
            torch.testing.assert_close(b.output.logits, a.output.logits, atol=1e-4, rtol=0)
            assert [t.id for t in a.tokens] == [t.id for t in b.tokens]
            for x, y in zip(a.tokens, b.tokens):
                assert (x.attention is None) == (y.attention is None) == (x is not a.tokens[1] or step < 2)
                for ra, rb in zip(x.attention or [], y.attention or []):  # (H, this row's length)
                    assert ra.shape == rb.shape
                    torch.testing.assert_close(rb, ra, atol=1e-5, rtol=0)
            last = torch.tensor([[t.id] for t in a.tokens])
    assert graphed.lengths.tolist() == plain.lengths.tolist() == [9, 7, 8, 0, 0]

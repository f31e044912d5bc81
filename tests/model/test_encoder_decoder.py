"""The encoder-decoder family: parity with torch.nn.Transformer, the caches, the masks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers import copy_attention_into_torch

from attnlens.model import ModelConfig, load_checkpoint, save_checkpoint
from attnlens.model.config import ContextLengthError
from attnlens.model.families.encoder_decoder import EncoderDecoder, EncoderDecoderOutput, greedy_translate_ids

C, H, F_, L, V = 32, 4, 64, 2, 53


def s2s_config(**kw) -> ModelConfig:
    fields = dict(family="encoder-decoder", vocab_size=V, context_length=16, d_model=C, n_layers=L,
                  n_heads=H, d_ff=F_, norm="post", activation="relu", positional="sinusoidal",
                  scale_embeddings=True)
    fields.update(kw)
    return ModelConfig(**fields)


def lengths_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T) True = real


def future_mask(T: int) -> torch.Tensor:
    """nn.Transformer's tgt_mask as booleans (True = may NOT attend), like its padding masks."""
    return torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)


def randomise(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial LayerNorm and bias values, so a wrong copy cannot pass by accident."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def copy_linear_norm(ours, theirs) -> None:
    theirs.weight.copy_(ours.weight)
    theirs.bias.copy_(ours.bias)


def torch_transformer_from(model: EncoderDecoder) -> nn.Transformer:
    """torch.nn.Transformer (batch_first, post-LN, ReLU) holding our weights."""
    c = model.config
    ref = nn.Transformer(d_model=c.d_model, nhead=c.n_heads, num_encoder_layers=c.n_layers,
                         num_decoder_layers=c.n_layers, dim_feedforward=c.d_ff, dropout=0.0,
                         activation="relu", batch_first=True, norm_first=False)
    with torch.no_grad():
        for ours, theirs in zip(model.encoder.blocks, ref.encoder.layers):
            copy_attention_into_torch(ours.attn, theirs.self_attn)
            copy_linear_norm(ours.ffn.fc, theirs.linear1)
            copy_linear_norm(ours.ffn.proj, theirs.linear2)
            copy_linear_norm(ours.ln1, theirs.norm1)
            copy_linear_norm(ours.ln2, theirs.norm2)
        for ours, theirs in zip(model.decoder.blocks, ref.decoder.layers):
            copy_attention_into_torch(ours.attn, theirs.self_attn)
            copy_attention_into_torch(ours.cross_attn, theirs.multihead_attn)
            copy_linear_norm(ours.ffn.fc, theirs.linear1)
            copy_linear_norm(ours.ffn.proj, theirs.linear2)
            copy_linear_norm(ours.ln1, theirs.norm1)
            copy_linear_norm(ours.ln_cross, theirs.norm2)
            copy_linear_norm(ours.ln2, theirs.norm3)
        copy_linear_norm(model.encoder_norm, ref.encoder.norm)
        copy_linear_norm(model.decoder_norm, ref.decoder.norm)
    # train() with dropout 0 keeps PyTorch off its nested-tensor fast path, which zeroes
    # the outputs at padded positions instead of computing them
    return ref.train()


@pytest.fixture(scope="module")
def model() -> EncoderDecoder:
    torch.manual_seed(0)
    m = EncoderDecoder(s2s_config())
    randomise(m)
    return m.eval()


def padded_batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    src_len, tgt_len = [7, 4, 1], [5, 6, 2]
    src = torch.randint(5, V, (3, 7), generator=g)
    tgt = torch.randint(5, V, (3, 6), generator=g)
    return src, lengths_mask(src_len, 7), tgt, lengths_mask(tgt_len, 6)


def test_stacks_equal_torch_nn_transformer_with_every_mask(model):
    src, src_keep, tgt, tgt_keep = padded_batch()
    x, y = model.embed(src), model.embed(tgt)
    ref = torch_transformer_from(model)
    T = tgt.shape[1]
    with torch.no_grad():
        want = ref(x, y, tgt_mask=future_mask(T),
                   src_key_padding_mask=~src_keep, tgt_key_padding_mask=~tgt_keep,
                   memory_key_padding_mask=~src_keep)
        want_memory = ref.encoder(x, src_key_padding_mask=~src_keep)
        memory, _ = model.encoder_stack(x, src_keep)
        got, _, _ = model.decoder_stack(y, model.cross_kv(memory), source_keep=src_keep,
                                        self_mask=tgt_keep[:, None, None, :], target_keep=tgt_keep)
    torch.testing.assert_close(memory, want_memory, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got - want).abs().max() < 1e-5
    # the explicit (attention-returning) path computes the same
    with torch.no_grad():
        memory2, _ = model.encoder_stack(x, src_keep, return_attention=True)
        got2, _, _ = model.decoder_stack(y, model.cross_kv(memory2), source_keep=src_keep,
                                         self_mask=tgt_keep[:, None, None, :], target_keep=tgt_keep,
                                         return_attention=True)
    torch.testing.assert_close(got2, want, atol=1e-5, rtol=0)


def test_full_forward_is_embedding_stacks_head(model):
    src, src_keep, tgt, tgt_keep = padded_batch()
    ref = torch_transformer_from(model)
    with torch.no_grad():
        out = model(tgt, source=src, source_mask=src_keep, target_mask=tgt_keep)
        hidden = ref(model.embed(src), model.embed(tgt),
                     tgt_mask=future_mask(tgt.shape[1]),
                     src_key_padding_mask=~src_keep, tgt_key_padding_mask=~tgt_keep,
                     memory_key_padding_mask=~src_keep)
    assert isinstance(out, EncoderDecoderOutput)
    assert out.attentions is None and out.encoder_attentions is None and out.cross_attentions is None
    torch.testing.assert_close(out.logits, hidden @ model.tok_emb.weight.T, atol=1e-4, rtol=0)


def test_three_attention_groups_shapes_and_masks(model):
    src, src_keep, tgt, tgt_keep = padded_batch()
    with torch.no_grad():
        out = model(tgt, source=src, source_mask=src_keep, target_mask=tgt_keep, return_attention=True)
    B, S, T = 3, 7, 6
    assert len(out.encoder_attentions) == len(out.attentions) == len(out.cross_attentions) == L
    for enc, dec, cross in zip(out.encoder_attentions, out.attentions, out.cross_attentions):
        assert enc.shape == (B, H, S, S) and dec.shape == (B, H, T, T) and cross.shape == (B, H, T, S)
        pad_src = ~src_keep[:, None, None, :]  # (B, 1, 1, S)
        # padded source positions get exactly 0, from the encoder and from every target step
        assert torch.all(cross.masked_select(pad_src.expand_as(cross)) == 0)
        assert torch.all(enc.masked_select(pad_src.expand_as(enc)) == 0)
        # decoder self-attention is causal: nothing above the diagonal
        assert torch.all(dec.triu(diagonal=1) == 0)
        # real query rows sum to 1; padded query rows are not results (zero)
        for b in range(B):
            t, s = int(tgt_keep[b].sum()), int(src_keep[b].sum())
            torch.testing.assert_close(cross[b, :, :t].sum(-1), torch.ones(H, t))
            torch.testing.assert_close(dec[b, :, :t].sum(-1), torch.ones(H, t))
            torch.testing.assert_close(enc[b, :, :s].sum(-1), torch.ones(H, s))
            assert torch.all(cross[b, :, t:] == 0) and torch.all(enc[b, :, s:] == 0)


def test_cross_attention_equals_an_explicit_softmax(model):
    src, src_keep, tgt, tgt_keep = padded_batch()
    with torch.no_grad():
        out = model(tgt, source=src, source_mask=src_keep, target_mask=tgt_keep, return_attention=True)
        memory, _ = model.encode(src, src_keep)
        # decoder layer 0's queries, by hand: post-LN self-attention sub-layer, then q . k
        block = model.decoder.blocks[0]
        y = model.embed(tgt)
        y = block.ln1(y + block.attn(y, mask=tgt_keep[:, None, None, :], causal=True)[0])
        q = (y @ block.cross_attn.qkv.weight[:C].T + block.cross_attn.qkv.bias[:C]).view(3, 6, H, C // H).transpose(1, 2)
        k, _ = block.cross_attn.project_memory(memory)
        scores = (q @ k.transpose(-1, -2)) / (C // H) ** 0.5
        scores = scores.masked_fill(~src_keep[:, None, None, :], float("-inf"))
        want = torch.softmax(scores, dim=-1) * tgt_keep[:, None, :, None]
    torch.testing.assert_close(out.cross_attentions[0], want, atol=1e-6, rtol=0)


def test_incremental_decoding_equals_full_recompute(model):
    """Rows with different source lengths; cross K/V computed once; the decoder cached."""
    src, src_keep, tgt, _ = padded_batch()
    B, T = tgt.shape
    with torch.no_grad():
        full = model(tgt, source=src, source_mask=src_keep, return_attention=True)
        cache = model.new_kv_cache(B)
        first = model(tgt[:, :2], source=src, source_mask=src_keep, kv_cache=cache, return_attention=True)
        steps = [first]
        for t in range(2, T):
            steps.append(model(tgt[:, t:t + 1], kv_cache=cache, return_attention=True))
    logits = torch.cat([o.logits for o in steps], dim=1)
    torch.testing.assert_close(logits, full.logits, atol=1e-5, rtol=0)
    assert steps[1].encoder_attentions is None  # the encoder ran once, in the first call
    for layer in range(L):
        cross = torch.cat([o.cross_attentions[layer] for o in steps], dim=2)
        torch.testing.assert_close(cross, full.cross_attentions[layer], atol=1e-6, rtol=0)
        dec_last = steps[-1].attentions[layer][:, :, -1]  # (B, H, T): the last step's self row
        torch.testing.assert_close(dec_last, full.attentions[layer][:, :, -1], atol=1e-6, rtol=0)
    assert cache.lengths.tolist() == [T] * B


def test_cache_rows_of_different_target_lengths_and_moves(model):
    """Rows at different decoding steps batch together; a moved row decodes the same."""
    src, src_keep, tgt, _ = padded_batch()
    with torch.no_grad():
        full = model(tgt, source=src, source_mask=src_keep).logits
        cache = model.new_kv_cache(5)
        model(tgt[0:1, :3], source=src[0:1], source_mask=src_keep[0:1], kv_cache=cache, rows=slice(0, 1))
        model(tgt[1:2, :1], source=src[1:2, :4], kv_cache=cache, rows=slice(1, 2))
        # row 0 is at step 3, row 1 at step 1: one batched call gives each its own next logits
        both = model(torch.stack([tgt[0, 3:4], tgt[1, 1:2]]), kv_cache=cache, rows=slice(0, 2)).logits
        torch.testing.assert_close(both[0, 0], full[0, 3], atol=1e-5, rtol=0)
        torch.testing.assert_close(both[1, 0], full[1, 1], atol=1e-5, rtol=0)
        cache.move(1, 3)
        again = model(tgt[1:2, 2:3], kv_cache=cache, rows=slice(3, 4)).logits
        torch.testing.assert_close(again[0, 0], full[1, 2], atol=1e-5, rtol=0)
        cache.free(3)
        model(src[2:3, :1], kv_cache=cache, rows=slice(4, 5))  # row 4: a new request (a prompt)
        with pytest.raises(ValueError, match="mix rows"):
            model(tgt[0:2, :1], kv_cache=cache, rows=slice(3, 5))


def test_a_prompt_on_an_empty_row_is_the_source(model):
    """The decoder family's prefill, model(prompt, kv_cache=, rows=), reads the prompt as the
    source and feeds the start token: the same logits as the explicit call."""
    src, src_keep, tgt, _ = padded_batch()
    with torch.no_grad():
        full = model(torch.cat([torch.zeros(1, 1, dtype=torch.long), tgt[1:2, 1:3]], dim=1),
                     source=src[1:2, :4]).logits
        cache = model.new_kv_cache(2)
        first = model(src[1:2, :4], kv_cache=cache, rows=slice(1, 2), return_attention=True)
        assert first.logits.shape == (1, 1, V) and first.encoder_attentions[0].shape == (1, H, 4, 4)
        assert first.cross_attentions[0].shape == (1, H, 1, 4)
        nxt = model(tgt[1:2, 1:3], kv_cache=cache, rows=slice(1, 2)).logits
    torch.testing.assert_close(torch.cat([first.logits, nxt], dim=1), full, atol=1e-5, rtol=0)
    assert int(cache.source_lengths[1]) == 4 and int(cache.lengths[1]) == 3


def test_generate_tokens_translates_the_prompt(model):
    """model.decoding.generate_tokens (the decoder's) works unchanged: the prompt is the source."""
    from attnlens.model.decoding import SamplingParams, generate_tokens

    src = [7, 8, 9, 10, 11]
    want = greedy_translate_ids(model, [src], 0, -1, max_new_tokens=6)[0]
    got = [t.id for t in generate_tokens(model, src, 6, SamplingParams(temperature=0))]
    assert got == want


def test_greedy_batch_equals_greedy_alone(model):
    src, src_keep, _, _ = padded_batch()
    sources = [src[b, :int(src_keep[b].sum())].tolist() for b in range(3)]
    together = greedy_translate_ids(model, sources, 0, 1, max_new_tokens=8)
    alone = [greedy_translate_ids(model, [s], 0, 1, max_new_tokens=8)[0] for s in sources]
    assert together == alone
    # and the first greedy token is the argmax of a full recompute
    with torch.no_grad():
        logits = model(torch.zeros(1, 1, dtype=torch.long), source=torch.tensor([sources[0]])).logits
    first = int(logits[0, -1].argmax())
    assert together[0][:1] == ([] if first == 1 else [first])


def test_source_too_long_is_a_context_length_error(model):
    with pytest.raises(ContextLengthError, match="source"):
        model(torch.zeros(1, 1, dtype=torch.long), source=torch.zeros(1, 17, dtype=torch.long))


def test_checkpoint_round_trip_builds_the_family(tmp_path, model):
    from attnlens.model.tokenizer import Tokenizer

    tok = Tokenizer.train(["one two three", "un deux trois"] * 3, 300, encoder_tokens=True)
    cfg = s2s_config(vocab_size=max(V, tok.vocab_size))
    torch.manual_seed(1)
    m = EncoderDecoder(cfg).eval()
    save_checkpoint(tmp_path / "s2s", m, tok)
    ck = load_checkpoint(tmp_path / "s2s")
    assert isinstance(ck.model, EncoderDecoder) and ck.config.family == "encoder-decoder"
    src = torch.tensor([[5, 6, 7]])
    tgt = torch.tensor([[0, 8]])
    torch.testing.assert_close(ck.model(tgt, source=src).logits, m(tgt, source=src).logits)


def test_blocks_sit_at_their_hook_names_and_checkpoints_keep_their_names(tmp_path, model):
    """The blocks' module paths are their hook names (encoder.blocks.{l}, decoder.blocks.{l}); the
    state_dict, and so every checkpoint, names them as before (encoder_blocks.{l}, decoder_blocks.{l}),
    and load_state_dict reads those names back into the same parameters."""
    params = dict(model.named_parameters())
    assert "encoder.blocks.1.attn.qkv.weight" in params and "decoder.blocks.0.cross_attn.proj.bias" in params
    state = model.state_dict()
    assert "encoder_blocks.1.attn.qkv.weight" in state and "decoder_blocks.0.cross_attn.proj.bias" in state
    assert not any(k.startswith(("encoder.", "decoder.")) for k in state)
    assert len(state) == len(params) + 1  # + the tied head, stored once by save_checkpoint
    fresh = EncoderDecoder(model.config)
    fresh.load_state_dict(state, strict=True)
    assert all(torch.equal(p, params[n]) for n, p in fresh.named_parameters())


def test_attention_groups_of_one_pair(model):
    from attnlens.model.families.encoder_decoder import attention_groups

    enc, dec, cross = attention_groups(model, [5, 6, 7, 8], [0, 9, 10])
    assert enc.shape == (L, H, 4, 4) and dec.shape == (L, H, 3, 3) and cross.shape == (L, H, 3, 4)
    with torch.no_grad():
        out = model(torch.tensor([[0, 9, 10]]), source=torch.tensor([[5, 6, 7, 8]]), return_attention=True)
    torch.testing.assert_close(cross[1], out.cross_attentions[1][0])
    torch.testing.assert_close(enc[0], out.encoder_attentions[0][0])


def test_cross_keys_values_are_computed_once_per_request(model, monkeypatch):
    """Decoding steps reuse the cached cross K/V: neither the encoder nor the memory
    projection runs after the first call."""
    from attnlens.model.parts import MultiHeadAttention

    calls = {"memory": 0, "encode": 0}
    project = MultiHeadAttention.project_memory
    encode = EncoderDecoder.encode

    def counting_project(self, memory):
        calls["memory"] += 1
        return project(self, memory)

    def counting_encode(self, *a, **kw):
        calls["encode"] += 1
        return encode(self, *a, **kw)

    monkeypatch.setattr(MultiHeadAttention, "project_memory", counting_project)
    monkeypatch.setattr(EncoderDecoder, "encode", counting_encode)
    greedy_translate_ids(model, [[5, 6, 7], [8, 9]], 0, -1, max_new_tokens=6)
    assert calls == {"memory": L, "encode": 1}  # one projection per decoder layer, for the whole batch

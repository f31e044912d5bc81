"""The encoder family: parity with PyTorch's own encoder, padding, attention maps, heads."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
from encoder_helpers import make_tiny_encoder
from helpers import copy_attention_into_torch

from attnlens.model import ModelConfig, load_checkpoint
from attnlens.model.config import ConfigError
from attnlens.model.families.encoder import Encoder, padding_mask

C, H, F_, L = 32, 4, 64, 3


def enc_config(**kw) -> ModelConfig:
    fields = dict(family="encoder", vocab_size=97, context_length=16, d_model=C, n_layers=L, n_heads=H,
                  d_ff=F_, norm="post", activation="relu", labels=["a", "b", "c"])
    fields.update(kw)
    return ModelConfig(**fields)


def lengths_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T) True = real


def copy_block_into_torch_layer(block, layer: nn.TransformerEncoderLayer) -> None:
    with torch.no_grad():
        copy_attention_into_torch(block.attn, layer.self_attn)
        layer.linear1.weight.copy_(block.ffn.fc.weight)
        layer.linear1.bias.copy_(block.ffn.fc.bias)
        layer.linear2.weight.copy_(block.ffn.proj.weight)
        layer.linear2.bias.copy_(block.ffn.proj.bias)
        layer.norm1.weight.copy_(block.ln1.weight)
        layer.norm1.bias.copy_(block.ln1.bias)
        layer.norm2.weight.copy_(block.ln2.weight)
        layer.norm2.bias.copy_(block.ln2.bias)


def randomise(model: nn.Module, seed: int = 0) -> None:
    """Non-trivial LayerNorm and bias values, so a wrong copy cannot pass by accident."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("norm_first", [False, True])
def test_layer_and_stack_equal_torch_transformer_encoder(norm_first):
    torch.manual_seed(0)
    cfg = enc_config(norm="pre" if norm_first else "post")
    enc = Encoder(cfg).eval()
    randomise(enc)
    ref_layer = nn.TransformerEncoderLayer(C, H, F_, dropout=0.0, activation="relu", batch_first=True,
                                           norm_first=norm_first, layer_norm_eps=cfg.layer_norm_eps)
    ref = nn.TransformerEncoder(ref_layer, num_layers=L, enable_nested_tensor=False).eval()
    for block, layer in zip(enc.blocks, ref.layers):
        copy_block_into_torch_layer(block, layer)

    lengths = [16, 11, 5]
    x = torch.randn(3, 16, C)
    real = lengths_mask(lengths, 16)
    with torch.no_grad():
        # one layer, SDPA path and explicit path
        want1 = ref.layers[0](x, src_key_padding_mask=~real)
        got1 = enc.blocks[0](x, mask=padding_mask(real)).x
        got1e = enc.blocks[0](x, return_attention=True, mask=padding_mask(real)).x
        # the whole stack
        want = ref(x, src_key_padding_mask=~real)
        got = x
        for block in enc.blocks:
            got = block(got, mask=padding_mask(real)).x
    for a, b in ((got1, want1), (got1e, want1), (got, want)):
        assert (a[real] - b[real]).abs().max().item() < 1e-5  # padded rows are not results


def test_attention_maps_equal_an_explicit_softmax_with_padding():
    torch.manual_seed(1)
    enc = Encoder(enc_config()).eval()
    randomise(enc, 1)
    ids = torch.randint(5, 97, (2, 12))
    real = lengths_mask([12, 7], 12)
    out = enc(ids, attention_mask=real, return_attention=True)
    assert len(out.attentions) == L and out.attentions[0].shape == (2, H, 12, 12)

    # recompute layer 0 by hand from the embeddings
    with torch.no_grad():
        x = enc.emb_norm(enc.tok_emb(ids) + enc.pos_emb.weight[:12])
        q, k, _ = enc.blocks[0].attn.qkv(x).split(C, dim=-1)
        q = q.view(2, 12, H, C // H).transpose(1, 2)
        k = k.view(2, 12, H, C // H).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(C // H)
        scores = scores.masked_fill(~real[:, None, None, :], float("-inf"))
        want = torch.softmax(scores, dim=-1) * real[:, None, :, None]
    assert torch.allclose(out.attentions[0], want, atol=1e-6)

    for probs in out.attentions:
        sums = probs.sum(-1)  # (B, H, T)
        assert torch.allclose(sums[real[:, None, :].expand_as(sums)], torch.tensor(1.0), atol=1e-5)
        assert torch.all(probs[1, :, :, 7:] == 0)  # padded keys: exactly zero weight
        assert torch.all(probs[1, :, 7:, :] == 0)  # padded query rows: excluded
        # bidirectional: above the diagonal is not zero
        assert torch.all(probs[0].triu(diagonal=1).sum((-1, -2)) > 0)


def test_padding_never_changes_a_result_and_both_paths_agree():
    torch.manual_seed(2)
    for pooling in ("mean", "cls"):
        enc = Encoder(enc_config(pooling=pooling)).eval()
        randomise(enc, 2)
        ids = torch.randint(5, 97, (1, 9))
        padded = torch.cat([ids, torch.ones(1, 7, dtype=torch.long)], dim=1)
        real = lengths_mask([9], 16)
        with torch.no_grad():
            alone_mlm = enc(ids).logits
            padded_mlm = enc(padded, attention_mask=real).logits
            padded_explicit = enc(padded, attention_mask=real, return_attention=True).logits
            alone_cls = enc(ids, task="classify").logits
            padded_cls = enc(padded, attention_mask=real, task="classify").logits
        assert torch.allclose(alone_mlm, padded_mlm[:, :9], atol=1e-5)
        assert torch.allclose(padded_mlm[:, :9], padded_explicit[:, :9], atol=1e-5)
        assert alone_cls.shape == (1, 3)
        assert torch.allclose(alone_cls, padded_cls, atol=1e-5)


def test_mlm_head_is_tied_to_the_token_embedding():
    enc = Encoder(enc_config())
    h = torch.randn(4, C)
    with torch.no_grad():
        enc.tok_emb.weight.mul_(2.0)
        logits = enc.mlm_logits(h)
        t = enc.mlm_norm(torch.relu(enc.mlm_dense(h)))
    assert torch.allclose(logits, t @ enc.tok_emb.weight.T + enc.mlm_bias, atol=1e-5)
    assert not any("decoder" in name for name, _ in enc.named_parameters())


def test_config_family_defaults_to_decoder_and_is_validated(tmp_path):
    old = {"vocab_size": 50, "context_length": 8, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32}
    assert ModelConfig.from_dict(old).family == "decoder"
    with pytest.raises(ConfigError, match="family"):
        ModelConfig(family="seq2seq")
    with pytest.raises(ConfigError, match="does not build classifier"):
        ModelConfig(labels=["x"])
    with pytest.raises(ConfigError, match="pooling"):
        enc_config(pooling="max")


def test_encoder_checkpoint_round_trip(tmp_path):
    path = make_tiny_encoder(tmp_path / "enc")
    ckpt = load_checkpoint(path)
    assert isinstance(ckpt.model, Encoder) and ckpt.config.family == "encoder"
    assert json.loads((path / "config.json").read_text())["family"] == "encoder"
    ids = torch.tensor([[ckpt.tokenizer.cls_id, 40, 41, ckpt.tokenizer.mask_id, ckpt.tokenizer.sep_id]])
    assert ckpt.model(ids, task="classify").logits.shape == (1, 3)

"""Hugging Face BERT interop: our encoder exported loads as BertForMaskedLM and computes the
same logits and attentions; a BertForMaskedLM saved on disk imports and computes the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnlens.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from attnlens.model.interop.hf_bert import export_bert, import_bert

transformers = pytest.importorskip("transformers")
from encoder_helpers import TINY_TEXT, make_tiny_encoder  # noqa: E402
from transformers import BertConfig, BertForMaskedLM  # noqa: E402


def perturb_(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def padded_batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, 20), generator=g)
    mask = (torch.arange(20)[None, :] < torch.tensor([20, 13, 6])[:, None]).long()
    return ids, mask


def assert_same(ours_model, hf_model, ids, mask):
    real = mask.bool()
    with torch.no_grad():
        out = hf_model(input_ids=ids, attention_mask=mask, output_attentions=True)
        mine = ours_model(ids, attention_mask=mask, return_attention=True)
        fast = ours_model(ids, attention_mask=mask)
    torch.testing.assert_close(mine.logits[real], out.logits[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.logits[real], out.logits[real], atol=1e-5, rtol=0)
    assert len(mine.attentions) == len(out.attentions)
    for a, b in zip(mine.attentions, out.attentions):
        rows = real[:, None, :, None].expand_as(a)  # padded query rows are not results
        torch.testing.assert_close(a[rows], b[rows], atol=1e-5, rtol=0)
    assert (mine.attentions[0][:, 0] - mine.attentions[0][:, 1]).abs().max() > 0.02  # heads differ


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_exact"])
def test_export_loads_in_transformers_with_identical_logits_and_attentions(tmp_path, activation):
    src = make_tiny_encoder(tmp_path / "seed", activation=activation, layer_norm_eps=1e-6)
    ck = load_checkpoint(src)
    perturb_(ck.model, 5)
    with torch.no_grad():
        for block in ck.model.blocks:  # sharper attention, so heads differ visibly
            block.attn.qkv.weight.mul_(6)
    save_checkpoint(tmp_path / "ours", ck.model, ck.tokenizer)
    out = export_bert(tmp_path / "ours", tmp_path / "bert")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "bert" and cfg["layer_norm_eps"] == 1e-6
    hf = BertForMaskedLM.from_pretrained(out, attn_implementation="eager").eval()
    assert hf.cls.predictions.decoder.weight.data_ptr() == hf.bert.embeddings.word_embeddings.weight.data_ptr()
    model = load_checkpoint(tmp_path / "ours").model
    assert_same(model, hf, *padded_batch(model.config.vocab_size))
    # the tokenizer travels along and finds [MASK]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.mask_token_id == ck.tokenizer.mask_id
    assert tok("the [MASK] of", add_special_tokens=False)["input_ids"] == ck.tokenizer.encode("the [MASK] of")


def test_export_refuses_a_config_bert_cannot_express(tmp_path):
    src = make_tiny_encoder(tmp_path / "pre", norm="pre")
    with pytest.raises(ValueError, match="BERT is post-LN"):
        export_bert(src, tmp_path / "out")


def make_wordpiece_tokenizer_json(path: Path) -> None:
    from tokenizers import BertWordPieceTokenizer

    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator([TINY_TEXT] * 4, vocab_size=120, min_frequency=1,
                            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tok.save(str(path))


@pytest.mark.parametrize("hidden_act", ["gelu", "relu"])
def test_import_a_bert_from_disk(tmp_path, hidden_act):
    src = tmp_path / "bert"
    src.mkdir()
    make_wordpiece_tokenizer_json(src / "tokenizer.json")
    torch.manual_seed(7)
    cfg = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=40, hidden_act=hidden_act)
    hf = BertForMaskedLM(cfg).eval()
    perturb_(hf, 8)  # token-type row 0, biases and LayerNorms all non-trivial
    hf.save_pretrained(src)
    hf = BertForMaskedLM.from_pretrained(src, attn_implementation="eager").eval()

    out = import_bert(src, tmp_path / "ours")
    ck = load_checkpoint(out)
    assert ck.config.family == "encoder" and ck.config.is_bert_shaped() == []
    assert ck.config.activation == {"gelu": "gelu_exact", "relu": "relu"}[hidden_act]
    assert_same(ck.model, hf, *padded_batch(120, seed=1))
    # WordPiece tokens get readable display text; [MASK] is the mask token
    assert ck.tokenizer.mask_id == 4  # the 5th special token of the WordPiece vocabulary
    ids = ck.tokenizer.encode("to be or [MASK]")
    assert ck.tokenizer.mask_id in ids
    assert all(isinstance(ck.tokenizer.display_text(i), str) for i in ids)


def test_import_names_what_is_wrong(tmp_path):
    src = tmp_path / "bad"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_act": "silu",
                                                  "position_embedding_type": "relative_key"}))
    with pytest.raises(CheckpointError, match="hidden_act 'silu'.*absolute position"):
        import_bert(src, tmp_path / "out")
    (src / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    with pytest.raises(CheckpointError, match="only 'bert'"):
        import_bert(src, tmp_path / "out")

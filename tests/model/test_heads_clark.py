"""Clark et al. 2019's head scores ("What Does BERT Look At?"): attention to [CLS], to [SEP], to
punctuation, to the previous and the next token, and the rows' entropy, on fixed English
sentences. Against transformers' own BERT attentions (output_attentions), scored here loop by
loop from Clark's definitions; and through POST /heads on the bundled encoder."""

from __future__ import annotations

import math
import unicodedata

import pytest
import torch
from conftest import REPO_ROOT

from attnlens.app.serving.head_atlas import clark_probe
from attnlens.model import family_of, load_checkpoint
from attnlens.model.analysis import head_scores as hs
from attnlens.model.analysis.head_atlas_scores import score_heads

CLARK_SCORES = ("clark_cls", "clark_sep", "clark_punctuation", "clark_previous", "clark_next", "clark_entropy")


# --- Clark's measures, written out -------------------------------------------------------------


def ref_clark_scores(A: list[list[float]], cls: list[bool], sep: list[bool], punct: list[bool]) -> dict[str, float]:
    """One head's (T, T) map of one text -> each measure: a sum over the map's cells, divided by T
    (the mean over every query row), as Clark et al.'s General_Analysis does."""
    T = len(A)

    def to_keys(marks):
        return sum(A[i][j] for i in range(T) for j in range(T) if marks[j]) / T

    entropy = 0.0
    for i in range(T):
        entropy += -sum(p * math.log(p) for p in A[i] if p > 0)
    return {"clark_cls": to_keys(cls), "clark_sep": to_keys(sep), "clark_punctuation": to_keys(punct),
            "clark_previous": sum(A[i][i - 1] for i in range(1, T)) / T,
            "clark_next": sum(A[i][i + 1] for i in range(T - 1)) / T,
            "clark_entropy": entropy / T}


def wordpiece_punctuation(token: str, special: bool) -> bool:
    """A WordPiece token string is punctuation: no special token, its text ("##" off) all P*."""
    text = token[2:] if token.startswith("##") else token
    return not special and text != "" and all(unicodedata.category(c)[0] == "P" for c in text)


def test_punctuation_is_unicode_categories_p():
    for text in (".", ",", "?", "!", ";", "'", "...", " ,", "\u2014", "\u00ab", "\u201c", "-", "(", "\"."):
        assert hs.is_punctuation(text), text
    for text in ("", " ", "a", "a.", "$", "+", "1", "\u00a3", "\ufffd", "[CLS]"):
        assert not hs.is_punctuation(text), text


def test_roles_name_the_heads_clark_found():
    assert hs.roles({"clark_sep": 0.9, "previous_token": 0.4, "entropy": 0.5}) == ("sep", 0.9)
    assert hs.roles({"clark_cls": 0.8, "clark_sep": 0.1, "first_token": 0.6}) == ("cls", 0.8)
    assert hs.roles({"clark_punctuation": 0.45, "clark_sep": 0.5, "self": 0.1}) == ("punctuation", 0.45)
    assert hs.roles({"clark_punctuation": 0.2, "clark_sep": 0.3, "clark_cls": 0.1}) == ("mixed", 0.2)


def test_the_sentences_are_fixed_real_text_with_punctuation():
    assert len(hs.CLARK_SENTENCES) >= 6 and len(set(hs.CLARK_SENTENCES)) == len(hs.CLARK_SENTENCES)
    text = " ".join(hs.CLARK_SENTENCES)
    assert {",", ".", "?", ";", "'"} <= set(text)


# --- against transformers' BERT ---------------------------------------------------------------


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A random 2-layer, 4-head BertForMaskedLM on disk with an uncased WordPiece tokenizer, and
    its attnlens import (model/interop/hf_bert.py)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import BertWordPieceTokenizer

    from attnlens.model.interop.hf_bert import import_bert

    root = tmp_path_factory.mktemp("clark")
    src = root / "bert"
    src.mkdir()
    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(list(hs.CLARK_SENTENCES) * 4, vocab_size=200, min_frequency=1,
                           special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    from tokenizers.processors import BertProcessing

    wp.post_processor = BertProcessing(("[SEP]", wp.token_to_id("[SEP]")), ("[CLS]", wp.token_to_id("[CLS]")))
    wp.save(str(src / "tokenizer.json"))  # frames a text [CLS] text [SEP], as BERT's tokenizer does
    torch.manual_seed(11)
    cfg = transformers.BertConfig(vocab_size=wp.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=48)
    hf = transformers.BertForMaskedLM(cfg).eval()
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for layer in hf.bert.encoder.layer:  # sharper attention: heads that differ visibly
            layer.attention.self.query.weight.mul_(8)
            layer.attention.self.key.weight.mul_(8)
    hf.save_pretrained(src)
    hf = transformers.BertForMaskedLM.from_pretrained(src, attn_implementation="eager").eval()
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"), cls_token="[CLS]",
                                                  sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]",
                                                  unk_token="[UNK]")
    return hf, hf_tok, load_checkpoint(import_bert(src, root / "ours"))


def test_clark_scores_equal_clarks_definitions_on_transformers_attentions(bert):
    hf, hf_tok, ours = bert
    probe = clark_probe(family_of(ours.model), ours.tokenizer, ours.config.context_length)
    assert probe is not None and probe.sentences == list(hs.CLARK_SENTENCES)
    result = score_heads(ours.model, probe.ids[0], clark=probe)
    L, H = hf.config.num_hidden_layers, hf.config.num_attention_heads
    sums = {name: [[0.0] * H for _ in range(L)] for name in CLARK_SCORES}
    n_punct = 0
    for sentence, ids in zip(hs.CLARK_SENTENCES, probe.ids):
        # framed as BERT frames one text: what transformers' tokenizer gives for the sentence
        assert ids == hf_tok(sentence)["input_ids"]
        tokens = hf_tok.convert_ids_to_tokens(ids)
        special = set(hf_tok.all_special_ids)
        cls = [t == "[CLS]" for t in tokens]
        sep = [t == "[SEP]" for t in tokens]
        punct = [wordpiece_punctuation(t, i in special) for t, i in zip(tokens, ids)]
        n_punct += sum(punct)
        with torch.no_grad():
            attentions = hf.bert(input_ids=torch.tensor([ids]), output_attentions=True).attentions  # L x (1, H, T, T)
        for layer, a in enumerate(attentions):
            for head in range(H):
                for name, value in ref_clark_scores(a[0, head].double().tolist(), cls, sep, punct).items():
                    sums[name][layer][head] += value
    assert n_punct >= len(hs.CLARK_SENTENCES)  # every sentence has some: the punctuation score is not vacuous
    got = result.scores["self"]
    for name in CLARK_SCORES:
        for layer in range(L):
            for head in range(H):
                want = sums[name][layer][head] / len(hs.CLARK_SENTENCES)
                assert got[name][layer, head] == pytest.approx(want, abs=1e-5), (name, layer, head)
    for name in ("clark_cls", "clark_sep", "clark_previous", "clark_entropy"):  # the heads differ
        assert got[name].max() - got[name].min() > 0.02, name


def test_clark_scores_do_not_depend_on_the_input(bert):
    _, _, ours = bert
    probe = clark_probe(family_of(ours.model), ours.tokenizer, ours.config.context_length)
    a = score_heads(ours.model, probe.ids[1], clark=probe).scores["self"]
    b = score_heads(ours.model, [ours.tokenizer.cls_id, 7, 8, 9, ours.tokenizer.sep_id], clark=probe).scores["self"]
    for name in CLARK_SCORES:
        assert (a[name] == b[name]).all(), name
    assert not (a["previous_token"] == b["previous_token"]).all()  # the input's own scores do
    assert "clark_cls" not in score_heads(ours.model, probe.ids[1]).scores["self"]  # none asked for


def test_a_sentence_longer_than_the_context_keeps_its_start():
    class Tok:
        cls_id, sep_id = 1, 2

        def encode(self, text):
            return list(range(10, 10 + len(text.split())))

    assert hs.framed_sentences(Tok(), 6, ["a b c d e f g"]) == [[1, 10, 11, 12, 13, 2]]
    assert hs.framed_sentences(Tok(), 64, ["a b"]) == [[1, 10, 11, 2]]


# --- POST /heads ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def encoder_client():
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    path = REPO_ROOT / "checkpoints" / "encoder"
    if not (path / "model.safetensors").is_file():
        pytest.skip("the bundled encoder is not in checkpoints/encoder")
    settings = Settings(model=path, models=[path], device="cpu", engine_process=False, warmup=False)
    with TestClient(create_app(settings)) as c:
        yield c


def test_heads_gives_every_encoder_head_clarks_scores(encoder_client):
    r = encoder_client.post("/heads", json={"model": "encoder", "text": "To be, or not to be."})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["clark_sentences"] == list(hs.CLARK_SENTENCES)
    assert any("Clark" in n for n in body["notes"])
    longest = max(len(ids) for ids in hs.framed_sentences(load_checkpoint(REPO_ROOT / "checkpoints" / "encoder").tokenizer,
                                                          128))
    heads = body["heads"]
    assert len(heads) == 4 and all(len(row) == 4 for row in heads)
    for row in heads:
        for cell in row:
            s = cell["scores"]
            for name in ("clark_cls", "clark_sep", "clark_punctuation", "clark_previous", "clark_next"):
                assert s[name] is not None and 0.0 <= s[name] <= 1.0, (name, s[name])
            assert 0.0 <= s["clark_entropy"] <= math.log(longest) + 1e-6
            assert cell["role"] in set(body["thresholds"]) | {"mixed"}
    assert {"cls", "sep", "punctuation"} <= set(body["thresholds"])
    for name in CLARK_SCORES:
        assert "Clark" in body["definitions"][name] and name in body["groups"][0]["definitions"]
    assert "clark_sep" in body["definitions"]["role"]
    # the same on the probe: the sentences are fixed, whatever the input
    probe = encoder_client.post("/heads", json={"model": "encoder", "probe": {"kind": "repeated_random",
                                                                             "length": 10}}).json()
    for row, probe_row in zip(heads, probe["heads"]):
        for cell, probe_cell in zip(row, probe_row):
            for name in CLARK_SCORES:
                assert probe_cell["scores"][name] == pytest.approx(cell["scores"][name], abs=1e-6)


def test_a_decoders_atlas_has_no_clark_scores(client):
    body = client.post("/heads", json={"text": "To be, or not to be."}).json()
    assert body["clark_sentences"] is None and not any("clark" in k for k in body["heads"][0][0]["scores"])
    assert not any("clark" in k for k in body["definitions"]) and "clark" not in body["definitions"]["role"]

"""Issue 24, fill-mask and classify: /fill-mask on an imported (WordPiece) BERT answers as
transformers.pipeline("fill-mask") does on the same weights (same ids and token_str, scores
within 1e-4, `sequence` decoded by the tokenizer); a special token the model ranks first is
never a candidate; /classify lists labels best first on scores that are clearly apart."""

from __future__ import annotations

import pytest
import torch
from encoder_helpers import make_tiny_encoder
from fastapi.testclient import TestClient

from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.model import load_checkpoint, save_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bert_dirs(tmp_path_factory):
    """A random BertForMaskedLM with a WordPiece tokenizer saved as transformers saves it, and
    the same imported as our checkpoint."""
    from test_hf_bert import make_wordpiece_tokenizer_json, perturb_

    from attnlens.model.interop.hf_bert import import_bert

    root = tmp_path_factory.mktemp("bert")
    src = root / "bert"
    src.mkdir()
    make_wordpiece_tokenizer_json(src / "tokenizer.json")
    torch.manual_seed(3)
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=40)
    hf = transformers.BertForMaskedLM(cfg).eval()
    perturb_(hf, 9)
    hf.save_pretrained(src)
    transformers.BertTokenizerFast(tokenizer_file=str(src / "tokenizer.json")).save_pretrained(src)
    return src, import_bert(src, root / "ours")


def test_fill_mask_matches_the_transformers_pipeline_on_an_imported_bert(bert_dirs, tiny_checkpoint):
    src, ours = bert_dirs
    pipe = transformers.pipeline("fill-mask", model=str(src), tokenizer=str(src), device="cpu")
    special = set(pipe.tokenizer.all_special_ids)
    settings = Settings(model=tiny_checkpoint, models=[tiny_checkpoint, ours], device="cpu", warmup=False)
    texts = ["to be or [MASK] to be", "the slings and [MASK] of", "[MASK] nobler in the mind"]
    joined_pieces = 0
    with TestClient(create_app(settings)) as c:
        for text in texts:
            r = c.post("/fill-mask", json={"model": "ours", "text": text, "top_k": 5})
            assert r.status_code == 200, r.text
            got = r.json()["masks"][0]
            # the pipeline offers special tokens too: theirs, without those, first five
            want = [x for x in pipe(text, top_k=5 + len(special)) if x["token"] not in special][:5]
            assert [g["token"] for g in got] == [w["token"] for w in want], text
            assert [g["token_str"] for g in got] == [w["token_str"] for w in want]
            assert [g["score"] for g in got] == pytest.approx([w["score"] for w in want], abs=1e-4)
            assert [g["sequence"] for g in got] == [w["sequence"] for w in want]
            joined_pieces += sum(g["token_str"].startswith("##") for g in got)
    assert joined_pieces > 0  # a '##' piece was among them: its sequence joins the word before it


def test_a_special_token_the_model_ranks_first_is_never_a_candidate(tmp_path, tiny_checkpoint):
    path = make_tiny_encoder(tmp_path / "sep_lover", seed=6)
    ck = load_checkpoint(path)
    tok = ck.tokenizer
    with torch.no_grad():  # the MLM head's output bias makes [SEP] (and EOS) win everywhere
        bias = next(p for n, p in ck.model.named_parameters() if n.endswith("bias") and p.shape[0] == ck.config.vocab_size)
        bias[tok.sep_id] += 30.0
        bias[tok.eos_id] += 25.0
    save_checkpoint(path, ck.model, tok)
    text = "To be, or [MASK] to be"
    ids = [tok.cls_id, *tok.encode(text), tok.sep_id]
    with torch.no_grad():
        logits = load_checkpoint(path).model(torch.tensor([ids])).logits[0, ids.index(tok.mask_id)]
    probs = torch.softmax(logits, -1)
    assert int(probs.argmax()) == tok.sep_id  # the model's own first choice is special: the check bites
    settings = Settings(model=tiny_checkpoint, models=[tiny_checkpoint, path], device="cpu", warmup=False)
    with TestClient(create_app(settings)) as c:
        got = c.post("/fill-mask", json={"model": "sep_lover", "text": text, "top_k": 5}).json()["masks"][0]
    assert not {g["token"] for g in got} & set(tok.special_ids)
    ranked = [i for i in torch.argsort(probs, descending=True).tolist() if i not in tok.special_ids][:5]
    assert [g["token"] for g in got] == ranked
    assert [g["score"] for g in got] == pytest.approx([probs[i].item() for i in ranked], abs=1e-6)


def test_classify_lists_labels_best_first_on_clearly_separated_scores(tmp_path, tiny_checkpoint):
    path = make_tiny_encoder(tmp_path / "decided", seed=7)
    ck = load_checkpoint(path)
    with torch.no_grad():  # the classifier's bias orders the labels: history, tragedy, comedy
        bias = next(p for n, p in ck.model.named_parameters() if n.endswith("bias") and p.shape == (3,))
        bias.copy_(torch.tensor([-2.0, 2.5, 0.5]))
    save_checkpoint(path, ck.model, ck.tokenizer)
    settings = Settings(model=tiny_checkpoint, models=[tiny_checkpoint, path], device="cpu", warmup=False)
    with TestClient(create_app(settings)) as c:
        labels = c.post("/classify", json={"model": "decided", "text": "My lord, the king comes."}).json()["labels"]
    scores = [x["score"] for x in labels]
    assert [x["label"] for x in labels] == ["history", "tragedy", "comedy"]
    assert min(a - b for a, b in zip(scores, scores[1:])) > 0.05, scores  # apart: the order is no tie

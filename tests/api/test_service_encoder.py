"""Several models side by side: /models, the encoder's /fill-mask and /classify, /attention
for an encoder, and the errors for an unknown model or the wrong endpoint for a model.
Answers are checked against the encoder run directly (softmax of its own logits)."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest
import torch
from encoder_helpers import make_tiny_encoder
from fastapi.testclient import TestClient
from live_server import live_server

from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.app.serving.attention_codec import decode
from attnlens.model import load_checkpoint


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("enc") / "genre", seed=4)


@pytest.fixture(scope="module")
def bare_encoder_dir(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("enc") / "bare", seed=5, labels=[])


@pytest.fixture(scope="module")
def enc(encoder_dir):
    return load_checkpoint(encoder_dir)


@pytest.fixture(scope="module")
def client(tiny_checkpoint, encoder_dir, bare_encoder_dir):
    settings = Settings(model=tiny_checkpoint, models=[tiny_checkpoint, encoder_dir, bare_encoder_dir], device="cpu")
    with TestClient(create_app(settings)) as c:
        yield c


def direct_mlm_probs(ckpt, text: str) -> tuple[list[int], torch.Tensor]:
    """The framed ids and, per position, each token's probability (softmax over the whole
    vocabulary, as Hugging Face's fill-mask pipeline scores); special tokens set to 0 after the
    softmax, as they are never candidates."""
    tok = ckpt.tokenizer
    ids = [tok.cls_id, *tok.encode(text), tok.sep_id]
    with torch.no_grad():
        logits = ckpt.model(torch.tensor([ids])).logits[0]
    probs = torch.softmax(logits, dim=-1)
    probs[:, sorted(tok.special_ids)] = 0.0
    return ids, probs


def test_models_lists_every_model_with_family_tasks_and_labels(client, tiny_checkpoint):
    body = client.get("/models").json()
    assert body["default"] == tiny_checkpoint.name
    by_name = {m["name"]: m for m in body["models"]}
    assert set(by_name) == {tiny_checkpoint.name, "genre", "bare"}
    dec, genre, bare = by_name[tiny_checkpoint.name], by_name["genre"], by_name["bare"]
    assert dec["family"] == "decoder" and dec["default"] and dec["attention"] == "causal"
    assert set(dec["tasks"]) == {"generate", "completions", "attention"} and dec["labels"] is None
    assert genre["family"] == "encoder" and genre["attention"] == "bidirectional"
    assert genre["tasks"] == ["fill-mask", "classify", "attention", "embeddings"]
    assert genre["labels"] == ["comedy", "history", "tragedy"] and genre["pooling"] == "mean"
    assert (genre["n_layers"], genre["n_heads"], genre["context_length"]) == (2, 4, 64)
    assert bare["tasks"] == ["fill-mask", "attention", "embeddings"] and bare["labels"] is None
    assert genre["head_figures"] == {} and genre["classifier_layers"] == 0  # no reports beside its weights
    # /v1/models: only the models that generate
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [tiny_checkpoint.name]


def test_models_gives_each_heads_reported_figure_and_calls_a_poor_one_weak(tmp_path):
    """The reports beside an encoder's weights (model/training/encoder_heads.py writes them) reach
    /models, where the page reads them: a fill-mask head under 0.30 top-1, or a genre head not above
    bag of words, is weak."""
    model_dir = make_tiny_encoder(tmp_path / "reported", seed=6)
    (model_dir / "mlm_report.json").write_text(json.dumps({"fill_mask_common_words": {"top1": 0.12}}))
    (model_dir / "genre_report.json").write_text(json.dumps(
        {"held_out_genre": {"balanced_accuracy": 0.84}, "bow_baseline": {"balanced_accuracy": 0.81}}))
    with TestClient(create_app(Settings(model=model_dir, models=[model_dir], device="cpu"))) as c:
        figures = c.get("/models").json()["models"][0]["head_figures"]
    assert figures["fill-mask"]["value"] == 0.12 and figures["fill-mask"]["weak"]
    assert figures["classify"] == {"figure": figures["classify"]["figure"], "value": 0.84, "baseline": 0.81, "weak": False}


def test_fill_mask_matches_the_model_and_hf_pipeline_shape(client, enc):
    text = "To be, or [MASK] to be, that is the [MASK]"
    r = client.post("/fill-mask", json={"model": "genre", "text": text, "top_k": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "genre" and len(body["masks"]) == 2
    ids, probs = direct_mlm_probs(enc, text)
    positions = [i for i, t in enumerate(ids) if t == enc.tokenizer.mask_id]
    for pos, cands in zip(positions, body["masks"]):
        assert len(cands) == 4
        want = torch.topk(probs[pos], 4)
        assert [c["token"] for c in cands] == want.indices.tolist()
        assert [c["score"] for c in cands] == pytest.approx(want.values.tolist(), abs=1e-5)
        for c in cands:
            assert c["token_str"] == enc.tokenizer.decode([c["token"]])
            assert c["token"] not in enc.tokenizer.special_ids
    first = body["masks"][0][0]
    assert first["sequence"] == "To be, or" + first["token_str"] + " to be, that is the [MASK]"
    last = body["masks"][1][0]
    assert last["sequence"] == "To be, or [MASK] to be, that is the" + last["token_str"]


def test_classify_returns_every_label_best_first(client, enc):
    text = "My lord, the king is coming with his army."
    r = client.post("/classify", json={"model": "genre", "text": text})
    assert r.status_code == 200, r.text
    labels = r.json()["labels"]
    tok = enc.tokenizer
    with torch.no_grad():
        logits = enc.model(torch.tensor([[tok.cls_id, *tok.encode(text), tok.sep_id]]), task="classify").logits[0]
    want = dict(zip(enc.config.labels, torch.softmax(logits, -1).tolist()))
    assert {x["label"] for x in labels} == {"comedy", "history", "tragedy"}
    assert [x["score"] for x in labels] == sorted((x["score"] for x in labels), reverse=True)
    for x in labels:
        assert x["score"] == pytest.approx(want[x["label"]], abs=1e-6)
    assert math.isclose(sum(x["score"] for x in labels), 1.0, abs_tol=1e-5)


def test_encoder_attention_is_full_square_and_says_bidirectional(client, enc):
    r = client.post("/attention", json={"model": "genre", "text": "the queen of France", "format": "f16"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["family"] == "encoder" and body["direction"] == "bidirectional"
    tokens = [t["text"] for t in body["tokens"]]
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    maps = decode(body)
    T = len(tokens)
    assert maps.shape == (2, 4, T, T)
    assert np.allclose(maps.sum(-1), 1.0, atol=2e-3)
    assert (np.triu(maps, k=1).sum(axis=(-1, -2)) > 0.05).all()  # nothing forces zeros above the diagonal
    ids = [t["id"] for t in body["tokens"]]
    with torch.no_grad():
        want = enc.model(torch.tensor([ids]), return_attention=True).attentions
    assert np.allclose(maps[1], want[1][0].numpy(), atol=1e-3)
    dec = client.post("/attention", json={"text": "the queen of France"}).json()
    assert dec["family"] == "decoder" and dec["direction"] == "causal"
    r = client.post("/attention", json={"model": "genre", "text": "x y", "format": "u8", "packing": "tril"})
    assert r.status_code == 422 and r.json()["param"] == "packing"


@pytest.mark.parametrize("path, body", [
    ("/fill-mask", {"text": "a [MASK]"}),
    ("/classify", {"text": "a b"}),
    ("/attention", {"text": "a b"}),
    ("/generate", {"prompt": "a b", "max_new_tokens": 2}),
])
def test_unknown_model_is_a_404_that_lists_the_names(client, path, body, tiny_checkpoint):
    r = client.post(path, json={**body, "model": "gpt-5"})
    assert r.status_code == 404, r.text
    err = r.json()
    assert err["param"] == "model" and err["code"] == "model_not_found"
    for name in (tiny_checkpoint.name, "genre", "bare"):
        assert name in err["detail"]


def test_unknown_model_on_v1_completions_is_an_openai_404(client, tiny_checkpoint):
    r = client.post("/v1/completions", json={"model": "gpt-5", "prompt": "a", "max_tokens": 2})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and tiny_checkpoint.name in err["message"]
    r = client.post("/v1/completions", json={"model": "genre", "prompt": "a", "max_tokens": 2})
    assert r.status_code == 400 and "fill-mask" in r.json()["error"]["message"]


def test_wrong_endpoint_for_a_model_names_what_it_can_do(client, tiny_checkpoint):
    r = client.post("/fill-mask", json={"text": "a [MASK]"})  # the default model is the decoder
    assert r.status_code == 400 and r.json()["code"] == "unsupported_task"
    msg = r.json()["detail"]
    assert "a decoder" in msg and "generate (POST /generate)" in msg and "genre" in msg
    r = client.post("/generate", json={"model": "genre", "prompt": "a b", "max_new_tokens": 2})
    assert r.status_code == 400
    assert "an encoder" in r.json()["detail"] and "fill-mask (POST /fill-mask)" in r.json()["detail"]
    r = client.post("/classify", json={"model": "bare", "text": "a b"})
    assert r.status_code == 400 and "classify" in r.json()["detail"] and "models that can: genre" in r.json()["detail"]


def test_fill_mask_input_errors(client):
    r = client.post("/fill-mask", json={"model": "genre", "text": "no mask here"})
    assert r.status_code == 400 and r.json()["code"] == "no_mask" and r.json()["param"] == "text"
    r = client.post("/fill-mask", json={"model": "genre", "text": "to be " * 80 + "[MASK]"})
    assert r.status_code == 400 and r.json()["code"] == "context_length_exceeded"
    r = client.post("/fill-mask", json={"model": "genre", "text": "a [MASK]", "top_k": 0})
    assert r.status_code == 422 and r.json()["param"] == "top_k"
    r = client.post("/fill-mask", json={"model": "genre", "text": "[MASK]" * 33})
    assert r.status_code == 400 and r.json()["code"] == "too_many_masks"
    r = client.post("/classify", json={"model": "genre", "text": "a", "top_k": 2})
    assert r.status_code == 422  # unknown fields are refused


def test_live_server_serves_models_side_by_side(tmp_path, tiny_checkpoint, encoder_dir, enc):
    env = {"ATTNLENS_MODELS": f"{tiny_checkpoint},{encoder_dir}"}
    with live_server(tiny_checkpoint, tmp_path, env=env) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=30) as http:
            names = [m["name"] for m in http.get("/models").json()["models"]]
            assert names == [tiny_checkpoint.name, "genre"]
            fill = http.post("/fill-mask", json={"model": "genre", "text": "the [MASK] of France", "top_k": 3})
            assert fill.status_code == 200, fill.text
            ids, probs = direct_mlm_probs(enc, "the [MASK] of France")
            pos = ids.index(enc.tokenizer.mask_id)
            assert [c["token"] for c in fill.json()["masks"][0]] == torch.topk(probs[pos], 3).indices.tolist()
            cls = http.post("/classify", json={"model": "genre", "text": "Exeunt, all but the king."})
            assert cls.status_code == 200 and len(cls.json()["labels"]) == 3
            gen = http.post("/generate", json={"prompt": "To be", "max_new_tokens": 3, "temperature": 0})
            assert gen.status_code == 200 and gen.json()["model"] == tiny_checkpoint.name
            bad = http.post("/fill-mask", json={"model": "nope", "text": "[MASK]"})
            assert bad.status_code == 404 and "genre" in bad.json()["detail"]

"""The translator through the service: /generate (and its stream), /v1/completions and
/attention's three groups, each checked against the model called directly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import REPO_ROOT
from helpers import parse_sse

from attnlens.app.serving.attention_codec import decode
from attnlens.model import load_checkpoint
from attnlens.model.families.encoder_decoder import attention_groups, greedy_translate

TRANSLATOR = REPO_ROOT / "checkpoints" / "translator"
SOURCES = ["ninety-seven", "Wednesday, March 3, 2021", "four hundred and twelve thousand, eight hundred and one",
           "Dec 17, 1905"]


@pytest.fixture(scope="module")
def translator():
    if not (TRANSLATOR / "model.safetensors").is_file():
        pytest.skip("the bundled translator is not in checkpoints/translator")
    return load_checkpoint(TRANSLATOR)


@pytest.fixture(scope="module")
def tclient(translator):
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    with TestClient(create_app(Settings(model=TRANSLATOR, device="cpu"))) as c:
        yield c


def test_generate_translates_the_prompt_like_the_model(tclient, translator):
    want = greedy_translate(translator.model, translator.tokenizer, SOURCES)
    for source, expected in zip(SOURCES, want):
        r = tclient.post("/generate", json={"prompt": source, "max_new_tokens": 40, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["text"] == expected and body["finish_reason"] == "eos"
        assert [t["text"] for t in body["prompt_tokens"]] == translator.tokenizer.display_texts(
            translator.tokenizer.encode(source))
    assert want[0] == "quatre-vingt-dix-sept"


def test_generate_with_attention_has_each_steps_cross_attention_row(tclient, translator):
    cfg = translator.config
    source = SOURCES[1]
    r = tclient.post("/generate", json={"prompt": source, "max_new_tokens": 40, "temperature": 0,
                                        "return_attention": True})
    body = r.json()
    S = len(body["prompt_tokens"])
    tokens = [t["id"] for t in body["tokens"]]
    assert len(body["cross_attention"]) == len(tokens)
    # the reference: one full forward over start + generated tokens
    enc, dec, cross = attention_groups(translator.model, translator.tokenizer.encode(source),
                                       [cfg.decoder_start_id, *tokens[:-1]])
    for t, (rows, self_rows) in enumerate(zip(body["cross_attention"], body["attention"])):
        got = np.asarray(rows)  # (L, H, S)
        assert got.shape == (cfg.n_layers, cfg.n_heads, S)
        np.testing.assert_allclose(got, cross[:, :, t].numpy(), atol=1e-5)
        np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-4)
        assert np.asarray(self_rows).shape == (cfg.n_layers, cfg.n_heads, t + 1)
        np.testing.assert_allclose(np.asarray(self_rows), dec[:, :, t, :t + 1].numpy(), atol=1e-5)


def test_stream_sends_the_translation_with_cross_attention(tclient, translator):
    with tclient.stream("POST", "/generate", json={"prompt": SOURCES[0], "stream": True, "temperature": 0,
                                                   "max_new_tokens": 30, "return_attention": True}) as r:
        events = parse_sse("".join(r.iter_text()))
    tokens = [json.loads(d) for e, d in events if e == "token"]
    done = json.loads([d for e, d in events if e == "done"][0])
    assert "".join(t["delta"] for t in tokens) + done["delta"] == done["text"] == "quatre-vingt-dix-sept"
    S = len(done["prompt_tokens"])
    for t in tokens:
        assert np.asarray(t["cross_attention"]).shape == (translator.config.n_layers, translator.config.n_heads, S)


def test_batched_requests_each_get_their_own_translation(tclient, translator):
    import concurrent.futures as cf

    want = greedy_translate(translator.model, translator.tokenizer, SOURCES)
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda s: tclient.post("/generate", json={"prompt": s, "max_new_tokens": 40,
                                                                      "temperature": 0}).json()["text"],
                            SOURCES * 2))
    assert got == want * 2


def test_v1_completions_serves_the_translator(tclient, translator):
    r = tclient.post("/v1/completions", json={"model": "translator", "prompt": SOURCES[:2], "max_tokens": 40,
                                              "temperature": 0})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == greedy_translate(translator.model, translator.tokenizer, SOURCES[:2])
    bad = tclient.post("/v1/completions", json={"prompt": "one", "max_tokens": 5, "echo": True, "logprobs": 1})
    assert bad.status_code == 400 and "source" in bad.text


def test_limits_of_an_encoder_decoder_are_per_side(tclient, translator):
    ctx = translator.config.context_length
    ok = tclient.post("/generate", json={"prompt": SOURCES[2], "max_new_tokens": ctx, "temperature": 0})
    assert ok.status_code == 200  # source and target each have the whole context
    # the output stops at the context whatever max_new_tokens asks (the default 64 > 48 works)
    default = tclient.post("/generate", json={"prompt": "one", "temperature": 0})
    assert default.status_code == 200 and default.json()["text"] == "un"
    long_source = " ".join(["one"] * (ctx + 1))
    r = tclient.post("/generate", json={"prompt": long_source, "max_new_tokens": 4})
    assert r.status_code == 400 and r.json()["param"] == "prompt" and "48" in r.json()["detail"]
    r = tclient.post("/attention", json={"text": "one", "target_ids": [5] * ctx})
    assert r.status_code == 400 and r.json()["param"] == "target_ids"


@pytest.mark.parametrize("fmt", ["json", "f16"])
def test_attention_returns_three_groups_for_the_greedy_translation(tclient, translator, fmt):
    tok, cfg = translator.tokenizer, translator.config
    source = SOURCES[1]
    r = tclient.post("/attention", json={"text": source, "format": fmt, "packing": "tril"})
    assert r.status_code == 200, r.text
    body = r.json()
    tr = body["translation"]
    src_ids = tok.encode(source)
    assert [t["id"] for t in body["tokens"]] == src_ids and tr["generated"] is True
    target = greedy_translate(translator.model, tok, [source])[0]
    assert [t["id"] for t in tr["target_tokens"]] == [cfg.decoder_start_id, *tok.encode(target)]
    S, T = len(src_ids), len(tr["target_tokens"])
    enc, dec, cross = decode(body), decode(tr["decoder"]), decode(tr["cross"])
    assert enc.shape == (cfg.n_layers, cfg.n_heads, S, S) and body.get("packing") in (None, "full")
    assert dec.shape == (cfg.n_layers, cfg.n_heads, T, T) and cross.shape == (cfg.n_layers, cfg.n_heads, T, S)
    if fmt == "f16":
        assert tr["decoder"]["packing"] == "tril" and tr["cross"]["packing"] == "full"
    want = attention_groups(translator.model, src_ids, [t["id"] for t in tr["target_tokens"]])
    atol = 1e-5 if fmt == "json" else 1e-3
    for got, ref in zip((enc, dec, cross), want):
        np.testing.assert_allclose(got, ref.numpy(), atol=atol)
    np.testing.assert_allclose(cross.sum(-1), 1.0, atol=3e-3)
    assert np.all(np.triu(dec, k=1) == 0)


def test_attention_with_a_given_target_and_selected_heads(tclient, translator):
    tok = translator.tokenizer
    r = tclient.post("/attention", json={"text": "ninety-seven", "target": "quatre-vingt-dix-huit",
                                         "layers": [2], "heads": [1, 3]})
    tr = r.json()["translation"]
    assert tr["generated"] is False
    assert [t["id"] for t in tr["target_tokens"]][1:] == tok.encode("quatre-vingt-dix-huit")
    assert np.asarray(tr["cross"]["attention"]).shape == (1, 2, len(tr["target_tokens"]),
                                                         len(tok.encode("ninety-seven")))
    both = tclient.post("/attention", json={"text": "one", "target": "un", "target_ids": [5]})
    assert both.status_code == 422 or both.status_code == 400
    bad = tclient.post("/attention", json={"text": "one", "target_ids": [10**6]})
    assert bad.status_code in (400, 422) and "target_ids" in bad.text


def test_a_decoder_takes_no_target(client):
    r = client.post("/attention", json={"text": "To be", "target": "x"})
    assert r.status_code in (400, 422) and "target" in r.text


def test_translation_through_the_live_server_equals_the_model(translator, tmp_path):
    import httpx
    from live_server import live_server

    want = greedy_translate(translator.model, translator.tokenizer, SOURCES)
    with live_server(TRANSLATOR, tmp_path) as srv:
        got = [httpx.post(f"{srv.base_url}/generate", timeout=60,
                          json={"prompt": s, "temperature": 0, "max_new_tokens": 40}).json()["text"] for s in SOURCES]
        v1 = httpx.post(f"{srv.base_url}/v1/completions", timeout=60,
                        json={"model": "translator", "prompt": SOURCES, "temperature": 0, "max_tokens": 40}).json()
    assert got == want
    assert [c["text"] for c in v1["choices"]] == want


def test_served_beside_a_decoder_and_listed_as_an_encoder_decoder(translator, tiny_checkpoint):
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    settings = Settings(model=tiny_checkpoint, models=[tiny_checkpoint, TRANSLATOR], device="cpu")
    with TestClient(create_app(settings)) as c:
        models = {m["name"]: m for m in c.get("/models").json()["models"]}
        tr = models["translator"]
        assert tr["family"] == "encoder-decoder" and tr["attention"] == "encoder-decoder"
        assert set(tr["tasks"]) == {"generate", "completions", "attention"}
        assert "translator" in [m["id"] for m in c.get("/v1/models").json()["data"]]
        r = c.post("/generate", json={"model": "translator", "prompt": "ninety-seven", "temperature": 0})
        assert r.json()["text"] == "quatre-vingt-dix-sept" and r.json()["model"] == "translator"
        d = c.post("/generate", json={"prompt": "To be", "max_new_tokens": 3, "temperature": 0})
        assert d.status_code == 200 and d.json()["model"] != "translator"
        a = c.post("/attention", json={"model": "translator", "text": "ninety-seven"}).json()
        assert a["family"] == "encoder-decoder" and a["direction"] == "encoder-decoder"
        assert "".join(t["text"] for t in a["translation"]["target_tokens"][1:]) == "quatre-vingt-dix-sept"
        bad = c.post("/fill-mask", json={"model": "translator", "text": "a [MASK]"})
        assert bad.status_code == 400 and "generate" in bad.text

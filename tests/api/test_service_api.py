"""The native HTTP API in-process (TestClient runs the lifespan): /generate, /attention,
operations, and every bad-input case. The tiny random model makes the text gibberish,
so correctness is checked against model.decoding.generate_tokens / the model itself."""

from __future__ import annotations

import gc
import json
import math
import os

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from helpers import MAX_NEW, MAX_PROMPT, make_tiny_checkpoint, parse_sse
from helpers import reference_tokens as reference

from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.app.serving.attention_codec import decode
from attnlens.model import SamplingParams, generate_tokens, load_checkpoint


# --- operations ----------------------------------------------------------------
def test_health_ready_and_model(client, ckpt):
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True
    info = client.get("/model").json()
    assert info["architecture"]["n_layers"] == 2 and info["architecture"]["n_heads"] == 4
    assert info["parameters"] == ckpt.model.num_parameters()
    assert info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["context_length"] == 64 and info["vocab_size"] == ckpt.config.vocab_size
    assert info["limits"]["max_new_tokens"] == MAX_NEW


def test_what_is_loaded_is_frozen_out_of_full_collections_while_serving(tiny_checkpoint):
    """Full collections would walk every loaded object (~80 ms with the bundled models, every other
    /lens answer): startup freezes them, shutdown hands them back to the collector."""
    before = gc.get_freeze_count()  # another test's app may be serving (and have frozen its own)
    with TestClient(create_app(Settings(model=tiny_checkpoint, engine_process=False, warmup=False))) as c:
        assert c.get("/readyz").status_code == 200
        assert gc.get_freeze_count() > before
        model = c.app.state.attnlens.registry.get(None).checkpoint.model
        assert not any(o is model._modules for o in gc.get_objects())  # frozen: no collection walks it
    assert gc.get_freeze_count() == 0


def test_root_serves_index_html_and_static_files(tiny_checkpoint, tmp_path):
    (tmp_path / "index.html").write_text("<!doctype html><title>attnlens</title>")
    (tmp_path / "app.js").write_text("console.log(1)")
    c = TestClient(create_app(Settings(model=tiny_checkpoint, static_dir=tmp_path)))  # no model needed
    r = c.get("/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"] and "attnlens" in r.text
    assert c.get("/static/app.js").text == "console.log(1)"


def test_root_without_index_html_is_a_clear_404(tiny_checkpoint, tmp_path):
    c = TestClient(create_app(Settings(model=tiny_checkpoint, static_dir=tmp_path)))
    r = c.get("/")
    assert r.status_code == 404 and "index.html" in r.json()["detail"]
    c = TestClient(create_app(Settings(model=tiny_checkpoint, static_dir=tmp_path / "absent")))
    assert c.get("/").status_code == 404 and c.get("/static/x.js").status_code == 404


def test_cors_headers_for_allowed_origin(client):
    r = client.options("/generate", headers={"Origin": "http://viewer.example", "Access-Control-Request-Method": "POST"})
    assert r.headers.get("access-control-allow-origin") == "http://viewer.example"
    r = client.get("/healthz", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_metrics_count_requests_and_tokens(client):
    client.post("/generate", json={"prompt": "To be", "max_new_tokens": 3, "temperature": 0})
    client.post("/generate", json={"prompt": ""})
    text = client.get("/metrics").text
    assert 'attnlens_http_requests_total{method="POST",model="tiny",route="/generate",status="200"}' in text
    assert 'attnlens_http_requests_total{method="POST",model="tiny",route="/generate",status="422"}' in text
    assert 'attnlens_http_request_duration_seconds_bucket{le="0.005",model="tiny",route="/generate"}' in text
    assert 'attnlens_time_to_first_token_seconds_count{model="tiny"}' in text
    generated = [ln for ln in text.splitlines() if ln.startswith('attnlens_generated_tokens_total{model="tiny"} ')]
    assert generated and float(generated[0].split()[1]) >= 3
    assert 'attnlens_requests_in_flight{model="tiny"} 0.0' in text and 'attnlens_queue_depth{model="tiny"} 0.0' in text


def test_two_apps_in_one_process_have_their_own_metrics(tiny_checkpoint):
    a = create_app(Settings(model=tiny_checkpoint, device="cpu", warmup=False))
    b = create_app(Settings(model=tiny_checkpoint, device="cpu", warmup=False))
    assert a.state.attnlens.metrics.registry is not b.state.attnlens.metrics.registry


# --- /generate -----------------------------------------------------------------
def test_generate_response_shape_and_reference_tokens(client, ckpt):
    body = {"prompt": "To be, or not", "max_new_tokens": 12, "temperature": 0.9, "top_k": 50, "seed": 7,
            "logprobs": 3}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    ref = reference(ckpt, body["prompt"], 12, n_logprobs=3, temperature=0.9, top_k=50, seed=7)
    tok = ckpt.tokenizer
    assert [t["id"] for t in d["tokens"]] == [t.id for t in ref]
    assert d["text"] == tok.decode([t.id for t in ref])
    assert d["model"] == "tiny" and d["id"]
    assert d["prompt_tokens"] == [{"id": i, "text": tok.display_text(i)} for i in tok.encode(body["prompt"])]
    for got, want in zip(d["tokens"], ref):
        assert got["text"] == tok.display_text(want.id)
        assert got["logprob"] == pytest.approx(want.logprob, abs=1e-5)
        assert [a["id"] for a in got["top_logprobs"]] == want.top_ids
        assert [a["text"] for a in got["top_logprobs"]] == [tok.display_text(i) for i in want.top_ids]
    assert d["finish_reason"] in ("length", "eos")
    u = d["usage"]
    assert u["prompt_tokens"] == len(d["prompt_tokens"]) and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    if d["finish_reason"] == "length":
        assert u["completion_tokens"] == 12 == len(d["tokens"])
    t = d["timings"]
    assert all(t[k] >= 0 for k in ("queue_ms", "prefill_ms", "decode_ms")) and t["tokens_per_second"] > 0
    assert d["attention"] is None


def test_same_seed_same_text_and_stream_agrees(client):
    body = {"prompt": "Whether 'tis nobler", "max_new_tokens": 20, "temperature": 1.0, "seed": 1234}
    a = client.post("/generate", json=body).json()
    b = client.post("/generate", json=body).json()
    assert a["text"] == b["text"] and a["tokens"] == b["tokens"]
    c = client.post("/generate", json={**body, "seed": 99}).json()
    assert c["tokens"] != a["tokens"]

    r = client.post("/generate", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    kinds = [e for e, _ in events]
    assert kinds[-1] == "done" and set(kinds[:-1]) <= {"token"}
    tokens = [json.loads(d) for e, d in events if e == "token"]
    done = json.loads(events[-1][1])
    assert [t["id"] for t in tokens] == [t["id"] for t in a["tokens"]]
    assert "".join(t["delta"] for t in tokens) + done["delta"] == a["text"] == done["text"]
    assert done["finish_reason"] == a["finish_reason"] and done["usage"] == a["usage"]
    assert set(done["timings"]) >= {"queue_ms", "prefill_ms", "decode_ms", "tokens_per_second"}
    # the prompt's tokens come with the stream too, exactly as in the JSON answer
    assert done["prompt_tokens"] == a["prompt_tokens"]
    assert set(done) == {"id", "finish_reason", "prompt_tokens", "text", "delta", "usage", "timings"}
    # top_logprobs is a list as documented (empty without logprobs), as in the JSON answer
    assert all(t["top_logprobs"] == [] for t in tokens)


def test_greedy_matches_reference(client, ckpt):
    d = client.post("/generate", json={"prompt": "The slings", "max_new_tokens": 16, "temperature": 0}).json()
    assert [t["id"] for t in d["tokens"]] == [t.id for t in reference(ckpt, "The slings", 16, temperature=0.0)]


def test_return_attention_rows(client, ckpt):
    prompt = "To be, or"
    d = client.post("/generate", json={"prompt": prompt, "max_new_tokens": 5, "temperature": 0,
                                       "return_attention": True}).json()
    ref = reference(ckpt, prompt, 5, return_attention=True, temperature=0.0)
    n_prompt = len(ckpt.tokenizer.encode(prompt))
    att = d["attention"]
    assert len(att) == len(d["tokens"]) == len(ref)
    for i, (per_token, want) in enumerate(zip(att, ref)):
        assert len(per_token) == 2 and all(len(layer) == 4 for layer in per_token)
        for layer, want_layer in zip(per_token, want.attention):
            a = np.asarray(layer)
            assert a.shape == (4, n_prompt + i)  # the row of the position that produced token i
            assert np.allclose(a.sum(-1), 1, atol=1e-4)
            assert np.allclose(a, want_layer.numpy(), atol=1e-5)


def test_stream_with_attention_and_logprobs(client):
    r = client.post("/generate", json={"prompt": "To be", "max_new_tokens": 4, "temperature": 0, "stream": True,
                                       "return_attention": True, "logprobs": 2})
    tokens = [json.loads(d) for e, d in parse_sse(r.text) if e == "token"]
    assert len(tokens) >= 1
    for i, t in enumerate(tokens):
        assert len(t["attention"]) == 2 and len(t["attention"][0]) == 4
        assert len(t["attention"][0][0]) == 2 + i  # "To be" is 2 tokens
        assert len(t["top_logprobs"]) == 2


def _greedy_text(client, prompt, n=30):
    return client.post("/generate", json={"prompt": prompt, "max_new_tokens": n, "temperature": 0}).json()


def test_stop_string_cuts_text_and_streams_nothing_past_it(client, ckpt):
    prompt = "Or to take arms"
    full = _greedy_text(client, prompt)
    tokens = full["tokens"]
    assert len(tokens) >= 6, "need a few tokens to pick a stop string from"
    text = full["text"]
    # a stop string spanning the boundary between tokens 3 and 4 (by bytes)
    tok = ckpt.tokenizer
    start = len(tok.decode([t["id"] for t in tokens[:3]]))
    stop = text[start - 1 : start + 2]
    if not stop.strip() or "\ufffd" in stop:
        pytest.skip("the random model's greedy text has no clean stop string")
    cut = text.index(stop)
    d = client.post("/generate", json={"prompt": prompt, "max_new_tokens": 30, "temperature": 0,
                                       "stop": ["zzzz-never", stop]}).json()
    assert d["finish_reason"] == "stop"
    assert d["text"] == text[:cut] and stop not in d["text"]
    r = client.post("/generate", json={"prompt": prompt, "max_new_tokens": 30, "temperature": 0,
                                       "stop": [stop], "stream": True})
    events = parse_sse(r.text)
    streamed = "".join(json.loads(d)["delta"] for e, d in events if e == "token")
    assert streamed == text[:cut]
    assert json.loads(events[-1][1])["finish_reason"] == "stop"


def test_stop_string_as_plain_string(client):
    full = _greedy_text(client, "No more")
    ch = next((c for c in full["text"][2:] if c.strip() and c != "\ufffd"), None)
    if ch is None:
        pytest.skip("no usable character in the greedy text")
    d = client.post("/generate", json={"prompt": "No more", "max_new_tokens": 30, "temperature": 0,
                                       "stop": ch}).json()
    assert d["finish_reason"] == "stop" and d["text"] == full["text"][: full["text"].index(ch)]


# --- EOS ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eos_checkpoint(tmp_path_factory):
    """A model whose next token is EOS with probability about 1/2 at every step."""
    from attnlens.model import save_checkpoint

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("eos") / "eos", tie_embeddings=False, seed=3)
    ck = load_checkpoint(path)
    with torch.no_grad():
        ck.model.ln_f.weight.zero_()
        ck.model.ln_f.bias.fill_(1.0)  # every position's final hidden state is all ones
        ck.model.lm_head.weight.normal_(0, 0.01)
        n = ck.config.d_model
        ck.model.lm_head.weight[ck.tokenizer.eos_id].fill_(math.log(ck.config.vocab_size) / n)
    save_checkpoint(path, ck.model, ck.tokenizer)
    return path


def test_eos_ends_generation(eos_checkpoint):
    ck = load_checkpoint(eos_checkpoint)
    eos = ck.tokenizer.eos_id
    with TestClient(create_app(Settings(model=eos_checkpoint, device="cpu"))) as c:
        seen_eos = False
        for seed in range(20):
            ref = [t.id for t in generate_tokens(ck.model, ck.tokenizer.encode("To be"), 30,
                                                 SamplingParams(temperature=1.0, seed=seed))]
            d = c.post("/generate", json={"prompt": "To be", "max_new_tokens": 30, "temperature": 1.0,
                                          "seed": seed}).json()
            if eos in ref:
                k = ref.index(eos)
                assert d["finish_reason"] == "eos"
                assert [t["id"] for t in d["tokens"]] == ref[:k]
                assert d["usage"]["completion_tokens"] == k + 1  # the EOS was generated too
                assert "<|endoftext|>" not in d["text"]
                seen_eos = seen_eos or k > 0
            else:
                assert d["finish_reason"] == "length"
        assert seen_eos


# --- bad input ------------------------------------------------------------------
@pytest.mark.parametrize("patch,field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": MAX_NEW + 1}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": "abc"}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stream": "maybe"}, "stream"),
    ({"tempreature": 0.5}, "tempreature"),
])
def test_generate_invalid_field_is_422_naming_it(client, patch, field):
    r = client.post("/generate", json={"prompt": "To be", **patch})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(field in e["loc"] for e in detail), detail
    assert all(e["msg"] for e in detail)


def test_generate_takes_token_ids_as_its_prompt(client, ckpt):
    """`ids` continue as they are: the same answer as the text they tokenise to, streamed or not;
    one of prompt, ids or messages; ids outside the vocabulary, or too many, are named."""
    ids = ckpt.tokenizer.encode("To be, or not")
    by_text = client.post("/generate", json={"prompt": "To be, or not", "max_new_tokens": 5, "temperature": 0}).json()
    by_ids = client.post("/generate", json={"ids": ids, "max_new_tokens": 5, "temperature": 0}).json()
    assert by_ids["tokens"] == by_text["tokens"] and by_ids["text"] == by_text["text"]
    assert [t["id"] for t in by_ids["prompt_tokens"]] == ids
    streamed = client.post("/generate", json={"ids": ids, "max_new_tokens": 5, "temperature": 0, "stream": True})
    assert streamed.status_code == 200 and by_ids["text"] in "".join(
        json.loads(d).get("text", "") for e, d in parse_sse(streamed.text) if e == "done")
    both = client.post("/generate", json={"prompt": "x", "ids": ids, "max_new_tokens": 2})
    assert both.status_code == 422 and both.json()["param"] == "ids"
    assert "not both prompt and ids" in both.json()["detail"][0]["msg"]
    bad = client.post("/generate", json={"ids": [1, ckpt.tokenizer.vocab_size], "max_new_tokens": 2})
    assert bad.status_code == 422 and bad.json()["param"] == "ids" and "position 1" in bad.json()["detail"][0]["msg"]
    empty = client.post("/generate", json={"ids": []})
    assert empty.status_code == 422
    limit = client.app.state.attnlens.settings.max_prompt_tokens
    long = client.post("/generate", json={"ids": [1] * (limit + 1), "max_new_tokens": 2})
    assert long.status_code == 400 and long.json()["param"] == "ids" and long.json()["code"] == "prompt_too_long"


def test_generate_body_that_is_not_json(client):
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = client.post("/generate", json=["a list"])
    assert r.status_code == 422


def test_prompt_over_max_prompt_tokens(client, ckpt):
    prompt = "To be, or not to be " * 10
    n = len(ckpt.tokenizer.encode(prompt))
    assert n > MAX_PROMPT
    r = client.post("/generate", json={"prompt": prompt, "max_new_tokens": 1})
    assert r.status_code == 400
    msg = r.json()["detail"]
    assert f"{n} tokens" in msg and str(MAX_PROMPT) in msg
    assert r.json()["param"] == "prompt" and r.json()["code"] == "prompt_too_long"


def test_prompt_plus_new_tokens_over_context(client, ckpt):
    prompt = "To be, or not to be, that is"
    n = len(ckpt.tokenizer.encode(prompt))
    r = client.post("/generate", json={"prompt": prompt, "max_new_tokens": 64 - n + 1})
    assert r.status_code == 400
    msg = r.json()["detail"]
    assert f"({n} tokens)" in msg and f"({64 - n + 1})" in msg and "65" in msg and "64" in msg
    assert r.json()["code"] == "context_length_exceeded"
    ok = client.post("/generate", json={"prompt": prompt, "max_new_tokens": 64 - n, "temperature": 0})
    assert ok.status_code == 200


def test_body_over_limit_is_413(client):
    big = json.dumps({"prompt": "a" * 1_100_000}).encode()
    r = client.post("/generate", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "1000000" in r.json()["detail"]

    def chunks():  # no Content-Length: the counted bytes must trip the limit
        yield b'{"prompt": "'
        for _ in range(11):
            yield b"a" * 100_000
        yield b'"}'

    r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.post("/generate", json={"prompt": "To be", "max_new_tokens": 1}).status_code == 200


def test_openapi_documents_stream_events_and_attention_ids(client):
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    done = schemas["StreamDone"]["properties"]
    assert done["prompt_tokens"]["items"] == {"$ref": "#/components/schemas/TokenText"}
    assert "prompt_tokens" in schemas["StreamDone"]["required"]
    assert {"index", "delta", "attention"} <= set(schemas["StreamToken"]["properties"])
    stream = spec["paths"]["/generate"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    # one event each: its name, and its data's JSON schema
    events = {e["properties"]["event"]["const"]: e["properties"]["data"]["contentSchema"] for e in stream["oneOf"]}
    assert events["done"] == {"$ref": "#/components/schemas/StreamDone"}
    assert events["token"] == {"$ref": "#/components/schemas/StreamToken"}
    assert {"text", "ids"} <= set(schemas["AttentionRequest"]["properties"])
    assert not set(schemas["AttentionRequest"].get("required", [])) & {"text", "ids"}


# --- /attention -------------------------------------------------------------------
def model_attention(ckpt, text):
    return model_attention_ids(ckpt, ckpt.tokenizer.encode(text))


def model_attention_ids(ckpt, ids):
    ids = torch.tensor([ids])
    with torch.no_grad():
        _, att = ckpt.model(ids, return_attention=True)
    return np.stack([a[0].numpy() for a in att])  # (L, H, T, T)


def test_attention_json(client, ckpt):
    text = "To be, or not to be"
    d = client.post("/attention", json={"text": text}).json()
    want = model_attention(ckpt, text)
    T = want.shape[-1]
    assert d["n_layers"] == 2 and d["n_heads"] == 4 and d["layers"] == [0, 1] and d["heads"] == [0, 1, 2, 3]
    assert d["shape"] == [2, 4, T, T] and len(d["tokens"]) == T
    assert d["tokens"][0] == {"id": ckpt.tokenizer.encode(text)[0], "text": "To"}
    a = np.asarray(d["attention"])
    assert a.shape == (2, 4, T, T)
    assert np.allclose(a.sum(-1), 1, atol=1e-4)
    assert np.all(np.triu(a, 1) == 0)
    assert np.allclose(a, want, atol=1e-5)


def test_attention_selected_layers_and_heads(client, ckpt):
    text = "The slings and arrows"
    d = client.post("/attention", json={"text": text, "layers": [1], "heads": [3, 0]}).json()
    want = model_attention(ckpt, text)
    assert d["layers"] == [1] and d["heads"] == [3, 0]
    assert np.allclose(np.asarray(d["attention"]), want[[1]][:, [3, 0]], atol=1e-5)


@pytest.mark.parametrize("fmt,packing,tol", [("f16", "full", 1e-3), ("u8", "full", 0.5 / 255 + 1e-6),
                                             ("u8", "tril", 0.5 / 255 + 1e-6), ("f16", "tril", 1e-3)])
def test_attention_packed_formats(client, ckpt, fmt, packing, tol):
    text = "Whether 'tis nobler in the mind"
    d = client.post("/attention", json={"text": text, "format": fmt, "packing": packing}).json()
    assert d["format"] == fmt and d.get("attention") is None and d["data"]
    a = decode(d)
    assert np.abs(a - model_attention(ckpt, text)).max() <= tol
    T = d["shape"][-1]
    cells = 2 * 4 * T * T if packing == "full" else 2 * 4 * T * (T + 1) // 2
    assert len(d["data"]) == 4 * math.ceil(cells * (2 if fmt == "f16" else 1) / 3)  # base64 of the raw bytes
    if fmt == "u8":
        assert d["scale"] == pytest.approx(1 / 255)


@pytest.mark.parametrize("body,field", [
    ({"text": "To be", "layers": [2]}, "layers"),
    ({"text": "To be", "layers": [-1]}, "layers"),
    ({"text": "To be", "heads": [4]}, "heads"),
    ({"text": "To be", "heads": [0, 0]}, "heads"),
    ({"text": "To be", "layers": []}, "layers"),
    ({"text": ""}, "text"),
    ({"text": "To be", "format": "png"}, "format"),
])
def test_attention_bad_input_is_422(client, body, field):
    r = client.post("/attention", json=body)
    assert r.status_code == 422
    assert any(field in e["loc"] for e in r.json()["detail"])
    if field in ("layers", "heads") and body.get(field) and body[field][0] != 0:
        assert "out of range" in r.text


def test_attention_text_longer_than_context(client, ckpt):
    text = "To be, or not to be, that is the question. " * 6
    n = len(ckpt.tokenizer.encode(text))
    assert n > 64
    r = client.post("/attention", json={"text": text})
    assert r.status_code == 400
    assert f"{n} tokens" in r.json()["detail"] and "64" in r.json()["detail"]
    assert r.json()["param"] == "text" and r.json()["code"] == "context_length_exceeded"


def partial_utf8_ids(tok) -> list[int]:
    """Token ids whose bytes end in the middle of a UTF-8 character (as a generation can):
    the tiny tokenizer spells 東 as three one-byte tokens, so stop after the first."""
    ids = tok.encode("Café 東京")
    for n in range(1, len(ids)):
        try:
            tok.decode_bytes(ids[:n]).decode("utf-8")
        except UnicodeDecodeError:
            return ids[:n]
    raise AssertionError("no token boundary inside a character")


def test_attention_from_ids_keeps_the_exact_tokens(client, ckpt):
    tok = ckpt.tokenizer
    ids = partial_utf8_ids(tok)
    text = tok.decode(ids)
    assert "\ufffd" in text and tok.encode(text) != ids  # re-tokenising the text would change them
    d = client.post("/attention", json={"ids": ids}).json()
    assert [t["id"] for t in d["tokens"]] == ids
    assert [t["text"] for t in d["tokens"]] == [tok.display_text(i) for i in ids]
    T = len(ids)
    assert d["shape"] == [2, 4, T, T]
    assert np.allclose(np.asarray(d["attention"]), model_attention_ids(ckpt, ids), atol=1e-5)
    packed = client.post("/attention", json={"ids": ids, "format": "u8", "packing": "tril", "layers": [1],
                                             "heads": [2]}).json()
    assert np.abs(decode(packed) - model_attention_ids(ckpt, ids)[[1]][:, [2]]).max() <= 0.5 / 255 + 1e-6


def test_attention_of_prompt_plus_generation_by_ids(client, ckpt):
    """The page's flow: prompt_tokens ids + generated ids give the sequence the model saw."""
    body = {"prompt": "Café", "max_new_tokens": 12, "temperature": 1.0, "seed": 7, "return_attention": True}
    g = client.post("/generate", json=body).json()
    assert len(g["tokens"]) >= 3
    ids = [t["id"] for t in g["prompt_tokens"]] + [t["id"] for t in g["tokens"]]
    d = client.post("/attention", json={"ids": ids}).json()
    assert [t["id"] for t in d["tokens"]] == ids
    a = np.asarray(d["attention"])
    P = len(g["prompt_tokens"])
    for i, rows in enumerate(g["attention"]):  # generated token i came from position P + i - 1
        assert np.allclose(np.asarray(rows), a[:, :, P + i - 1, : P + i], atol=1e-4)


@pytest.mark.parametrize("body,field,words", [
    ({}, "text", ["text", "ids"]),
    ({"layers": [0]}, "text", ["text", "ids"]),
    ({"text": "To be", "ids": [1, 2]}, "ids", ["not both"]),
    ({"ids": []}, "ids", []),
    ({"ids": ["x"]}, "ids", []),
    ({"ids": [5, -1]}, "ids", ["-1", "position 1", "vocabulary"]),
    ({"ids": [5, 300]}, "ids", ["300", "position 1", "vocabulary", "0..299"]),
    ({"ids": [5, 10**12]}, "ids", [str(10**12), "vocabulary"]),
])
def test_attention_ids_or_text_bad_input_is_422(client, ckpt, body, field, words):
    assert ckpt.tokenizer.vocab_size == 300
    r = client.post("/attention", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(field in e["loc"] for e in detail), detail
    for w in words:
        assert w in r.text, (w, r.text)


def test_attention_ids_longer_than_context(client, ckpt):
    ids = ckpt.tokenizer.encode("To be, or not to be, that is the question. " * 6)[:65]
    assert len(ids) == 65
    r = client.post("/attention", json={"ids": ids})
    assert r.status_code == 400
    body = r.json()
    assert "65 tokens" in body["detail"] and "64" in body["detail"]
    assert body["param"] == "ids" and body["code"] == "context_length_exceeded"
    assert client.post("/attention", json={"ids": ids[:64], "format": "u8"}).status_code == 200


# --- start-up --------------------------------------------------------------------
def test_missing_checkpoint_fails_startup_clearly(tmp_path):
    app = create_app(Settings(model=tmp_path / "nowhere", device="cpu"))
    with pytest.raises(RuntimeError, match="cannot load the model from .*nowhere"):
        with TestClient(app):
            pass


def test_readyz_503_before_start(tiny_checkpoint):
    app = create_app(Settings(model=tiny_checkpoint, device="cpu"))
    c = TestClient(app)  # no `with`: the lifespan has not run, nothing is loaded
    r = c.get("/readyz")
    assert r.status_code == 503 and r.json()["ready"] is False
    assert c.get("/healthz").status_code == 200
    r = c.post("/generate", json={"prompt": "To be"})
    assert r.status_code == 503 and "not ready" in r.json()["detail"]


def test_model_reports_the_training_summary(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "reported")
    report = {"steps": 1200, "val_bits_per_byte": 1.87, "final_val_loss": 1.3, "hardware": "1x H100",
              "curve": [[0, 5.6], [100, 3.2]]}
    (path / "train_report.json").write_text(json.dumps(report))
    with TestClient(create_app(Settings(model=path, device="cpu", warmup=False))) as c:
        training = c.get("/model").json()["training"]
    assert training["steps"] == 1200 and training["val_bits_per_byte"] == 1.87
    assert training["hardware"] == "1x H100" and "curve" not in training  # the summary, not the blobs


@pytest.mark.parametrize("preset,expected", [(None, "1"), ("0", "0")])
def test_serve_asks_for_huge_pages_unless_told_otherwise(monkeypatch, preset, expected):
    """`attnlens serve` sets PyTorch's THP_MEM_ALLOC_ENABLE=1 (large CPU tensors on 2 MB pages)
    before the server starts; a value the operator set is left alone."""
    import attnlens.app.server.uvicorn_server as server_module
    from attnlens.app.cli import commands as cli

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", preset or "")  # recorded: whatever serve sets is undone after
    if preset is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    seen = {}
    monkeypatch.setattr(server_module, "serve", lambda *a, **kw: seen.setdefault("env", os.environ.get("THP_MEM_ALLOC_ENABLE")))
    import attnlens.app.engine.prestart as prestart

    monkeypatch.setattr(prestart, "prestart_engine_processes", lambda settings: None)  # no engine processes here
    assert cli.main(["serve", "--port", "1"]) == 0
    assert seen["env"] == expected


@pytest.mark.parametrize("setting,expected_ms", [(None, 5.0), (0.7, 0.7)])
def test_the_gil_switch_interval_follows_the_device_unless_set(tiny_checkpoint, setting, expected_ms):
    """SWITCH_INTERVAL_MS: by default Python's 5 ms when serving on the CPU (0.2 ms on CUDA,
    tested in test_gpu.py); a value set is used as it is."""
    import sys

    before = sys.getswitchinterval()
    try:
        with TestClient(create_app(Settings(model=tiny_checkpoint, device="cpu", warmup=False,
                                            switch_interval_ms=setting))):
            assert sys.getswitchinterval() == pytest.approx(expected_ms / 1000)
    finally:
        sys.setswitchinterval(before)

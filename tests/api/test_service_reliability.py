"""Issue 11's defects, each as its own test, against the service in-process (TestClient runs
the lifespan) on the tiny random model. Live-server checks (slow readers, event-loop
latency, request timeouts) are in test_service_reliability_live.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from helpers import run_async

from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.model import SamplingParams
from attnlens.model.decoding import filter_logits


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    settings = Settings(model=tiny_checkpoint, device="cpu", max_new_tokens=32)
    with TestClient(create_app(settings)) as c:
        yield c


# --- defect 4: a top_p the schema accepts never gives a 500 ------------------------------
@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-9])
def test_filter_logits_tiny_top_p_keeps_the_top_token(top_p):
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    out = filter_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
    probs = torch.softmax(out, dim=-1)
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # only the most likely token is left
    assert (torch.isfinite(out).sum(dim=-1) == 1).all()


@pytest.mark.parametrize("stream", [False, True])
def test_generate_with_tiny_top_p_is_greedy_not_500(client, stream):
    body = {"prompt": "Hello", "max_new_tokens": 4, "temperature": 1.0, "top_p": 1e-300, "stream": stream}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert "event: error" not in r.text
    greedy = client.post("/generate", json={**body, "temperature": 0, "top_p": 1.0, "stream": False}).json()
    if not stream:
        assert [t["id"] for t in r.json()["tokens"]] == [t["id"] for t in greedy["tokens"]]


def test_v1_with_tiny_top_p_is_not_500(client):
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "top_p": 5e-324})
    assert r.status_code == 200, r.text


# --- defect 5: lone surrogates are no text: 422, never a 500 ------------------------------
@pytest.mark.parametrize("path,body", [
    ("/generate", {"prompt": "Hi", "stop": ["\ud800"]}),
    ("/generate", {"prompt": "\ud800"}),
    ("/generate", {"prompt": "Hi", "stop": "\udfff", "stream": True}),
    ("/attention", {"text": "a\ud800b"}),
    ("/v1/completions", {"prompt": "Hi", "stop": "\ud800"}),
    ("/v1/completions", {"prompt": "\ud800"}),
    ("/v1/completions", {"prompt": ["ok", "\udbff"]}),
    ("/generate", {"prompt": "Hi", "\ud800": 1}),  # an unknown field whose name is one
])
def test_lone_surrogates_are_422(client, path, body):
    # json.dumps escapes them as \ud800, as a client would (httpx's json= refuses them)
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    d = r.json()
    param = d["error"]["param"] if path.startswith("/v1") else d["param"]
    assert param.split(".")[0] in body or (param == "body" and "\ud800" in body)


# --- defect 8: strict types --------------------------------------------------------------
@pytest.mark.parametrize("path,body,field", [
    ("/generate", {"prompt": "Hi", "max_new_tokens": "4"}, "max_new_tokens"),
    ("/generate", {"prompt": "Hi", "max_new_tokens": True}, "max_new_tokens"),
    ("/generate", {"prompt": "Hi", "stream": "yes"}, "stream"),
    ("/generate", {"prompt": "Hi", "logprobs": 1.0}, "logprobs"),
    ("/generate", {"prompt": "Hi", "temperature": "0.5"}, "temperature"),
    ("/attention", {"text": "Hi", "layers": ["0"]}, "layers.0"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "Hi", "n": True}, "n"),
])
def test_strict_types(client, path, body, field):
    r = client.post(path, json=body)
    assert r.status_code == 422, r.text
    d = r.json()
    assert (d["error"]["param"] if path.startswith("/v1") else d["param"]) == field


def test_ints_still_count_as_floats(client):
    r = client.post("/generate", json={"prompt": "Hi", "max_new_tokens": 2, "temperature": 1, "top_p": 1})
    assert r.status_code == 200, r.text


# --- defect 8: packing "tril" applies to json too ------------------------------------------
def test_attention_json_tril_is_applied(client):
    from attnlens.app.serving.attention_codec import decode

    full = client.post("/attention", json={"text": "To be, or not", "format": "json"}).json()
    tril = client.post("/attention", json={"text": "To be, or not", "format": "json", "packing": "tril"}).json()
    assert tril["packing"] == "tril"
    T = len(tril["tokens"])
    assert [len(row) for row in tril["attention"][0][0]] == list(range(1, T + 1))
    assert np.array_equal(decode(tril), decode(full))


# --- defect 8: a long prompt is refused by its bytes, before tokenising --------------------
def test_huge_prompt_refused_without_tokenising(client, monkeypatch):
    from attnlens.model.tokenizer import Tokenizer

    def boom(self, text):
        raise AssertionError("tokenised a prompt its byte length already rules out")

    monkeypatch.setattr(Tokenizer, "encode", boom)
    for path, body in [("/generate", {"prompt": "x" * 400_000, "max_new_tokens": 4}),
                       ("/attention", {"text": "x" * 400_000}),
                       ("/v1/completions", {"prompt": ["hi", "x" * 400_000]})]:
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert "bytes" in r.text and "prompt_too_long" in r.text


def test_max_prompt_tokens_default_follows_the_model(client):
    assert client.get("/model").json()["limits"]["max_prompt_tokens"] == 64  # the tiny model's context


# --- defect 8: /model keeps the server's paths private --------------------------------------
def test_model_info_has_no_absolute_path(client, tiny_checkpoint):
    r = client.get("/model")
    assert str(tiny_checkpoint.parent) not in r.text
    assert r.json()["path"] == tiny_checkpoint.name


# --- defect 8: a 500 carries no internal exception text ----------------------------------------
def test_500_body_has_no_exception_text(tiny_checkpoint, monkeypatch):
    import attnlens.app.serving.attention_serving as attention_serving

    def broken(*args, **kwargs):
        raise ValueError("secret /srv/internal/path detail")

    monkeypatch.setattr(attention_serving, "answer_fields", broken)
    with TestClient(create_app(Settings(model=tiny_checkpoint, device="cpu", warmup=False)),
                    raise_server_exceptions=False) as c:
        r = c.post("/attention", json={"text": "Hi"})
    assert r.status_code == 500
    assert "secret" not in r.text and "ValueError" not in r.text and "reference" in r.json()["detail"]


def test_engine_error_text_stays_in_the_log(tiny_checkpoint):
    settings = Settings(model=tiny_checkpoint, device="cpu", warmup=False, engine_process=False)  # the model is wrapped here
    with TestClient(create_app(settings)) as c:
        engine = c.app.state.attnlens.registry.get(None).runner
        real_model = engine.client.core.model

        class Poisoned:  # the real model, except that its forward raises
            def __getattr__(self, name):
                return getattr(real_model, name)

            def __call__(self, *args, **kwargs):
                raise RuntimeError("secret tensor detail")

        engine.client.core.model = Poisoned()
        try:
            plain = c.post("/generate", json={"prompt": "Hi", "max_new_tokens": 2})
            streamed = c.post("/generate", json={"prompt": "Hi", "max_new_tokens": 2, "stream": True})
            v1 = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        finally:
            engine.client.core.model = real_model
    assert plain.status_code == 500 and v1.status_code == 500
    assert "event: error" in streamed.text
    for r in (plain, streamed, v1):
        assert "secret" not in r.text and "Error" not in r.text, r.text


# --- defect 8: no redirect built from the client's Host header -----------------------------
@pytest.mark.parametrize("path", ["/static", "/docs/", "/healthz/"])
def test_no_redirect_to_the_sent_host(tiny_checkpoint, path):
    c = TestClient(create_app(Settings(model=tiny_checkpoint, warmup=False)))
    r = c.get(path, headers={"Host": "evil.example"}, follow_redirects=False)
    assert r.status_code == 404
    assert "evil.example" not in r.headers.get("location", "")


# --- defect 1: the bytes of attention answers in flight are bounded ------------------------
def test_answer_budget_waits_then_429_and_refuses_what_never_fits():
    import asyncio

    from attnlens.app.server.api_errors import ApiError
    from attnlens.app.serving.answer_budget import AnswerBudget

    async def scenario():
        budget = AnswerBudget(100, wait_s=0.3)
        a = await budget.claim(60, what="a")
        with pytest.raises(ApiError) as too_big:
            await budget.claim(101, what="b")
        assert too_big.value.status_code == 400 and too_big.value.code == "answer_too_large"
        with pytest.raises(ApiError) as busy:
            await budget.claim(50, what="c")  # 60 + 50 > 100 for the whole wait
        assert busy.value.status_code == 429 and int(busy.value.headers["Retry-After"]) >= 1
        waiter = asyncio.create_task(budget.claim(50, what="d"))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # waits for room
        await a.release()
        d = await asyncio.wait_for(waiter, 1)
        assert budget.in_use == 50
        await d.release()
        await d.release()  # idempotent
        assert budget.in_use == 0

    run_async(scenario())  # on a thread of its own (the browser tests' Playwright keeps a loop here)


def test_attention_claims_and_releases_its_bytes(client):
    budget = client.app.state.attnlens.answers
    r = client.post("/attention", json={"text": "To be, or not", "format": "json"})
    assert r.status_code == 200 and budget.in_use == 0
    budget.limit = 1000  # smaller than this answer's estimate
    try:
        r = client.post("/attention", json={"text": "To be, or not to be, that is the question", "format": "json"})
    finally:
        budget.limit = 256_000_000
    assert r.status_code == 400 and r.json()["code"] == "answer_too_large"


# --- security: the optional API key --------------------------------------------------------
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint, tmp_path_factory):
    static = tmp_path_factory.mktemp("static")
    (static / "index.html").write_text("<!doctype html><title>attnlens</title>")
    (static / "app.js").write_text("console.log(1)")
    settings = Settings(model=tiny_checkpoint, device="cpu", api_key=KEY, static_dir=static,
                        cors_origins="http://viewer.example")
    with TestClient(create_app(settings)) as c:
        yield c


def test_api_key_guards_every_route_but_probes_and_page_files(keyed):
    for path in ("/healthz", "/readyz", "/", "/static/app.js"):
        assert keyed.get(path).status_code == 200, path
    good = {"Authorization": f"Bearer {KEY}"}
    for method, path, body in [("GET", "/model", None), ("GET", "/metrics", None), ("GET", "/openapi.json", None),
                               ("GET", "/docs", None), ("GET", "/v1/models", None),
                               ("POST", "/generate", {"prompt": "Hi", "max_new_tokens": 1}),
                               ("POST", "/attention", {"text": "Hi"}),
                               ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1})]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = keyed.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.status_code)
            assert r.headers["www-authenticate"] == "Bearer"
            if path.startswith("/v1"):
                assert r.json()["error"]["code"] == "invalid_api_key"
            else:
                assert "ATTNLENS_API_KEY" in r.json()["detail"]
        assert keyed.request(method, path, json=body, headers=good).status_code == 200, path


def test_api_key_with_the_openai_client_and_a_cors_preflight(keyed):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=keyed, max_retries=0)
    assert client.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices[0].finish_reason
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=keyed,
                      max_retries=0).models.list()
    r = keyed.options("/generate", headers={"Origin": "http://viewer.example",
                                            "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and "authorization" in r.headers["access-control-allow-headers"].lower()
    r = keyed.post("/generate", json={"prompt": "Hi"}, headers={"Origin": "http://viewer.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://viewer.example"


def test_api_key_in_the_openapi_description(keyed, client):
    spec = keyed.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert spec["paths"]["/generate"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in spec["paths"]["/healthz"]["get"]
    assert "securitySchemes" not in client.get("/openapi.json").json()["components"]


def test_no_api_key_no_check(client):
    assert client.get("/model").status_code == 200

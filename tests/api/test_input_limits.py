"""Issue 24, defects 2-4 and 7, in-process: bounded stop strings (and `stop` as a string on every
route), /v1 prompt lists counted before tokenising, byte-length checks before tokenising on
/fill-mask, /classify and the translator's `target`, JSON bodies that cannot be read, `"model": ""`,
the bearer scheme in any case, 401 in the OpenAPI description, requests without `model` for a
task only one model can do, and /docs and /redoc from local assets. (That no such request
stalls /healthz, measured against a live server, is in test_service_faults_live.py.)"""

from __future__ import annotations

import json
import re
import threading

import pytest
from encoder_helpers import make_tiny_encoder
from fastapi.testclient import TestClient
from translator_helpers import make_tiny_translator

from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.model.tokenizer import Tokenizer

BIG = 900_000  # bytes of text: under the 1 MB body limit, far over any model's context


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("limits")
    return tiny_checkpoint, make_tiny_encoder(root / "genre"), make_tiny_translator(root / "tr")


@pytest.fixture(scope="module")
def client(models):
    decoder, encoder, translator = models
    settings = Settings(model=decoder, models=[decoder, encoder, translator], device="cpu", max_new_tokens=32)
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture
def no_tokenising(monkeypatch):
    """Any tokenising fails the test: the request must be refused before."""
    def boom(self, *args, **kwargs):
        raise AssertionError("tokenised a text that its size alone rules out")

    monkeypatch.setattr(Tokenizer, "encode", boom)
    monkeypatch.setattr(Tokenizer, "encode_batch", boom)


def err(r) -> dict:
    """The error's fields, native or OpenAI-shaped."""
    d = r.json()
    return d["error"] if "error" in d else {"message": d["detail"], "param": d.get("param"), "code": d.get("code")}


# --- stop strings: at most 4, each at most 256 characters, a string or a list everywhere ------
@pytest.mark.parametrize("path,base", [("/generate", {"prompt": "To be", "max_new_tokens": 2}),
                                       ("/v1/completions", {"prompt": "To be", "max_tokens": 2})])
@pytest.mark.parametrize("stop", [["ab" * 60000] * 4, ["a"] * 5, ["x" * 257], [""], ["a"] * 150000])
def test_stop_strings_are_bounded_on_every_route(client, path, base, stop, no_tokenising):
    r = client.post(path, json={**base, "stop": stop})
    assert r.status_code == 422, r.text
    assert err(r)["param"].startswith("stop"), r.text


def test_stop_may_be_one_string_on_generate_and_the_schema_says_so(client):
    free = client.post("/generate", json={"prompt": "To be", "max_new_tokens": 12, "temperature": 0}).json()
    stop = free["text"][3:5] or free["text"][:1]
    r = client.post("/generate", json={"prompt": "To be", "max_new_tokens": 12, "temperature": 0, "stop": stop})
    assert r.status_code == 200 and r.json()["finish_reason"] == "stop"
    assert r.json()["text"] == free["text"][: free["text"].index(stop)]
    spec = client.get("/openapi.json").json()["components"]["schemas"]
    for model in ("GenerateRequest", "CompletionRequest"):
        kinds = {s.get("type") for s in spec[model]["properties"]["stop"]["anyOf"]}
        assert {"string", "array"} <= kinds, spec[model]["properties"]["stop"]


# --- /v1/completions: a list of prompts is counted before it is tokenised ---------------------
def test_a_huge_prompt_list_is_refused_before_tokenising(client, no_tokenising):
    r = client.post("/v1/completions", json={"prompt": ["a"] * 150000, "max_tokens": 1})
    assert r.status_code == 422 and err(r)["param"] == "prompt" and "at most 2048" in err(r)["message"]
    # fewer than that, but more than the server's places: a 400 saying so, still before tokenising
    r = client.post("/v1/completions", json={"prompt": ["a"] * 97, "max_tokens": 1})
    assert r.status_code == 400 and err(r)["code"] == "too_many_generations" and err(r)["param"] == "prompt"
    assert "97 generations" in err(r)["message"]
    r = client.post("/v1/completions", json={"prompt": [[5] * 100000], "max_tokens": 1})  # ids: counted first
    assert r.status_code == 400 and err(r)["code"] == "prompt_too_long" and err(r)["param"] == "prompt.0"


def test_prompt_lists_are_tokenised_together_off_the_event_loop(client, monkeypatch):
    calls = []
    real = Tokenizer.encode_batch

    def spy(self, texts):
        calls.append((threading.current_thread() is threading.main_thread(), len(texts)))
        return real(self, texts)

    monkeypatch.setattr(Tokenizer, "encode_batch", spy)
    r = client.post("/v1/completions", json={"prompt": ["To be", "or not", "to be"], "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert calls == [(False, 3)]  # one batch, on a worker thread (TestClient's loop runs on another thread)


# --- byte-length checks before tokenising ---------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/classify", {"model": "genre", "text": "a" * BIG}, "text"),
    ("/fill-mask", {"model": "genre", "text": "a" * BIG + " [MASK]"}, "text"),
    ("/attention", {"model": "tr", "ids": [5, 6, 7], "target": "a" * BIG}, "target"),
    ("/attention", {"model": "genre", "text": "a" * BIG}, "text"),
    ("/generate", {"prompt": "a" * BIG, "max_new_tokens": 2}, "prompt"),
])
def test_large_texts_are_refused_by_their_bytes_before_tokenising(client, path, body, param, no_tokenising):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    e = err(r)
    assert e["param"] == param and e["code"] == "prompt_too_long" and "bytes" in e["message"], r.text


def test_texts_that_fit_are_still_served(client):
    assert client.post("/classify", json={"model": "genre", "text": "To be, or not"}).status_code == 200
    assert client.post("/fill-mask", json={"model": "genre", "text": "To be, or [MASK]"}).status_code == 200
    r = client.post("/attention", json={"model": "tr", "text": "ninety-seven", "target": "quatre-vingt"})
    assert r.status_code == 200, r.text


# --- JSON that cannot be read: a 400 that says why, with param and code ------------------------
@pytest.mark.parametrize("raw,code", [
    (b"[" * 100_000 + b"]" * 100_000, "json_too_deep"),
    (b'{"prompt": "caf\xe9"}', "invalid_utf8"),
    (b'{"prompt": "a", "max_new_tokens": ' + b"9" * 5000 + b"}", "number_too_large"),
])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_unreadable_json_is_a_400_with_param_and_code(client, raw, code, path):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    e = err(r)
    assert e["param"] == "body" and e["code"] == code, r.text


# --- "model": "" is no name ------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/generate", {"prompt": "a"}), ("/attention", {"text": "a"}), ("/fill-mask", {"text": "a [MASK]"}),
    ("/classify", {"text": "a"}), ("/v1/completions", {"prompt": "a"}),
])
def test_an_empty_model_name_is_refused_not_the_default(client, path, body):
    r = client.post(path, json={**body, "model": ""})
    assert r.status_code == 422 and err(r)["param"] == "model", r.text


def test_an_empty_model_query_is_not_the_default(client):
    assert client.get("/model", params={"model": ""}).status_code == 404


# --- no `model`: a task only one loaded model can do goes to that model ------------------------
def test_fill_mask_and_classify_without_model_use_the_one_model_that_can(client):
    r = client.post("/fill-mask", json={"text": "To be, or [MASK]"})
    assert r.status_code == 200 and r.json()["model"] == "genre", r.text
    r = client.post("/classify", json={"text": "To be, or not"})
    assert r.status_code == 200 and r.json()["model"] == "genre", r.text
    r = client.post("/generate", json={"prompt": "To be", "max_new_tokens": 2})  # the default still decides
    assert r.json()["model"] != "genre"


# --- the API key: any case of "Bearer"; 401 in the OpenAPI description --------------------------
KEY = "k3y"


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint):
    with TestClient(create_app(Settings(model=tiny_checkpoint, device="cpu", api_key=KEY, warmup=False))) as c:
        yield c


@pytest.mark.parametrize("header,status", [(f"bearer {KEY}", 200), (f"BEARER {KEY}", 200), (f"Bearer  {KEY}", 200),
                                           (f"Basic {KEY}", 401), ("bearer", 401), (f"bearer {KEY}x", 401)])
def test_the_bearer_scheme_is_case_insensitive(keyed, header, status):
    assert keyed.get("/model", headers={"Authorization": header}).status_code == status


def test_native_routes_document_401_when_a_key_is_set(keyed):
    spec = keyed.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    for path, method in [("/generate", "post"), ("/attention", "post"), ("/fill-mask", "post"),
                         ("/classify", "post"), ("/models", "get"), ("/model", "get"), ("/metrics", "get")]:
        assert "401" in spec["paths"][path][method]["responses"], path
    assert spec["paths"]["/generate"]["post"]["responses"]["401"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorBody"}
    assert "ErrorBody" in spec["components"]["schemas"]
    assert "401" not in spec["paths"]["/healthz"]["get"]["responses"]


# --- /docs and /redoc from this server's own assets -------------------------------------------
def test_docs_and_redoc_load_their_assets_from_this_server(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    for page in ("/docs", "/redoc"):
        html = keyed.get(page, headers=auth).text
        urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", html)
        assert urls and not [u for u in urls if "//" in u], (page, urls)  # no CDN, no other host
        for url in urls:
            if url.startswith("/docs-assets/"):
                r = keyed.get(url)  # assets hold no data: no key needed
                assert r.status_code == 200 and len(r.content) > 1000, url
    assert "SwaggerUIBundle" in keyed.get("/docs-assets/swagger-ui-bundle.js").text
    assert keyed.get("/docs").status_code == 401  # the page itself is behind the key, as before


def test_docs_render_with_no_network(tiny_checkpoint, tmp_path):
    """Swagger UI and ReDoc draw the API in a browser that can reach nothing but this server (and
    ask for no script, style sheet or font elsewhere)."""
    from pathlib import Path

    if not Path("/usr/bin/chromium").exists():
        pytest.skip("no /usr/bin/chromium")
    playwright = pytest.importorskip("playwright.sync_api")
    from concurrent.futures import ThreadPoolExecutor

    from live_server import live_server

    with live_server(tiny_checkpoint, tmp_path, env={"ATTNLENS_LOG_LEVEL": "warning"}) as srv:
        def browse() -> None:
            with playwright.sync_playwright() as p:
                browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
                    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync"])
                try:
                    page = browser.new_page()
                    outside = []

                    def only_here(route):
                        if route.request.url.startswith(srv.base_url):
                            return route.continue_()
                        if route.request.resource_type != "image":  # (ReDoc's "by Redocly" logo is one)
                            outside.append(route.request.url)
                        return route.abort()

                    page.route("**/*", only_here)
                    page.goto(srv.base_url + "/docs")
                    page.wait_for_selector("[data-path='/v1/completions']", timeout=30000)  # Swagger UI's operation
                    page.goto(srv.base_url + "/redoc")
                    page.wait_for_selector("[data-section-id='tag/openai']", state="attached", timeout=30000)
                    assert not outside, outside
                finally:
                    browser.close()

        # on a thread of its own: Playwright's sync API refuses a thread where an asyncio loop runs
        with ThreadPoolExecutor(1) as pool:
            pool.submit(browse).result()


def test_openapi_stays_json_serialisable(client):
    json.dumps(client.get("/openapi.json").json())

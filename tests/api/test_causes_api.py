"""POST /patch, POST /logit-attribution and /attention/explain's `key`, through the app on the bundled
decoder: each answer against its operation run directly on the same weights (model/analysis/
operations.py), every 4xx naming its field, a call stopped when its client goes, the client's round
trip (Client and AsyncClient) and attnlens.show of both answers; SmolLM2's IOI pair over HTTP (slow)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
from helpers import REPO_ROOT, assert_json_close, run_async

import attnlens
from attnlens.model.analysis.operations import (
    LogitAttributionCall,
    PatchCall,
    ScoreDecompositionCall,
    run_operation,
)

TEXT = "To be, or not to be, that is the question"
CHANGED = {3: 17, 6: 40}  # position -> a token id put there in the corrupted prompt
ANSWER, FOIL = 5, 7


@pytest.fixture(scope="module")
def default_model():
    from attnlens.model import load_checkpoint

    path = REPO_ROOT / "checkpoints" / "default"
    if not (path / "model.safetensors").is_file():
        pytest.skip("the bundled default model is not in checkpoints/default")
    return load_checkpoint(path)


@pytest.fixture(scope="module")
def prompts(default_model):
    clean = default_model.tokenizer.encode(TEXT)
    corrupted = [CHANGED.get(i, t) for i, t in enumerate(clean)]
    assert corrupted != clean
    return clean, corrupted


def post(client, route: str, **body):
    return client.post(route, json=body)


CASES = [("heads", "exact"), ("heads", "attribution"), ("heads_by_position", "exact"),
         ("heads_by_position", "attribution"), ("residual", "exact"), ("residual", "attribution"),
         ("layers", "exact"), ("layers", "attribution"), ("paths", "exact")]


@pytest.mark.parametrize("component,method", CASES)
def test_patch_answers_the_operation(bundled_client, default_model, prompts, component, method):
    clean, corrupted = prompts
    sender = {"sender": {"layer": 1, "head": 3}} if component == "paths" else {}
    r = post(bundled_client, "/patch", clean=TEXT, corrupted_ids=corrupted, answer_id=ANSWER, foil_id=FOIL,
             component=component, method=method, **sender)
    assert r.status_code == 200, r.text
    a = r.json()
    want = run_operation(default_model.model, PatchCall(clean, corrupted, ANSWER, FOIL, None, component, method,
                                                         (1, 3) if sender else None))
    assert (a["model"], a["component"], a["method"], a["position"]) == ("default", component, method, len(clean) - 1)
    assert a["clean_metric"] == pytest.approx(want.clean_metric, abs=1e-4)
    assert a["corrupted_metric"] == pytest.approx(want.corrupted_metric, abs=1e-4)
    assert_json_close(a["values"], want.values, abs_tol=1e-4)
    assert [t["id"] for t in a["clean_tokens"]] == clean and [t["id"] for t in a["corrupted_tokens"]] == corrupted
    assert a["differing"] == sorted(CHANGED)
    tok = default_model.tokenizer
    assert a["answer"] == {"id": ANSWER, "text": tok.display_text(ANSWER)} and a["foil"]["id"] == FOIL
    assert a["sender"] == ({**sender["sender"], "group": "self"} if sender else None)
    L, H, T = default_model.config.n_layers, default_model.config.n_heads, len(clean)
    shape = {"heads": (L, H), "heads_by_position": (L, T, H), "residual": (L, T)}
    if component in shape:
        assert np.array(a["values"]).shape == shape[component]
    elif component == "layers":
        assert set(a["values"]) == {"attention", "mlp"} and np.array(a["values"]["mlp"]).shape == (L, T)
    else:
        assert set(a["values"]) == {"q", "k", "v"}
        assert all(v is None for v in a["values"]["q"][1]) and None not in a["values"]["k"][2]


def test_patch_reads_the_metric_at_a_position_and_answers_as_text(bundled_client, default_model, prompts):
    clean, corrupted = prompts
    tok = default_model.tokenizer
    answer = tok.display_text(ANSWER)
    a = post(bundled_client, "/patch", clean_ids=clean, corrupted_ids=corrupted, answer=answer, foil_id=FOIL,
             position=7).json()
    want = run_operation(default_model.model, PatchCall(clean, corrupted, ANSWER, FOIL, 7))
    assert a["position"] == 7 and a["answer"]["id"] == ANSWER
    assert_json_close(a["values"], want.values, abs_tol=1e-4)


def test_logit_attribution_answers_the_operation_and_its_parts_sum(bundled_client, default_model):
    a = post(bundled_client, "/logit-attribution", text=TEXT).json()
    ids = default_model.tokenizer.encode(TEXT)
    want = run_operation(default_model.model, LogitAttributionCall(ids))
    top = post(bundled_client, "/logits", text=TEXT, positions="last", top_k=2).json()["positions"][0]["top"]
    assert [a["answer"]["id"], a["foil"]["id"]] == [t["id"] for t in top]  # by default the top two predictions
    assert a["position"] == len(ids) - 1 and [t["id"] for t in a["tokens"]] == ids
    for key in ("logit_difference", "embedding", "other", "answer_logit", "foil_logit"):
        assert a[key] == pytest.approx(want[key], abs=1e-4)
    assert_json_close(a["heads"], want["heads"], abs_tol=1e-4)
    assert_json_close(a["mlps"], want["mlps"], abs_tol=1e-4)
    total = np.sum(a["heads"]) + np.sum(a["mlps"]) + a["embedding"] + a["other"]
    assert total == pytest.approx(a["logit_difference"], abs=1e-4)
    assert sum(a["other_parts"].values()) == pytest.approx(a["other"], abs=1e-6)
    b = post(bundled_client, "/logit-attribution", ids=ids, answer_id=ANSWER, foil=a["answer"]["text"],
             position=4).json()
    want = run_operation(default_model.model, LogitAttributionCall(ids, ANSWER, a["answer"]["id"], 4))
    assert b["position"] == 4 and b["foil"]["id"] == a["answer"]["id"]
    assert b["logit_difference"] == pytest.approx(want["logit_difference"], abs=1e-4)


def test_explain_with_a_key_says_why_and_without_one_is_unchanged(bundled_client, default_model):
    ask = dict(text=TEXT, layer=2, head=5, query=9)
    plain = post(bundled_client, "/attention/explain", **ask).json()
    assert "score_parts" not in plain
    keyed = post(bundled_client, "/attention/explain", **ask, key=4).json()
    parts = keyed.pop("score_parts")
    assert_json_close(keyed, plain, abs_tol=0)
    ids = default_model.tokenizer.encode(TEXT)
    want = run_operation(default_model.model, ScoreDecompositionCall(ids, 2, 5, 9, 4))
    assert parts["key"] == 4 and parts["parts"] == want["parts"] == parts["key_parts"]
    assert parts["score"] == pytest.approx(want["score"], abs=1e-4)
    assert parts["score"] == pytest.approx(plain["scaled"][4], abs=1e-4)  # the step-by-step's own score
    assert parts["probability"] == pytest.approx(plain["pattern_row"][4], abs=1e-5)
    values = [p["value"] for p in parts["top_pairs"]]
    assert len(values) == 20 and values == sorted(values, key=abs, reverse=True)
    assert [(p["query_part"], p["key_part"]) for p in parts["top_pairs"]] == \
        [(p["query"], p["key"]) for p in want["top"]]
    assert sum(parts["query_totals"]) == pytest.approx(parts["score"], abs=1e-4)
    assert sum(parts["key_totals"]) == pytest.approx(parts["score"], abs=1e-4)
    assert sum(values) + parts["rest"] == pytest.approx(parts["score"], abs=1e-6)


# --- bad input: a 4xx naming the field ------------------------------------------------------------
def patch_body(**change) -> dict:
    body = {"clean": TEXT, "corrupted_ids": None, "answer_id": ANSWER, "foil_id": FOIL}
    body.update(change)
    return {k: v for k, v in body.items() if v is not None}


BAD_PATCH = [
    # (change, status, param, words in the message)
    ({"model": "encoder", "clean": "a b", "corrupted": "a c"}, 400, "model", ["decoder", "bidirectional"]),
    ({"model": "translator", "clean": "twenty one", "corrupted": "twenty two", "component": "paths",
      "sender": {"layer": 0, "head": 0}}, 400, "sender", ["needs a group"]),  # more: tests/api/test_causes_translator.py
    ({"corrupted": TEXT + " again"}, 400, "corrupted", ["tokens and clean", "as many tokens"]),
    ({"answer_id": None, "answer": " not to be"}, 400, "answer", ["tokens (", "not one"]),
    ({"foil_id": None, "foil": "question mark"}, 400, "foil", ["tokens", "not one"]),
    ({"answer": " be"}, 422, "answer_id", ["not both"]),
    ({"foil_id": None}, 422, "foil", ["foil_id"]),
    ({"answer_id": 10 ** 6}, 422, "answer_id", ["not in the vocabulary"]),
    ({"position": 99}, 400, "position", ["out of range"]),
    ({"position": -1}, 422, "position", []),
    ({"component": "paths"}, 400, "sender", ["needs a sender"]),
    ({"component": "paths", "sender": {"layer": 4, "head": 0}}, 400, "sender", ["layer 4 out of range"]),
    ({"component": "paths", "sender": {"layer": 0, "head": 8}}, 400, "sender", ["head 8 out of range"]),
    ({"sender": {"layer": 0, "head": 0}}, 400, "sender", ["paths only"]),
    ({"component": "paths", "sender": {"layer": 0, "head": 0, "group": "cross"}}, 400, "sender",
     ["sender group 'cross'", "one attention group, self"]),
    ({"component": "paths", "method": "attribution", "sender": {"layer": 0, "head": 0}}, 400, "method", ["exact"]),
    ({"component": "neurons"}, 422, "component", []),
    ({"clean_ids": [1, 2]}, 422, "clean_ids", ["not both"]),
    ({"clean": None}, 422, "clean", ["clean_ids"]),
    ({"clean": None, "clean_ids": [1, 5000]}, 422, "clean_ids", ["not in the vocabulary"]),
    ({"clean": "x " * 300, "corrupted": "y " * 300}, 400, "clean", ["context length"]),
]


@pytest.mark.parametrize("change,status,param,words", BAD_PATCH)
def test_bad_patch_requests_name_their_field(bundled_client, prompts, change, status, param, words):
    if "corrupted" not in change and "corrupted_ids" not in change:
        change = {"corrupted_ids": prompts[1], **change}
    r = post(bundled_client, "/patch", **patch_body(**change))
    assert r.status_code == status, r.text
    body = r.json()
    if status == 400:
        assert body["param"] == param
        message = body["detail"]
    else:
        assert any(e["loc"][1] == param for e in body["detail"]), body
        message = json.dumps(body["detail"])
    for w in words:
        assert w in message, message


def test_the_prompt_limit_says_what_to_ask_instead(bundled_client, prompts, monkeypatch):
    settings = bundled_client.app.state.attnlens.settings
    monkeypatch.setattr(settings, "max_patch_tokens", 8)
    body = patch_body(corrupted_ids=prompts[1])
    r = post(bundled_client, "/patch", **body, component="heads_by_position")
    assert r.status_code == 400 and r.json()["param"] == "clean"
    assert r.json()["detail"].startswith("heads_by_position over 8 tokens") and "ask for component heads" in \
        r.json()["detail"]
    r = post(bundled_client, "/patch", **body)
    assert r.status_code == 400 and "heads over 8 tokens" in r.json()["detail"] and "shorter prompt" in \
        r.json()["detail"]


def test_an_answer_over_the_budget_is_a_400_saying_what_to_ask(bundled_client, prompts, monkeypatch):
    monkeypatch.setattr(bundled_client.app.state.attnlens.answers, "limit", 2000)
    r = post(bundled_client, "/patch", **patch_body(corrupted_ids=prompts[1]), component="heads_by_position")
    assert r.status_code == 400 and r.json()["code"] == "answer_too_large"
    assert "ask for component heads" in r.json()["detail"]


BAD_ATTRIBUTION = [
    ({"model": "translator", "position": 3}, 400, "position", ["target has"]),
    ({"model": "encoder"}, 400, "model", ["decoder"]),
    ({"answer": " not to"}, 400, "answer", ["tokens (", "not one"]),
    ({"foil": ""}, 422, "foil", []),
    ({"foil_id": -3}, 422, "foil_id", ["not in the vocabulary"]),
    ({"position": 40}, 400, "position", ["out of range"]),
    ({"ids": [1, 2]}, 422, "ids", ["not both"]),
    ({"text": None}, 422, "text", ["ids"]),
]


@pytest.mark.parametrize("change,status,param,words", BAD_ATTRIBUTION)
def test_bad_logit_attribution_requests_name_their_field(bundled_client, change, status, param, words):
    body = {k: v for k, v in {"text": TEXT, **change}.items() if v is not None}
    r = post(bundled_client, "/logit-attribution", **body)
    assert r.status_code == status, r.text
    found = r.json()
    if status == 400:
        assert found["param"] == param
    else:
        assert any(e["loc"][1] == param for e in found["detail"]), found
    for w in words:
        assert w in json.dumps(found), found


@pytest.mark.parametrize("change,model,words", [
    ({"key": 10}, "default", ["key 10 out of range 0..9"]),
    ({"key": 2, "ablate": [{"layer": 0, "head": 1}]}, "default", ["without ablate"]),
    ({"key": 2}, "encoder", ["pre-norm decoder"]),
    ({"key": 2, "group": "decoder"}, "translator", ["key 2 out of range 0..0", "causal"]),
    ({"key": 9, "group": "cross"}, "translator", ["key 9 out of range", "the cross heads' keys are the source's"]),
    ({"key": 0, "group": "encoder", "ablate": [{"layer": 0, "head": 1, "group": "cross"}]}, "translator",
     ["without ablate"]),
])
def test_a_key_the_model_cannot_decompose_is_a_400_naming_key(bundled_client, change, model, words):
    text, query = ("twenty one", 0) if model == "translator" else (TEXT, 9)
    r = post(bundled_client, "/attention/explain", model=model, text=text, layer=1, head=1, query=query, **change)
    assert r.status_code == 400 and r.json()["param"] == "key", r.text
    for w in words:
        assert w in r.json()["detail"]


# --- the client goes: the call stops --------------------------------------------------------------
def in_process(tiny_checkpoint, scenario, **settings):
    """scenario(app, client) against the app on the tiny checkpoint, its engine on a thread here."""
    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    app = create_app(Settings(model=tiny_checkpoint, device="cpu", warmup=False, engine_process=False, **settings))

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
                return await scenario(app, client)

    return run_async(main())


async def post_then_leave(app, path: str, body: dict, started) -> None:
    """POST `body` to the app as a client that goes away once `started()` is true; returns when the
    handler has ended (within 10 s)."""
    payload, sent, gone = json.dumps(body).encode(), asyncio.Event(), asyncio.Event()

    async def receive():
        if not sent.is_set():
            sent.set()
            return {"type": "http.request", "body": payload, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        pass

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
             "client": ("127.0.0.1", 1), "server": ("test", 80), "state": {}, "app": app}
    handler = asyncio.create_task(app(scope, receive, send))
    for _ in range(300):
        if started():
            break
        await asyncio.sleep(0.01)
    assert started(), f"{path}'s call never began"
    gone.set()
    await asyncio.wait_for(handler, 10)


async def stopped(engine, reports: list) -> int:
    """Once the engine counts its cancelled call: the reports made, checked to stay so (none after)."""
    for _ in range(100):
        if engine.client.core.calls_cancelled:
            break
        await asyncio.sleep(0.02)
    n = len(reports)
    await asyncio.sleep(0.2)
    assert engine.client.core.calls_cancelled == 1 and len(reports) == n  # stopped, not run to its end
    return n


def test_a_patch_stops_at_its_next_report_point_when_its_client_goes(tiny_checkpoint, ckpt, monkeypatch):
    """The client goes away mid-call: the engine stops the patch at its next report point (no report
    after it), the handler ends (499) and the engine goes on serving."""
    from attnlens.model.analysis import operations

    real = operations.OPERATIONS[PatchCall.operation]
    reports: list[float] = []

    def slow(model, call, report):
        def slowly():
            time.sleep(0.02)
            reports.append(time.monotonic())
            report()
        return real(model, call, slowly)

    monkeypatch.setitem(operations.OPERATIONS, PatchCall.operation, slow)
    ids = ckpt.tokenizer.encode("To be, or not to be, that is the question: whether 'tis nobler")[:40]
    corrupted = [ids[0], (ids[1] + 1) % ckpt.config.vocab_size, *ids[2:]]
    body = {"clean_ids": ids, "corrupted_ids": corrupted, "answer_id": 3, "foil_id": 4,
            "component": "heads_by_position"}

    async def scenario(app, client):
        engine = app.state.attnlens.registry.get(None).runner
        await post_then_leave(app, "/patch", body, lambda: len(reports) >= 5)
        n = await stopped(engine, reports)
        assert n < 2 * 40 * 2  # a report per block of each position's batch, had it run through
        metrics = app.state.attnlens.metrics.render().decode()
        assert 'route="/patch",status="499"} 1.0' in metrics
        monkeypatch.setitem(operations.OPERATIONS, PatchCall.operation, real)
        r = await client.post("/patch", json={"clean_ids": ids[:8], "corrupted_ids": corrupted[:8], "answer_id": 3,
                                              "foil_id": 4})
        assert r.status_code == 200  # the engine goes on serving

    in_process(tiny_checkpoint, scenario)


@pytest.mark.parametrize("path,operation,extra", [
    ("/logits", "logits", {}), ("/lens", "lens", {}), ("/heads", "head_scores", {}),
    ("/attention/explain", "explain_head", {"layer": 1, "head": 1, "query": 5}),
])
def test_every_model_call_stops_when_its_client_goes(tiny_checkpoint, ckpt, monkeypatch, path, operation, extra):
    """The explain routes and /heads as /patch: a client that goes away mid-call stops the call at its
    next report point and the handler ends (499); the soak (bench/soak.py) found a /lens whose client
    had left run to its end and be counted as answered."""
    from attnlens.model.analysis import operations

    reports: list[float] = []

    def endless(model, call, report):
        while True:
            time.sleep(0.02)
            reports.append(time.monotonic())
            report()

    monkeypatch.setitem(operations.OPERATIONS, operation, endless)
    ids = ckpt.tokenizer.encode("To be, or not to be, that is the question")[:12]

    async def scenario(app, client):
        engine = app.state.attnlens.registry.get(None).runner
        await post_then_leave(app, path, {"ids": ids, **extra}, lambda: len(reports) >= 3)
        await stopped(engine, reports)
        assert f'route="{path}",status="499"}} 1.0' in app.state.attnlens.metrics.render().decode()

    in_process(tiny_checkpoint, scenario)


# --- the client ---------------------------------------------------------------------------------
class Through(httpx.BaseTransport):
    """attnlens.Client's requests sent through a TestClient (the app in this process)."""

    def __init__(self, http):
        self.http = http

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.http.request(request.method, request.url.path, content=request.read(), headers=request.headers)
        keep = {k: v for k, v in r.headers.items() if k.lower() not in ("content-encoding", "content-length")}
        return httpx.Response(r.status_code, headers=keep, content=r.content)


@pytest.fixture(scope="module")
def api(bundled_client):
    with attnlens.Client("http://testserver", transport=Through(bundled_client)) as c:
        yield c


def test_the_clients_answers_hold_the_routes_json(api, bundled_client, prompts):
    clean, corrupted = prompts
    ask = dict(clean_ids=clean, corrupted_ids=corrupted, answer_id=ANSWER, foil_id=FOIL)
    for component in ("heads", "layers", "paths"):
        sender = (1, 3) if component == "paths" else None
        got = api.patch(**ask, component=component, sender=sender)
        raw = post(bundled_client, "/patch", **ask, component=component,
                   **({"sender": {"layer": 1, "head": 3}} if sender else {})).json()
        assert isinstance(got, attnlens.PatchAnswer) and got.component == component and got.sender == sender
        assert (got.clean_metric, got.corrupted_metric, got.position) == \
            (raw["clean_metric"], raw["corrupted_metric"], raw["position"])
        assert [t.id for t in got.clean_tokens] == clean and got.differing == sorted(CHANGED)
        if component == "heads":
            np.testing.assert_array_equal(got.values, np.array(raw["values"]))
            norm = (got.values - got.corrupted_metric) / (got.clean_metric - got.corrupted_metric)
            np.testing.assert_allclose(got.normalized, norm)
            (layer, head), value = got.top(1)[0]
            assert value == got.values.max() == raw["values"][layer][head]
        else:
            assert set(got.values) == set(raw["values"])
            for name, grid in got.values.items():
                np.testing.assert_array_equal(grid, np.array(raw["values"][name], dtype=np.float64))
    text = api.patch(TEXT, corrupted_ids=corrupted, answer_id=ANSWER, foil_id=FOIL, method="attribution")
    assert text.method == "attribution" and [t.id for t in text.clean_tokens] == clean

    attribution = api.logit_attribution(TEXT)
    raw = post(bundled_client, "/logit-attribution", text=TEXT).json()
    assert isinstance(attribution, attnlens.LogitAttributionAnswer)
    np.testing.assert_array_equal(attribution.heads, np.array(raw["heads"]))
    assert attribution.total == pytest.approx(attribution.logit_difference, abs=1e-4)
    assert (attribution.answer.id, attribution.foil.id) == (raw["answer"]["id"], raw["foil"]["id"])
    assert attribution.other_parts == raw["other_parts"]

    explained = api.explain(TEXT, layer=2, head=5, query=9, key=4)
    assert explained.score_parts is not None and explained.score_parts.key == 4
    assert explained.score_parts.top_pairs[0].value == max((p.value for p in explained.score_parts.top_pairs), key=abs)
    assert api.explain(TEXT, layer=2, head=5, query=9).score_parts is None


def test_a_bad_request_is_an_exception_naming_the_field(api, prompts):
    with pytest.raises(attnlens.BadRequestError) as e:
        api.patch(TEXT, TEXT + " again", answer_id=ANSWER, foil_id=FOIL)
    assert e.value.param == "corrupted" and e.value.status == 400
    with pytest.raises(attnlens.BadRequestError) as e:
        api.logit_attribution(TEXT, answer=" not to")
    assert e.value.param == "answer"


def test_the_async_client_answers_the_same(tiny_checkpoint, ckpt):
    ids = ckpt.tokenizer.encode("To be, or not to be")
    corrupted = [ids[0], (ids[1] + 1) % ckpt.config.vocab_size, *ids[2:]]

    async def scenario(app, http):
        async with attnlens.AsyncClient("http://test", transport=httpx.ASGITransport(app=app)) as c:
            got = await c.patch(clean_ids=ids, corrupted_ids=corrupted, answer_id=3, foil_id=4,
                                component="residual")
            raw = (await http.post("/patch", json={"clean_ids": ids, "corrupted_ids": corrupted, "answer_id": 3,
                                                   "foil_id": 4, "component": "residual"})).json()
            np.testing.assert_array_equal(got.values, np.array(raw["values"]))
            attribution = await c.logit_attribution(ids=ids)
            assert attribution.total == pytest.approx(attribution.logit_difference, abs=1e-4)
            explained = await c.explain(ids=ids, layer=1, head=2, query=4, key=1)
            assert explained.score_parts is not None and explained.score_parts.key == 1

    in_process(tiny_checkpoint, scenario)


# --- attnlens.show --------------------------------------------------------------------------------
def test_show_draws_both_answers_as_tables_offline(api, prompts):
    clean, corrupted = prompts
    for component, sender in (("heads", None), ("heads_by_position", None), ("residual", None), ("layers", None),
                              ("paths", (1, 3))):
        answer = api.patch(clean_ids=clean, corrupted_ids=corrupted, answer_id=ANSWER, foil_id=FOIL,
                              component=component, sender=sender)
        view = attnlens.show(answer, theme="dark")
        page = view.html()
        assert page.startswith("<!doctype html>") and "<script" not in page and "http" not in page
        assert page.count('<table class="grid">') == {"layers": 2, "paths": 3}.get(component, 1)
        assert f"patching {component}" in view.title and 'class="dark"' in page
        assert "<iframe" in view._repr_html_()
    heads = attnlens.show(api.patch(clean_ids=clean, corrupted_ids=corrupted, answer_id=ANSWER, foil_id=FOIL))
    assert heads.html().count("<tr>") == 1 + 4  # a header row and one per layer
    attribution = attnlens.show(api.logit_attribution(TEXT))
    page = attribution.html()
    assert "direct logit attribution" in attribution.title and ">MLP<" in page and page.count("<tr>") == 1 + 4
    with pytest.raises(ValueError, match="one view"):
        attnlens.show(api.logit_attribution(TEXT), view="head")
    with pytest.raises(TypeError, match="no layer or head"):
        attnlens.show(api.logit_attribution(TEXT), layer=1, head=1)


# --- SmolLM2 ------------------------------------------------------------------------------------
IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
NAME_MOVERS = [(23, 3), (29, 1), (20, 0), (17, 4), (19, 2)]


@pytest.mark.slow
def test_smollm2_ioi_over_http(smollm2_file):
    """SmolLM2's IOI pair through /patch: the name movers by exact patching, attribution patching ranking
    the same heads first, and /logit-attribution's L23H3."""
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings
    from attnlens.model.interop import packaged

    path = packaged.ensure_checkpoint(packaged.SMOLLM2, progress=False)
    settings = Settings(model=path, models=[path], device="cpu", dtype="float32", engine_process=False, warmup=False,
                        packaged_models=False)
    with TestClient(create_app(settings)) as http:
        ask = dict(clean=IOI_CLEAN, corrupted=IOI_CORRUPTED, answer=" Mary", foil=" John")
        exact = http.post("/patch", json=ask).json()
        assert exact["clean_metric"] == pytest.approx(6.12, abs=0.02)
        assert exact["corrupted_metric"] == pytest.approx(-5.49, abs=0.02)
        effect = np.array(exact["values"]) - exact["corrupted_metric"]
        H = effect.shape[1]
        top = [divmod(int(i), H) for i in np.argsort(-effect, axis=None)[:6]]
        assert top[:5] == NAME_MOVERS
        guess = http.post("/patch", json={**ask, "method": "attribution"}).json()
        estimate = np.array(guess["values"]) - guess["corrupted_metric"]
        assert {divmod(int(i), H) for i in np.argsort(-estimate, axis=None)[:6]} == set(top)
        assert np.corrcoef(effect.ravel(), estimate.ravel())[0, 1] > 0.95
        dla = http.post("/logit-attribution", json={"text": IOI_CLEAN, "answer": " Mary", "foil": " John"}).json()
        heads = np.array(dla["heads"])
        assert divmod(int(heads.argmax()), H) == (23, 3)
        assert dla["logit_difference"] == pytest.approx(exact["clean_metric"], abs=1e-3)

"""POST /patch (paths too), POST /logit-attribution and /attention/explain's key on the bundled translator
(an encoder-decoder): each answer against its operation run directly on the same weights, its groups'
shapes, every 4xx naming its field, the client's round trip and attnlens.show of both answers."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from helpers import TRANSLATOR_CLEAN as CLEAN
from helpers import TRANSLATOR_CORRUPTED as CORRUPTED
from helpers import TRANSLATOR_TARGET as TARGET
from helpers import assert_json_close, bundled_translator_dir

import attnlens
from attnlens.model.analysis.operations import (
    LogitAttributionCall,
    PatchCall,
    ScoreDecompositionCall,
    run_operation,
)

ASK = dict(model="translator", clean=CLEAN, corrupted=CORRUPTED, target=TARGET, answer=" mars", foil=" mai")


@pytest.fixture(scope="module")
def translator():
    from attnlens.model import load_checkpoint

    return load_checkpoint(bundled_translator_dir())


@pytest.fixture(scope="module")
def ids(translator):
    tok = translator.tokenizer
    return SimpleNamespace(clean=tok.encode(CLEAN), corrupted=tok.encode(CORRUPTED), target=tok.encode(TARGET),
                           answer=tok.encode(" mars")[0], foil=tok.encode(" mai")[0])


def shapes(values) -> dict:
    return {k: shapes(v) for k, v in values.items()} if isinstance(values, dict) else np.array(values).shape


@pytest.mark.parametrize("component", ["heads", "heads_by_position", "residual", "layers"])
@pytest.mark.parametrize("method", ["exact", "attribution"])
def test_patch_answers_the_operation_by_group(bundled_client, translator, ids, component, method):
    r = bundled_client.post("/patch", json={**ASK, "component": component, "method": method})
    assert r.status_code == 200, r.text
    a = r.json()
    want = run_operation(translator.model, PatchCall(ids.clean, ids.corrupted, ids.answer, ids.foil, None, component,
                                                     method, None, ids.target))
    assert (a["model"], a["component"], a["method"], a["position"]) == ("translator", component, method, 1)
    assert a["clean_metric"] == pytest.approx(want.clean_metric, abs=1e-4) and a["clean_metric"] > 10
    assert a["corrupted_metric"] == pytest.approx(want.corrupted_metric, abs=1e-4) and a["corrupted_metric"] < -10
    assert_json_close(a["values"], want.values, abs_tol=1e-4)
    assert [t["id"] for t in a["clean_tokens"]] == ids.clean and [t["id"] for t in a["corrupted_tokens"]] == ids.corrupted
    assert [t["id"] for t in a["target_tokens"]] == [translator.config.decoder_start_id, *ids.target]
    assert a["differing"] == [0] and a["answer"]["text"] == " mars" and a["foil"]["id"] == ids.foil
    L, H, S, T = 3, 4, len(ids.clean), len(ids.target) + 1
    assert shapes(a["values"]) == {
        "heads": {"encoder": (L, H), "decoder": (L, H), "cross": (L, H)},
        "heads_by_position": {"encoder": (L, S, H), "decoder": (L, T, H), "cross": (L, T, H)},
        "residual": {"encoder": (L, S), "decoder": (L, T)},
        "layers": {"encoder": {"attention": (L, S), "mlp": (L, S)},
                   "decoder": {"attention": (L, T), "cross": (L, T), "mlp": (L, T)}}}[component]


@pytest.mark.parametrize("group, layer, head", [("encoder", 1, 2), ("decoder", 1, 0), ("cross", 0, 3)])
def test_paths_answer_the_operation_by_receiver_group(bundled_client, translator, ids, group, layer, head):
    sender = {"group": group, "layer": layer, "head": head}
    r = bundled_client.post("/patch", json={**ASK, "component": "paths", "sender": sender})
    assert r.status_code == 200, r.text
    a = r.json()
    want = run_operation(translator.model, PatchCall(ids.clean, ids.corrupted, ids.answer, ids.foil, None, "paths",
                                                     "exact", (layer, head), ids.target, group))
    assert a["sender"] == sender and a["component"] == "paths"
    assert shapes(a["values"]) == {g: dict.fromkeys("qkv", (3, 4)) for g in ("encoder", "decoder", "cross")}
    assert_json_close(a["values"], want.values, abs_tol=1e-4)
    nulls = {(g, k) for g, kinds in a["values"].items() for k, grid in kinds.items() if grid[2] == [None] * 4}
    if group == "encoder":  # later encoder heads and the cross heads' keys and values
        assert nulls == {("decoder", k) for k in "qkv"} | {("cross", "q")}
    else:
        assert nulls >= {("encoder", k) for k in "qkv"} | {("cross", "k"), ("cross", "v")}


def test_the_cross_heads_of_the_last_layer_carry_the_month(bundled_client):
    """The month reaches the decoder through cross-attention: patching each last-layer cross head restores
    8 to 22% of the difference, no encoder or decoder self-attention head a hundredth."""
    a = bundled_client.post("/patch", json=ASK).json()
    norm = lambda v: (np.array(v) - a["corrupted_metric"]) / (a["clean_metric"] - a["corrupted_metric"])
    assert norm(a["values"]["cross"])[2].min() > 0.05 and norm(a["values"]["cross"])[2].max() > 0.2
    assert np.abs(norm(a["values"]["encoder"])).max() < 0.01 and np.abs(norm(a["values"]["decoder"])).max() < 0.01


def test_without_a_target_the_metric_is_on_the_first_target_token(bundled_client, translator, ids):
    tok = translator.tokenizer
    body = {**ASK, "answer": "3", "foil": "2"}
    body.pop("target")
    a = bundled_client.post("/patch", json={**body, "clean": "March 3, 2021", "corrupted": "March 2, 2021"}).json()
    assert a["position"] == 0 and [t["id"] for t in a["target_tokens"]] == [translator.config.decoder_start_id]
    want = run_operation(translator.model, PatchCall(tok.encode("March 3, 2021"), tok.encode("March 2, 2021"),
                                                     tok.encode("3")[0], tok.encode("2")[0], None, "heads", "exact",
                                                     None, []))
    assert_json_close(a["values"], want.values, abs_tol=1e-4)
    b = bundled_client.post("/patch", json={**ASK, "target_ids": ids.target, "target": None, "position": 0,
                                            "component": "residual"}).json()
    assert b["position"] == 0 and len(b["values"]["decoder"][0]) == 2


def test_logit_attribution_answers_the_operation_and_its_parts_sum(bundled_client, translator, ids):
    a = bundled_client.post("/logit-attribution", json={"model": "translator", "text": CLEAN, "target": TARGET}).json()
    want = run_operation(translator.model, LogitAttributionCall(ids.clean, None, None, None, ids.target))
    assert a["position"] == 1 and [t["id"] for t in a["tokens"]] == ids.clean
    assert [t["id"] for t in a["target_tokens"]] == [0, *ids.target]
    assert a["answer"]["text"] == " mars"  # the top prediction; the foil the next best
    assert a["foil"]["id"] == want["foil_id"]
    assert_json_close(a["heads"], want["heads"], abs_tol=1e-4)
    assert set(a["heads"]) == {"decoder", "cross"} and np.array(a["heads"]["cross"]).shape == (3, 4)
    total = np.sum(a["heads"]["decoder"]) + np.sum(a["heads"]["cross"]) + np.sum(a["mlps"]) + a["embedding"] + a["other"]
    assert total == pytest.approx(a["logit_difference"], abs=1e-4)
    assert set(a["other_parts"]) == {"positions", "attention_biases", "norm_biases", "head_bias"}
    b = bundled_client.post("/logit-attribution", json={"model": "translator", "ids": ids.clean, "target": TARGET,
                                                         "answer": " mars", "foil": " mai", "position": 1}).json()
    assert b["foil"]["id"] == ids.foil and b["logit_difference"] == pytest.approx(
        run_operation(translator.model, LogitAttributionCall(ids.clean, ids.answer, ids.foil, 1, ids.target))
        ["logit_difference"], abs=1e-4)


@pytest.mark.parametrize("group, layer, head, query, key", [("encoder", 1, 2, 3, 0), ("decoder", 2, 1, 1, 0),
                                                          ("cross", 2, 3, 1, 0)])
def test_explain_with_a_key_says_why_in_every_group(bundled_client, translator, ids, group, layer, head, query, key):
    ask = dict(model="translator", text=CLEAN, target=TARGET, group=group, layer=layer, head=head, query=query)
    plain = bundled_client.post("/attention/explain", json=ask).json()
    keyed = bundled_client.post("/attention/explain", json={**ask, "key": key})
    assert keyed.status_code == 200, keyed.text
    parts = keyed.json()["score_parts"]
    want = run_operation(translator.model, ScoreDecompositionCall(ids.clean, layer, head, query, key,
                                                                  target_ids=ids.target, group=group))
    assert (parts["parts"], parts["key_parts"]) == (want["parts"], want["key_parts"])
    assert parts["score"] == pytest.approx(plain["scaled"][key], abs=1e-4)  # the step-by-step's own score
    assert parts["probability"] == pytest.approx(plain["pattern_row"][key], abs=1e-5)
    assert sum(parts["query_totals"]) == pytest.approx(parts["score"], abs=1e-4)
    assert sum(parts["key_totals"]) == pytest.approx(parts["score"], abs=1e-4)
    assert [(p["query_part"], p["key_part"]) for p in parts["top_pairs"]] == [(p["query"], p["key"]) for p in want["top"]]
    assert len(parts["key_totals"]) == len(parts["key_parts"])
    if group == "cross":  # the keys read the encoder's output: its heads and MLPs
        assert "encoder L2H0" in parts["key_parts"] and "decoder L2H0" in parts["parts"]
    generated = bundled_client.post("/attention/explain", json={**ask, "key": key, "target": None})
    assert generated.status_code == 200 or group != "encoder" and generated.json()["param"] == "query"


def test_a_query_past_a_generated_target_is_a_400_naming_query(bundled_client):
    r = bundled_client.post("/attention/explain", json=dict(model="translator", text=CLEAN, group="cross", layer=0,
                                                            head=0, query=40, key=0))
    assert r.status_code == 400 and r.json()["param"] == "query" and "out of range" in r.json()["detail"]


# --- bad input: a 4xx naming the field ------------------------------------------------------------
BAD = [
    # (route, change, status, param, words in the message)
    ("/patch", {"component": "paths", "sender": {"layer": 0, "head": 0}}, 400, "sender",
     ["needs a group", "encoder, decoder, cross"]),
    ("/patch", {"component": "paths", "sender": {"layer": 0, "head": 0, "group": "self"}}, 400, "sender",
     ["sender group 'self'"]),
    ("/patch", {"component": "paths", "sender": {"layer": 3, "head": 0, "group": "cross"}}, 400, "sender",
     ["layer 3 out of range"]),
    ("/patch", {"component": "paths", "sender": {"layer": 0, "head": 0, "group": "cross"}, "method": "attribution"},
     400, "method", ["exact"]),
    ("/patch", {"component": "paths"}, 400, "sender", ["needs a sender"]),
    ("/patch", {"sender": {"layer": 0, "head": 0}}, 400, "sender", ["paths only"]),
    ("/patch", {"position": 2}, 400, "position", ["target has", "2 tokens (0..1)"]),
    ("/patch", {"corrupted": "May 3, 2021 and more"}, 400, "corrupted", ["as many tokens"]),
    ("/patch", {"answer": " mars et"}, 400, "answer", ["not one"]),
    ("/patch", {"target": None, "target_ids": [5000]}, 422, "target_ids", ["not in the vocabulary"]),
    ("/patch", {"target_ids": [23]}, 422, "target_ids", ["not both"]),
    ("/patch", {"target": "x " * 60}, 400, "target", ["context length"]),
    ("/patch", {"model": "default"}, 422, "target", ["encoder-decoder"]),
    ("/patch", {"model": "encoder"}, 400, "model", ["bidirectional", "translator"]),
    ("/logit-attribution", {"position": 5}, 400, "position", ["target has"]),
    ("/logit-attribution", {"model": "default"}, 422, "target", ["encoder-decoder"]),
    ("/logit-attribution", {"foil": "de la"}, 400, "foil", ["not one"]),
]


@pytest.mark.parametrize("route,change,status,param,words", BAD)
def test_bad_requests_name_their_field(bundled_client, route, change, status, param, words):
    body = dict(ASK) if route == "/patch" else {"model": "translator", "text": CLEAN, "target": TARGET}
    body = {k: v for k, v in {**body, **change}.items() if v is not None}
    r = bundled_client.post(route, json=body)
    assert r.status_code == status, r.text
    found = r.json()
    assert found["param"] == param, found
    message = str(found["detail"])
    for w in words:
        assert w in message, message


def test_the_target_over_the_patch_limit_says_so(bundled_client, monkeypatch):
    monkeypatch.setattr(bundled_client.app.state.attnlens.settings, "max_patch_tokens", 4)  # the sources' length
    r = bundled_client.post("/patch", json={**ASK, "target": "3 mars 2021 3"})
    assert r.status_code == 400 and r.json()["param"] == "target" and "shorter target" in r.json()["detail"]


# --- the client and attnlens.show -----------------------------------------------------------------
@pytest.fixture(scope="module")
def api(bundled_client):
    from test_causes_api import Through

    with attnlens.Client("http://testserver", transport=Through(bundled_client)) as c:
        yield c


def test_the_clients_answers_hold_the_groups(api, bundled_client, ids):
    ask = {k: v for k, v in ASK.items() if k not in ("clean", "corrupted")}
    got = api.patch(CLEAN, CORRUPTED, **ask)
    raw = bundled_client.post("/patch", json=ASK).json()
    assert isinstance(got, attnlens.PatchAnswer) and [t.id for t in got.target_tokens] == [0, *ids.target]
    for group in ("encoder", "decoder", "cross"):
        np.testing.assert_array_equal(got.values[group], np.array(raw["values"][group]))
    span = got.clean_metric - got.corrupted_metric
    np.testing.assert_allclose(got.normalized["cross"], (got.values["cross"] - got.corrupted_metric) / span)
    top = got.top(3)  # every group ranked together: the last layer's cross heads
    assert [index[0] for index, _ in top] == ["cross"] * 3 and top[0][1] == got.values["cross"].max()
    assert got.top(1, part="encoder")[0][1] == got.values["encoder"].max()
    paths = api.patch(CLEAN, CORRUPTED, **ask, component="paths", sender=("encoder", 0, 1))
    assert paths.sender == ("encoder", 0, 1) and set(paths.values["cross"]) == {"q", "k", "v"}
    assert np.isnan(paths.values["cross"]["q"]).all() and not np.isnan(paths.values["cross"]["k"]).any()
    assert paths.top(1)[0][0][:2] in {("encoder", "q"), ("encoder", "k"), ("encoder", "v"), ("cross", "k"),
                                      ("cross", "v")}
    layers = api.patch(clean_ids=ids.clean, corrupted_ids=ids.corrupted, target_ids=ids.target, answer_id=ids.answer,
                       foil_id=ids.foil, component="layers", model="translator")
    assert set(layers.values) == {"encoder", "decoder"} and set(layers.values["decoder"]) == {"attention", "cross", "mlp"}
    assert layers.top(1)[0][0][:2] == ("decoder", "cross")
    assert layers.top(1, part="encoder.mlp")[0][1] == np.max(layers.values["encoder"]["mlp"])
    assert set(layers.normalized["decoder"]) == {"attention", "cross", "mlp"}

    explained = api.explain(CLEAN, target=TARGET, model="translator", group="cross", layer=2, head=3, query=1, key=0)
    parts = explained.score_parts
    assert parts is not None and parts.key_parts is not None and "encoder L0H0" in parts.key_parts
    assert len(parts.key_totals) == len(parts.key_parts) and len(parts.query_totals) == len(parts.parts)
    assert parts.key_totals.sum() == pytest.approx(parts.score, abs=1e-4)
    attribution = api.logit_attribution(CLEAN, target=TARGET, model="translator")
    assert isinstance(attribution.heads, dict) and attribution.heads["cross"].shape == (3, 4)
    assert attribution.total == pytest.approx(attribution.logit_difference, abs=1e-4)
    assert attribution.top(1)[0][0][0] == "cross" and attribution.top(1, part="decoder")[0][0][0] in range(3)


def test_show_draws_the_groups_offline(api, ids):
    ask = dict(clean_ids=ids.clean, corrupted_ids=ids.corrupted, target_ids=ids.target, answer_id=ids.answer,
               foil_id=ids.foil, model="translator")
    for component, tables in (("heads", 3), ("heads_by_position", 3), ("residual", 2), ("layers", 5)):
        view = attnlens.show(api.patch(**ask, component=component), theme="dark")
        page = view.html()
        assert page.startswith("<!doctype html>") and "<script" not in page and "http" not in page
        assert page.count('<table class="grid">') == tables, component
        assert "at target position 1" in page and "target: " in page and "clean source" in page
    paths = attnlens.show(api.patch(**ask, component="paths", sender=("cross", 0, 2))).html()
    assert "sender cross L0H2" in paths and paths.count('<table class="grid">') == 4  # decoder q, k, v; cross q
    assert "query input" in paths and "value input" in paths and "cross-attention heads" in paths
    heads = attnlens.show(api.patch(**ask)).html()
    assert "cross-attention heads" in heads and "encoder self-attention heads" in heads
    attribution = attnlens.show(api.logit_attribution(CLEAN, target=TARGET, model="translator")).html()
    assert ">cross H3<" in attribution and ">self H0<" in attribution and ">MLP<" in attribution
    assert attribution.count("<tr>") == 1 + 3

"""POST /logits, /lens, /attention/explain and `ablate` on /attention and /generate, through the
app, on the three bundled models (a decoder, an encoder, an encoder-decoder)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import assert_json_close, parse_sse

MODELS = ["default", "encoder", "translator"]
TEXT = "To be, or not to be"
ROUTES = {"/logits": {}, "/lens": {}, "/attention/explain": {"layer": 1, "head": 1, "query": 2}}
GROUPS = {"default": ["self"], "encoder": ["self"], "translator": ["encoder", "decoder", "cross"]}


def post(client, route, **body):
    return client.post(route, json=body)


@pytest.mark.parametrize("model", MODELS)
def test_logits_all_and_last_and_the_effect_of_an_ablation(bundled_client, model):
    r = post(bundled_client, "/logits", model=model, text=TEXT, top_k=4)
    assert r.status_code == 200, r.text
    a = r.json()
    stream = a["target_tokens"] or a["tokens"]
    assert [p["position"] for p in a["positions"]] == list(range(len(stream)))
    assert a["clean"] is a["effect"] is a["ablate"] is None
    for p in a["positions"]:
        assert len(p["top"]) == 4 and p["top"][0]["prob"] >= p["top"][-1]["prob"]
        assert p["token"] == stream[p["position"]]
        if a["predicts"] == "same":
            assert p["next"] == p["token"]
        elif p["position"] + 1 < len(stream):
            assert p["next"] == stream[p["position"] + 1]
            assert math.exp(p["next_logprob"]) == pytest.approx(p["next_prob"], rel=1e-5)
    assert (a["predicts"] == "same") == (model == "encoder")
    last = post(bundled_client, "/logits", model=model, text=TEXT, top_k=4, positions="last").json()
    assert_json_close(last["positions"], a["positions"][-1:])
    ablate = [{"layer": 0, "head": 1, "how": "mean"}, {"layer": 1, "head": 0}]
    b = post(bundled_client, "/logits", model=model, text=TEXT, top_k=4, ablate=ablate).json()
    group = GROUPS[model][1] if model == "translator" else "self"
    assert b["ablate"] == [{**ablate[0], "group": group}, {**ablate[1], "how": "zero", "group": group}]
    assert_json_close(b["clean"], a["positions"])
    assert len(b["effect"]) == len(stream) and all(e["kl"] >= 0 for e in b["effect"])
    assert max(e["kl"] for e in b["effect"]) > 0
    # an empty ablation is no ablation
    assert post(bundled_client, "/logits", model=model, text=TEXT, top_k=4, ablate=[]).json()["positions"] == \
        a["positions"]


@pytest.mark.parametrize("model", MODELS)
def test_lens_rows_and_its_last_row_is_the_models_output(bundled_client, model):
    a = post(bundled_client, "/lens", model=model, text=TEXT, top_k=3).json()
    n_layers = bundled_client.get("/models").json()
    logits = post(bundled_client, "/logits", model=model, text=TEXT, top_k=3).json()
    assert [l["index"] for l in a["layers"]][:2] == [-1, 0] and a["layers"][0]["label"] == "embeddings"
    assert a["layers"][1]["label"] == "block 0"
    for pos, ref in zip(a["layers"][-1]["positions"], logits["positions"]):
        assert [t["id"] for t in pos["top"]] == [t["id"] for t in ref["top"]]
        assert [t["prob"] for t in pos["top"]] == pytest.approx([t["prob"] for t in ref["top"]], abs=1e-5)
        if ref["next"] is not None:
            assert pos["actual"]["id"] == ref["next"]["id"]
            assert pos["actual"]["prob"] == pytest.approx(ref["next_prob"], abs=1e-5)
    assert n_layers  # /models still answers


@pytest.mark.parametrize("model", MODELS)
def test_explain_recomputes_the_attention_maps_row(bundled_client, model):
    for group in GROUPS[model]:
        query = 2
        e = post(bundled_client, "/attention/explain", model=model, text=TEXT, group=group, layer=1, head=2,
                 query=query).json()
        assert e["group"] == group and e["scale"] == pytest.approx(1 / math.sqrt(e["d_head"]))
        assert max(abs(x - y) for x, y in zip(e["softmax"], e["pattern_row"])) < 1e-6
        z = [sum(w * v[d] for w, v in zip(e["softmax"], e["values"])) for d in range(e["d_head"])]
        assert z == pytest.approx(e["z"], abs=1e-6)
        assert e["scores"] == pytest.approx([sum(a * b for a, b in zip(e["q"], k)) for k in e["keys"]], abs=1e-5)
        assert e["masked"] == [s if m else None for s, m in zip(e["scaled"], e["mask"])]
        # the same row as /attention's map
        att = post(bundled_client, "/attention", model=model, text=TEXT, layers=[1], heads=[2]).json()
        maps = att["attention"] if group in ("self", "encoder") else att["translation"][group]["attention"]
        assert maps[0][0][query] == pytest.approx(e["pattern_row"], abs=1e-6)
        assert e["key_tokens"] == (att["tokens"] if group != "decoder" else att["translation"]["target_tokens"])
    first = post(bundled_client, "/attention/explain", model=model, text=TEXT, layer=0, head=0, query=0).json()
    assert first["group"] == GROUPS[model][0]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("route", list(ROUTES))
def test_bad_inputs_are_4xx_naming_the_field(bundled_client, model, route):
    base = {"model": model, "text": TEXT, **ROUTES[route]}
    cases = [
        ({"ablate": [{"layer": 99, "head": 0}]}, 400, "ablate"),
        ({"ablate": [{"layer": 0, "head": 99}]}, 400, "ablate"),
        ({"ablate": [{"layer": -1, "head": 0}]}, 400, "ablate"),
        ({"ablate": [{"layer": 0, "head": 0, "group": "nope"}]}, 400, "ablate"),
        ({"ablate": [{"layer": 0, "head": 0, "how": "half"}]}, 422, "ablate.0.how"),
        ({"ablate": [{"layer": 0, "head": 0}, {"layer": 0, "head": 0}]}, 400, "ablate"),
        ({"ablate": [{"layer": 0, "head": h} for h in range(4)]}, 400, "ablate"),  # the limit is 3 here
        ({"ids": [1, 2], "text": TEXT}, 422, "ids"),
        ({"ablate": [{"layer": 0, "head": 0, "extra": 1}]}, 422, "ablate.0.extra"),
    ]
    if route == "/attention/explain":
        cases += [({"layer": 99}, 400, "layer"), ({"head": -1}, 400, "head"), ({"query": 999}, 400, "query"),
                  ({"query": -1}, 400, "query"), ({"group": "nope"}, 400, "group")]
    else:
        cases += [({"top_k": 0}, 422, "top_k"), ({"top_k": 51 if route == "/logits" else 21}, 422, "top_k")]
    if route == "/logits":
        cases += [({"positions": "first"}, 422, "positions")]
    if route == "/lens":
        cases += [({"positions": [0, 0]}, 422, "positions"), ({"positions": []}, 422, "positions"),
                  ({"positions": [-1]}, 422, "positions.0"), ({"rank": "often"}, 422, "rank")]
        if model != "translator":  # the translator's default target is generated: checked once it is made
            cases += [({"positions": [0, 999]}, 400, "positions")]
    if model != "translator":
        cases += [({"target": "x"}, 422, "target")]
    for change, status, param in cases:
        r = bundled_client.post(route, json={**base, **change})
        assert (r.status_code, r.json().get("param")) == (status, param), (change, r.text)


@pytest.mark.parametrize("model", MODELS)
def test_lens_at_chosen_positions_is_those_columns_of_the_whole(bundled_client, model):
    """`positions` reads only those columns (in the order asked) and each equals the whole lens's;
    `rank` comes only when asked."""
    whole = post(bundled_client, "/lens", model=model, text=TEXT, top_k=3, rank=True).json()
    T = len(whole["layers"][0]["positions"])
    at = [T - 1, 0, T // 2]
    part = post(bundled_client, "/lens", model=model, text=TEXT, top_k=3, positions=at).json()
    assert [p["position"] for p in whole["layers"][0]["positions"]] == list(range(T))
    for w, p in zip(whole["layers"], part["layers"]):
        assert [c["position"] for c in p["positions"]] == at
        for c, i in zip(p["positions"], at):
            assert [t["id"] for t in c["top"]] == [t["id"] for t in w["positions"][i]["top"]]
            assert [t["prob"] for t in c["top"]] == pytest.approx([t["prob"] for t in w["positions"][i]["top"]],
                                                                   abs=1e-6)
            if c["actual"] is not None:
                assert c["actual"]["rank"] is None and w["positions"][i]["actual"]["rank"] >= 0
                assert c["actual"]["prob"] == pytest.approx(w["positions"][i]["actual"]["prob"], abs=1e-6)


def test_lens_position_past_a_generated_target(bundled_client):
    r = post(bundled_client, "/lens", model="translator", text=TEXT, positions=[0, 47])
    assert r.status_code == 400 and r.json()["param"] == "positions"


def test_explain_query_past_a_generated_target(bundled_client):
    r = post(bundled_client, "/attention/explain", model="translator", text=TEXT, group="decoder", layer=0, head=0,
             query=47)
    assert r.status_code == 400 and r.json()["param"] == "query"


def test_openapi_keeps_one_of_text_ids_or_messages(bundled_client):
    schemas = bundled_client.get("/openapi.json").json()["components"]["schemas"]
    for name in ("AttentionRequest", "LogitsRequest", "LensRequest", "ExplainRequest"):
        assert schemas[name]["oneOf"] == [{"required": ["text"]}, {"required": ["ids"]},
                                          {"required": ["messages"]}], name
        assert "ablate" in schemas[name]["properties"]


@pytest.mark.parametrize("model", MODELS)
def test_attention_with_ablate_changes_later_layers_only(bundled_client, model):
    base = {"model": model, "text": TEXT, "heads": [0, 1]}
    group = "self" if model != "translator" else "encoder"
    clean = post(bundled_client, "/attention", **base).json()
    ablated = post(bundled_client, "/attention", **base, ablate=[{"layer": 1, "head": 0, "group": group}]).json()
    assert ablated["ablate"] == [{"layer": 1, "head": 0, "how": "zero", "group": group}] and clean.get("ablate") is None
    # layers 0 and 1 read nothing the edit changed (to float32 rounding: a run with an edit may take the
    # recompute where the other took the forward's kernel)
    np.testing.assert_allclose(np.array(ablated["attention"][:2]), np.array(clean["attention"][:2]), rtol=0, atol=2e-6)
    assert ablated["attention"][2] != clean["attention"][2]


def test_generate_with_ablate_streams_and_echoes(bundled_client):
    body = {"prompt": "To be", "max_new_tokens": 6, "temperature": 0, "logprobs": 1}
    ablate = [{"layer": 0, "head": 1, "how": "mean"}]
    clean = post(bundled_client, "/generate", **body).json()
    plain = post(bundled_client, "/generate", **body, ablate=ablate).json()
    assert plain["ablate"] == [{**ablate[0], "group": "self"}] and "ablate" not in clean
    assert [t["logprob"] for t in plain["tokens"]] != [t["logprob"] for t in clean["tokens"]]
    r = post(bundled_client, "/generate", **body, ablate=ablate, stream=True)
    events = parse_sse(r.text)
    tokens = [json.loads(d) for e, d in events if e == "token"]
    done = json.loads(events[-1][1])
    assert [t["id"] for t in tokens] == [t["id"] for t in plain["tokens"]]
    assert [t["logprob"] for t in tokens] == pytest.approx([t["logprob"] for t in plain["tokens"]], abs=1e-5)
    assert done["ablate"] == plain["ablate"]
    r = post(bundled_client, "/generate", **body, ablate=[{"layer": 0, "head": 0, "group": "cross"}])
    assert (r.status_code, r.json()["param"]) == (400, "ablate")
    tr = post(bundled_client, "/generate", model="translator", prompt="twenty one", max_new_tokens=5, temperature=0,
              ablate=[{"layer": 0, "head": 1, "how": "mean", "group": "cross"}])
    assert tr.status_code == 200 and tr.json()["ablate"][0]["group"] == "cross"


def test_models_declare_the_lens_and_the_ablation_group(bundled_client):
    info = {m["name"]: m["family_info"] for m in bundled_client.get("/models").json()["models"]}
    assert info["default"]["lens"]["predicts"] == "next" and info["default"]["ablation_group"] == "self"
    assert info["encoder"]["lens"]["predicts"] == "same" and info["encoder"]["ablation_group"] == "self"
    assert info["translator"]["lens"]["stream"] == "target" and info["translator"]["ablation_group"] == "decoder"


@pytest.mark.parametrize("model", MODELS)
def test_answers_are_their_schemas_round_trip(bundled_client, model):
    """/logits and /lens build their per-position rows as plain JSON (app/serving/explain_serving.py's
    with_rows): each answer equals what its response model validates and dumps, field for field."""
    from attnlens.app.api.explain_schemas import LensResponse, LogitsResponse

    ablate = [{"layer": 1, "head": 0, "how": "mean"}]
    for route, schema, body in (("/logits", LogitsResponse, {"top_k": 3}),
                                ("/logits", LogitsResponse, {"top_k": 3, "ablate": ablate}),
                                ("/lens", LensResponse, {"top_k": 2, "rank": True}),
                                ("/lens", LensResponse, {"top_k": 2, "positions": [1, 0], "ablate": ablate})):
        answer = post(bundled_client, route, model=model, text=TEXT, **body).json()
        assert schema.model_validate(answer).model_dump(mode="json") == answer, (route, body)

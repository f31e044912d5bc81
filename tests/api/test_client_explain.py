"""attnlens.Client's explain methods (heads, logits, lens, explain) and `ablate=` against a real
server on the three bundled models: each typed answer holds exactly the JSON the route answers to
the same request (sent by hand here), HeadExplanation.recompute() gives the map's row, the forms
of `ablate` are one request, the async twin answers the same, and a bad ablation is an exception
naming `ablate`."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from helpers import RecordingTransport, run_async

import attnlens
from attnlens.ablation import ablate_body

pytestmark = pytest.mark.slow  # the bundled server of tests/conftest.py, shared with test_client.py

TEXT = "To be, or not to be"
ENCODER_TEXT = "O Romeo, Romeo, [MASK] art thou?"
SOURCE = "twenty one"


@pytest.fixture(scope="module")
def sent(bundled_server):
    transport = RecordingTransport()
    with attnlens.Client(bundled_server.url, transport=transport) as c:
        yield c, transport.bodies


@pytest.fixture(scope="module")
def raw(bundled_server):
    """The route's own JSON for a body written out here."""
    with httpx.Client(base_url=bundled_server.url, timeout=120) as http:
        def post(path: str, body: dict) -> dict:
            response = http.post(path, json=body)
            assert response.status_code == 200, response.text
            return response.json()

        yield post


def numbers(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def same_tokens(got, want: list[dict] | None) -> None:
    if want is None:
        assert got is None
        return
    assert [(t.id, t.text) for t in got] == [(t["id"], t["text"]) for t in want]


# --- each answer is its route's JSON ------------------------------------------------------------
def assert_atlas_is(atlas: attnlens.HeadAtlas, body: dict) -> None:
    assert (atlas.model, atlas.family, atlas.probe) == (body["model"], body["family"], body["probe"])
    same_tokens(atlas.tokens, body["tokens"])
    same_tokens(atlas.target_tokens, body["target_tokens"])
    assert atlas.thresholds == body["thresholds"] and atlas.definitions == body["definitions"]
    assert list(atlas.groups) == [g["name"] for g in body["groups"]]
    for g in body["groups"]:
        got = atlas.groups[g["name"]]
        L, H = len(g["heads"]), len(g["heads"][0])
        assert got.shape == (L, H) and (got.causal, got.bidirectional) == (g["causal"], g["bidirectional"])
        assert got.rows is (atlas.tokens if g["rows"] == "tokens" else atlas.target_tokens)
        assert set(got.scores) == set(g["heads"][0][0]["scores"])
        for name, grid in got.scores.items():
            want = numbers([h["scores"][name] for row in g["heads"] for h in row]).reshape(L, H)
            np.testing.assert_array_equal(grid, want, err_msg=f"{g['name']} {name}")
        assert got.roles == [[h["role"] for h in row] for row in g["heads"]]
        np.testing.assert_array_equal(got.role_scores,
                                      numbers([h["role_score"] for row in g["heads"] for h in row]).reshape(L, H))
    assert atlas.scores is atlas.groups[body["groups"][0]["name"]].scores
    assert atlas.clark_sentences == body.get("clark_sentences")  # an encoder's: Clark et al.'s sentences


def test_heads_is_the_routes_json_and_top_ranks_it(sent, raw):
    client, bodies = sent
    cases = [(dict(probe=(12, 3)), {"probe": {"kind": "repeated_random", "length": 12, "seed": 3}}),
             (dict(text=TEXT), {"text": TEXT}),
             (dict(text=ENCODER_TEXT, model="encoder"), {"model": "encoder", "text": ENCODER_TEXT}),
             (dict(text=SOURCE, model="translator", target="vingt et un"),
              {"model": "translator", "text": SOURCE, "target": "vingt et un"})]
    for kwargs, body in cases:
        atlas = client.heads(**kwargs)
        assert bodies[-1] == body
        assert_atlas_is(atlas, raw("/heads", body))
    assert list(atlas.groups) == ["encoder", "decoder", "cross"]
    probe = client.heads(probe=(12, 3))
    induction = probe.scores["induction"]
    best = probe.top("induction", 3)
    flat = sorted(((v, l, h) for (l, h), v in np.ndenumerate(induction)), key=lambda t: (-t[0], t[1], t[2]))
    assert [(h.layer, h.head, h.score) for h in best] == [(l, h, v) for v, l, h in flat[:3]]
    assert best[0].role == probe.roles[best[0].layer][best[0].head]
    cross = atlas.top("alignment", 2, group="cross")
    assert len(cross) == 2 and cross[0].score == np.nanmax(atlas.groups["cross"].scores["alignment"])
    with pytest.raises(KeyError, match="no score 'alignment'"):
        probe.top("alignment")
    assert client.heads(probe=True).probe["kind"] == "repeated_random"
    assert bodies[-1] == {"probe": {"kind": "repeated_random"}}


def positions_are(got: list[attnlens.PositionLogits], want: list[dict]) -> None:
    assert len(got) == len(want)
    for p, w in zip(got, want):
        assert (p.position, p.next_prob, p.next_logprob) == (w["position"], w["next_prob"], w["next_logprob"])
        assert (p.token.id, p.token.text) == (w["token"]["id"], w["token"]["text"])
        assert (None if p.next is None else {"id": p.next.id, "text": p.next.text}) == w["next"]
        assert [(t.id, t.text, t.prob) for t in p.top] == [(t["id"], t["text"], t["prob"]) for t in w["top"]]


def assert_logits_is(answer: attnlens.LogitsAnswer, body: dict) -> None:
    assert (answer.model, answer.family, answer.predicts, answer.head, answer.generated) == \
        (body["model"], body["family"], body["predicts"], body["head"], body["generated"])
    same_tokens(answer.tokens, body["tokens"])
    same_tokens(answer.target_tokens, body["target_tokens"])
    positions_are(answer.positions, body["positions"])
    np.testing.assert_array_equal(answer.next_logprob, numbers([p["next_logprob"] for p in body["positions"]]))
    assert (answer.ablate and [a.to_json() for a in answer.ablate]) == body["ablate"]
    if body["clean"] is None:
        assert answer.clean is None and answer.effect is None and body["effect"] is None
        return
    positions_are(answer.clean, body["clean"])
    np.testing.assert_array_equal(answer.effect.position, [e["position"] for e in body["effect"]])
    np.testing.assert_array_equal(answer.effect.kl, numbers([e["kl"] for e in body["effect"]]))
    np.testing.assert_array_equal(answer.effect.delta_logprob, numbers([e["delta_logprob"] for e in body["effect"]]))


def test_logits_is_the_routes_json(sent, raw):
    client, bodies = sent
    cases = [(dict(text=TEXT, top_k=3), {"text": TEXT, "top_k": 3}),
             (dict(text=TEXT, positions="last", ablate="2.2z"),
              {"text": TEXT, "positions": "last", "ablate": [{"layer": 2, "head": 2, "how": "zero", "group": None}]}),
             (dict(text=ENCODER_TEXT, model="encoder", top_k=2, ablate=[{"layer": 0, "head": 1, "how": "mean"}]),
              {"model": "encoder", "text": ENCODER_TEXT, "top_k": 2, "ablate": [{"layer": 0, "head": 1, "how": "mean"}]}),
             (dict(text=SOURCE, model="translator", ablate="cross:0.1z"),
              {"model": "translator", "text": SOURCE, "ablate": [{"layer": 0, "head": 1, "how": "zero", "group": "cross"}]})]
    for kwargs, body in cases:
        answer = client.logits(**kwargs)
        assert bodies[-1] == body
        assert_logits_is(answer, raw("/logits", body))
    assert answer.ablate == [attnlens.Ablation(0, 1, "zero", "cross")] and answer.target_tokens
    assert np.all(answer.effect.kl >= 0) and np.isnan(answer.effect.delta_logprob[-1])


def assert_lens_is(answer: attnlens.LensAnswer, body: dict) -> None:
    layers = body["layers"]
    assert answer.labels == [l["label"] for l in layers] and answer.indices == [l["index"] for l in layers]
    assert (answer.model, answer.predicts, answer.head) == (body["model"], body["predicts"], body["head"])
    same_tokens(answer.tokens, body["tokens"])
    same_tokens(answer.target_tokens, body["target_tokens"])
    T = len(layers[0]["positions"])
    assert answer.columns == [p["position"] for p in layers[0]["positions"]]
    ranked = any(p["actual"] and p["actual"]["rank"] is not None for p in layers[0]["positions"])
    assert (answer.actual_rank is not None) == ranked
    assert answer.prob.shape == answer.actual_prob.shape == (len(layers), T)
    for r, layer in enumerate(layers):
        for t, p in enumerate(layer["positions"]):
            assert [(x.id, x.text, x.prob) for x in answer.top[r][t]] == [(x["id"], x["text"], x["prob"])
                                                                           for x in p["top"]]
            assert (answer.top1[r][t].id, answer.top1[r][t].text) == (p["top"][0]["id"], p["top"][0]["text"])
            assert answer.prob[r, t] == p["top"][0]["prob"]
            a = p["actual"]
            if a is None:
                assert answer.actual[t] is None and np.isnan(answer.actual_prob[r, t])
                assert not ranked or answer.actual_rank[r, t] == -1
            else:
                assert (answer.actual[t].id, answer.actual[t].text) == (a["id"], a["text"])
                assert answer.actual_prob[r, t] == a["prob"]
                assert (answer.actual_rank[r, t] if ranked else None) == a["rank"]
    assert (answer.ablate and [a.to_json() for a in answer.ablate]) == body["ablate"]


def test_lens_is_the_routes_json(sent, raw):
    client, bodies = sent
    cases = [(dict(text=TEXT, top_k=2), {"text": TEXT, "top_k": 2}),
             (dict(ids=[408, 306, 12], ablate="1.3m"),
              {"ids": [408, 306, 12], "ablate": [{"layer": 1, "head": 3, "how": "mean", "group": None}]}),
             (dict(text=ENCODER_TEXT, model="encoder", top_k=1), {"model": "encoder", "text": ENCODER_TEXT, "top_k": 1}),
             (dict(text=TEXT, positions=[4, 0, 2], rank=True), {"text": TEXT, "positions": [4, 0, 2], "rank": True}),
             (dict(text=SOURCE, model="translator", target="vingt et un"),
              {"model": "translator", "text": SOURCE, "target": "vingt et un"})]
    for kwargs, body in cases:
        answer = client.lens(**kwargs)
        assert bodies[-1] == body
        assert_lens_is(answer, raw("/lens", body))
    assert answer.positions == answer.target_tokens and answer.labels[0] == "embeddings"
    assert client.lens(TEXT, positions=[4, 0, 2], rank=True).columns == [4, 0, 2]


EXPLAIN_ARRAYS = ("q", "keys", "values", "scores", "scaled", "softmax", "pattern_row", "z")


def assert_explanation_is(e: attnlens.HeadExplanation, body: dict) -> None:
    for name in ("model", "family", "group", "layer", "head", "query", "d_head", "scale", "kv_head", "positions",
                 "formula", "generated"):
        assert getattr(e, name) == body[name], name
    same_tokens([e.query_token], [body["query_token"]])
    same_tokens(e.key_tokens, body["key_tokens"])
    same_tokens(e.tokens, body["tokens"])
    same_tokens(e.target_tokens, body["target_tokens"])
    for name in EXPLAIN_ARRAYS:
        np.testing.assert_array_equal(getattr(e, name), np.array(body[name], dtype=np.float64), err_msg=name)
    assert e.keys.shape == e.values.shape == (len(body["key_tokens"]), body["d_head"])
    np.testing.assert_array_equal(e.mask, body["mask"])
    np.testing.assert_array_equal(e.masked, [-np.inf if v is None else v for v in body["masked"]])
    assert (e.ablate and [a.to_json() for a in e.ablate]) == body["ablate"]


EXPLAINED = [  # (client keyword arguments, the route's body)
    (dict(text=TEXT, layer=1, head=2, query=3), {"text": TEXT, "layer": 1, "head": 2, "query": 3}),
    (dict(text=TEXT, layer=3, head=7, query=0, ablate="1.2z"),
     {"text": TEXT, "layer": 3, "head": 7, "query": 0, "ablate": [{"layer": 1, "head": 2, "how": "zero", "group": None}]}),
    (dict(text=ENCODER_TEXT, model="encoder", layer=0, head=1, query=4),
     {"model": "encoder", "text": ENCODER_TEXT, "layer": 0, "head": 1, "query": 4}),
    (dict(text=SOURCE, model="translator", group="cross", layer=0, head=1, query=1),
     {"model": "translator", "text": SOURCE, "group": "cross", "layer": 0, "head": 1, "query": 1}),
    (dict(text=SOURCE, model="translator", group="decoder", layer=2, head=3, query=2, target="vingt et un"),
     {"model": "translator", "text": SOURCE, "target": "vingt et un", "group": "decoder", "layer": 2, "head": 3,
      "query": 2}),
]


@pytest.mark.parametrize(("kwargs", "body"), EXPLAINED, ids=["decoder", "ablated", "encoder", "cross", "target"])
def test_explain_is_the_routes_json_and_recomputes_the_maps_row(sent, raw, kwargs, body):
    client, bodies = sent
    e = client.explain(**kwargs)
    assert bodies[-1] == body
    assert_explanation_is(e, raw("/attention/explain", body))
    again = e.recompute()
    np.testing.assert_allclose(again.softmax, e.pattern_row, rtol=0, atol=1e-6)
    np.testing.assert_allclose(again.softmax, e.softmax, rtol=0, atol=1e-6)
    np.testing.assert_allclose(again.z, e.z, rtol=0, atol=1e-6)
    assert np.all(again.softmax[~e.mask] == 0) and abs(again.softmax.sum() - 1) < 1e-12
    causal = e.model == "default" or e.group == "decoder"  # keys after the query masked; else none
    assert e.mask.tolist() == [k <= e.query or not causal for k in range(len(e.key_tokens))]


# --- ablate ------------------------------------------------------------------------------------
ONE_ABLATION = [
    "2.2z,3.1m",
    " 2.2 , 3.1M ",
    [{"layer": 2, "head": 2, "how": "zero", "group": None}, {"layer": 3, "head": 1, "how": "mean", "group": None}],
    [attnlens.Ablation(2, 2), attnlens.Ablation(3, 1, "mean")],
]


def test_the_forms_of_ablate_are_one_request_with_one_answer(sent):
    client, bodies = sent
    answers = []
    for form in ONE_ABLATION:
        answers.append(client.logits(TEXT, top_k=2, ablate=form))
        assert bodies[-1]["ablate"] == ONE_ABLATION[2], form
    for other in answers[1:]:
        np.testing.assert_array_equal(other.effect.kl, answers[0].effect.kl)
        assert other.ablate == answers[0].ablate
    echo = answers[0].ablate
    assert echo == [attnlens.Ablation(2, 2, "zero", "self"), attnlens.Ablation(3, 1, "mean", "self")]
    # an answer's echo is itself a form of ablate; so is its text, which the page's URL writes
    assert attnlens.format_ablation(echo) == "self:2.2z,self:3.1m"
    for form in (echo, attnlens.format_ablation(echo)):
        again = client.logits(TEXT, top_k=2, ablate=form)
        np.testing.assert_array_equal(again.effect.kl, answers[0].effect.kl)
    # the same ablation on every route that takes one: echoed as it was resolved
    attention = client.attention(TEXT, ablate="2.2z,3.1m", format="u8")
    assert attention.ablate == echo and client.attention(TEXT, format="u8").ablate is None
    assert client.lens(TEXT, ablate=ONE_ABLATION[3]).ablate == echo
    assert client.explain(TEXT, layer=0, head=0, query=1, ablate=ONE_ABLATION[2]).ablate == echo
    generated = client.generate("ROMEO.", max_new_tokens=4, temperature=0, ablate="2.2z,3.1m")
    assert generated.ablate == echo and bodies[-1]["ablate"] == ONE_ABLATION[2]
    stream = client.stream("ROMEO.", max_new_tokens=4, temperature=0, ablate=ONE_ABLATION[3])
    assert [t.id for t in stream] == [t.id for t in generated.tokens] and stream.done.ablate == echo
    assert client.generate("ROMEO.", max_new_tokens=1).ablate is None


def test_the_text_form_reads_the_pages_grammar_and_refuses_the_rest():
    assert attnlens.parse_ablation("cross:0.1m, 2.3") == [attnlens.Ablation(0, 1, "mean", "cross"),
                                                          attnlens.Ablation(2, 3, "zero")]
    assert attnlens.parse_ablation("") == [] and ablate_body(None) is None and ablate_body("") == []
    for bad in ("2", "2.2x", "a.b", "-1.2z", "2.2.2"):
        with pytest.raises(ValueError, match="ablate: cannot read"):
            attnlens.parse_ablation(f"1.1z,{bad}")
    with pytest.raises(TypeError, match="ablate: an entry is a dict"):
        ablate_body([(2, 2)])


def test_a_bad_ablation_raises_naming_ablate(sent):
    client, _ = sent
    calls = [lambda a: client.logits(TEXT, ablate=a), lambda a: client.lens(TEXT, ablate=a),
             lambda a: client.explain(TEXT, layer=0, head=0, query=0, ablate=a),
             lambda a: client.attention(TEXT, ablate=a, format="u8"),
             lambda a: client.generate("ROMEO.", max_new_tokens=2, ablate=a),
             lambda a: list(client.stream("ROMEO.", max_new_tokens=2, ablate=a))]
    for call in calls:
        for bad in ("9.0z", "0.8z", "0.0z,0.0m", "cross:0.0z"):
            with pytest.raises(attnlens.BadRequestError) as e:
                call(bad)
            assert (e.value.status, e.value.param, e.value.code) == (400, "ablate", "invalid_ablation"), bad
    with pytest.raises(attnlens.ValidationError) as e:
        client.logits(TEXT, ablate=[{"layer": 0, "head": 0, "how": "halve"}])
    assert e.value.param.startswith("ablate")
    with pytest.raises(attnlens.BadRequestError) as e:
        client.explain(TEXT, layer=4, head=0, query=0)
    assert e.value.param == "layer"
    with pytest.raises(attnlens.BadRequestError) as e:
        client.heads(probe=(100000, 0))
    assert e.value.param == "probe.length"


# --- the async twin ----------------------------------------------------------------------------
def test_the_async_client_gives_the_same_answers(sent, bundled_server):
    client, _ = sent

    async def run():
        async with attnlens.AsyncClient(bundled_server.url) as ac:
            answers = (await ac.heads(probe=(8, 1)), await ac.logits(TEXT, ablate="2.2z"),
                       await ac.lens(SOURCE, model="translator", target="vingt et un"),
                       await ac.explain(SOURCE, model="translator", group="cross", layer=0, head=1, query=1),
                       await ac.generate("ROMEO.", max_new_tokens=4, temperature=0, ablate="1.1m"),
                       [t.id async for t in ac.stream("ROMEO.", max_new_tokens=4, temperature=0, ablate="1.1m")])
            with pytest.raises(attnlens.BadRequestError) as e:
                await ac.lens(TEXT, ablate="7.0z")
            assert e.value.param == "ablate"
            return answers

    atlas, logits, lens, explained, generated, streamed = run_async(run())
    want = client.heads(probe=(8, 1))
    for name, grid in want.scores.items():
        np.testing.assert_array_equal(atlas.scores[name], grid)
    assert atlas.roles == want.roles
    want = client.logits(TEXT, ablate="2.2z")
    np.testing.assert_array_equal(logits.effect.kl, want.effect.kl)
    assert logits.positions == want.positions and logits.ablate == want.ablate
    want = client.lens(SOURCE, model="translator", target="vingt et un")
    assert lens.top == want.top and lens.labels == want.labels
    np.testing.assert_array_equal(lens.actual_prob, want.actual_prob)
    want = client.explain(SOURCE, model="translator", group="cross", layer=0, head=1, query=1)
    for name in EXPLAIN_ARRAYS:
        np.testing.assert_array_equal(getattr(explained, name), getattr(want, name))
    want = client.generate("ROMEO.", max_new_tokens=4, temperature=0, ablate="1.1m")
    assert [t.id for t in generated.tokens] == [t.id for t in want.tokens] == streamed
    assert generated.ablate == want.ablate

"""POST /heads and model/analysis/head_scores.py against the definitions written out here, loop by loop,
on the maps: our own maps (from /attention), and transformers' GPT-2 `output_attentions` (eager)
on the exported weights. The probe, the 4xx answers, every bundled family, the OpenAPI schema."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import BUNDLED, REPO_ROOT
from helpers import sharp_checkpoint

from attnlens.app.serving.head_atlas import probe_ids
from attnlens.model import family_of, load_checkpoint
from attnlens.model.analysis import head_scores as hs
from attnlens.model.analysis.head_atlas_scores import score_heads
from attnlens.model.interop.hf import export_hf

# --- the definitions, written out (TransformerLens head_detector.py, "mul", no exclusions) ---


def ref_self_scores(A: list[list[float]], tokens: list[int], causal: bool) -> dict[str, float]:
    """One head's (T, T) map -> its scores, straight from the definitions."""
    T = len(tokens)
    total = sum(sum(row) for row in A)

    def mul(marks):  # sum(attention * pattern) / sum(attention)
        return sum(A[i][j] for i in range(T) for j in range(T) if marks(i, j)) / total

    if causal:  # detect_head's patterns: earlier keys only
        dup = lambda i, j: j < i and tokens[j] == tokens[i]
    else:  # the bidirectional analogue: any other key
        dup = lambda i, j: j != i and tokens[j] == tokens[i]
    out = {"previous_token": mul(lambda i, j: j == i - 1),
           "duplicate_token": mul(dup),
           "induction": mul(lambda i, j: j >= 1 and dup(i, j - 1) and (j <= i or not causal))}
    if not causal:
        out["next_token"] = mul(lambda i, j: j == i + 1)
    rows = range(1, T)
    out["first_token"] = sum(A[i][0] for i in rows) / (T - 1)
    out["self"] = sum(A[i][i] for i in rows) / (T - 1)
    ent = 0.0
    for i in rows:
        n = i + 1 if causal else T
        ent += -sum(p * math.log(p) for p in A[i][:n] if p > 0) / math.log(n)
    out["entropy"] = ent / (T - 1)
    out["mean_distance"] = sum(A[i][j] * abs(i - j) for i in rows for j in range(T)) / (T - 1)
    return out


def ref_cross_scores(A: list[list[float]]) -> dict[str, float]:
    T, S = len(A), len(A[0])
    align = 0.0
    for t in range(T):
        d = round(t * (S - 1) / (T - 1)) if T > 1 else 0
        align += sum(A[t][j] for j in range(S) if abs(j - d) <= 1)
    return {"alignment": align / T, "first_token": sum(A[t][0] for t in range(T)) / T,
            "entropy": sum(-sum(p * math.log(p) for p in A[t] if p > 0) / math.log(S) for t in range(T)) / T}


def random_maps(L, H, Q, K, causal, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, H, Q, K, generator=g) * 3
    if causal:
        x = x.masked_fill(torch.triu(torch.ones(Q, K, dtype=torch.bool), 1), float("-inf"))
    return x.softmax(-1)


TOKENS = [0, 5, 6, 7, 5, 6, 7, 9, 5]  # repeats in both directions


@pytest.mark.parametrize("causal", [True, False])
def test_self_scores_equal_the_definitions(causal):
    maps = random_maps(2, 3, len(TOKENS), len(TOKENS), causal)
    mine = hs.self_group_scores(maps, torch.tensor(TOKENS), causal)
    for layer in range(2):
        for head in range(3):
            ref = ref_self_scores(maps[layer, head].tolist(), TOKENS, causal)
            assert set(mine) == set(ref)
            for name, value in ref.items():
                assert float(mine[name][layer, head]) == pytest.approx(value, abs=1e-6), name


def test_causal_detection_scores_are_the_evaluation_reports():
    """model/evaluation/evaluate_decoder.py reads the same definitions (no copies of its own)."""
    from attnlens.model.evaluation import evaluate_decoder as decoder

    assert decoder.mul_score is hs.mul_score and decoder.PATTERNS is hs.PATTERNS
    maps = random_maps(1, 2, len(TOKENS), len(TOKENS), True)
    mine = hs.self_group_scores(maps, torch.tensor(TOKENS), True)
    for name, make in decoder.PATTERNS.items():
        assert torch.allclose(mine[name], decoder.mul_score(maps, make(torch.tensor(TOKENS))))


def test_cross_scores_equal_the_definitions():
    maps = random_maps(2, 2, 5, 8, False, seed=1)
    mine = hs.cross_group_scores(maps)
    for layer in range(2):
        for head in range(2):
            for name, value in ref_cross_scores(maps[layer, head].tolist()).items():
                assert float(mine[name][layer, head]) == pytest.approx(value, abs=1e-6), name


def test_a_diagonal_cross_head_aligns_and_a_fixed_one_does_not():
    T, S = 6, 11
    diagonal, fixed = torch.zeros(T, S), torch.zeros(T, S)
    for t in range(T):
        diagonal[t, round(t * (S - 1) / (T - 1))] = 1
        fixed[t, S - 1] = 1
    scores = hs.cross_group_scores(torch.stack([diagonal, fixed])[None])
    assert scores["alignment"].tolist() == [[1.0, pytest.approx(1 / T)]]
    assert hs.roles({k: float(v[0, 0]) for k, v in scores.items()})[0] == "alignment"


def test_roles_pick_the_score_furthest_over_its_threshold():
    assert hs.roles({"previous_token": 0.9, "first_token": 0.6, "entropy": 0.2}) == ("previous_token", 0.9)
    assert hs.roles({"previous_token": 0.1, "induction": 0.1, "entropy": 0.5}) == ("mixed", 0.5)
    assert hs.roles({"entropy": 0.97, "first_token": 0.1}) == ("broad", 0.97)
    assert hs.roles({"self": None, "first_token": float("nan")}) == ("mixed", None)


# --- on the exported GPT-2: transformers' own maps -------------------------------------------


@pytest.fixture(scope="module")
def sharp_gpt2(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    ours = sharp_checkpoint(root, seed=7, context_length=64)
    return load_checkpoint(ours), export_hf(ours, root / "gpt2")


def test_scores_equal_the_definitions_on_transformers_attentions(sharp_gpt2):
    transformers = pytest.importorskip("transformers")
    ours, exported = sharp_gpt2
    hf = transformers.GPT2LMHeadModel.from_pretrained(exported, attn_implementation="eager").eval()
    ids = probe_ids(family_of(ours.model), ours.tokenizer, 12, seed=3)
    ids[4] = ids[8]  # a repeat inside the first copy too
    result = score_heads(ours.model, ids)
    with torch.no_grad():
        attentions = hf(torch.tensor([ids]), output_attentions=True).attentions  # L x (1, H, T, T)
    spread = []
    for layer, a in enumerate(attentions):
        for head in range(a.shape[1]):
            ref = ref_self_scores(a[0, head].double().tolist(), ids, causal=True)
            for name, value in ref.items():
                assert result.scores["self"][name][layer, head] == pytest.approx(value, abs=1e-5), name
            spread.append(ref["previous_token"])
    assert max(spread) - min(spread) > 0.05  # the heads differ: the comparison is not vacuous


# --- the probe --------------------------------------------------------------------------------


def test_probe_is_bos_n_random_ordinary_tokens_twice_and_deterministic(ckpt):
    family, tok = family_of(ckpt.model), ckpt.tokenizer
    a = probe_ids(family, tok, 20, seed=5)
    assert a == probe_ids(family, tok, 20, seed=5)
    assert a != probe_ids(family, tok, 20, seed=6)
    assert len(a) == 41 and a[0] == tok.eos_id and a[1:21] == a[21:]
    assert not set(a[1:]) & set(tok.special_ids)


# --- the API ----------------------------------------------------------------------------------


def test_heads_on_ids_equal_the_definitions_on_attentions_maps(client):
    tokens = client.post("/attention", json={"text": "To be, or not to be, to be"}).json()["tokens"]
    ids = [t["id"] for t in tokens]
    maps = client.post("/attention", json={"ids": ids}).json()["attention"]
    r = client.post("/heads", json={"ids": ids})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [t["id"] for t in body["tokens"]] == ids
    assert [g["name"] for g in body["groups"]] == ["self"] and body["groups"][0]["causal"]
    assert body["heads"] == body["groups"][0]["heads"]
    for layer, row in enumerate(body["heads"]):
        for head, cell in enumerate(row):
            assert (cell["layer"], cell["head"]) == (layer, head)
            for name, value in ref_self_scores(maps[layer][head], ids, causal=True).items():
                assert cell["scores"][name] == pytest.approx(value, abs=1e-5), name
            assert cell["role"] in set(body["thresholds"]) | {"mixed"}
    assert set(body["thresholds"]) == {"previous_token", "duplicate_token", "induction", "first_token", "self", "broad"}
    assert "TransformerLens" in body["definitions"]["induction"] and "role" in body["definitions"]


def test_heads_on_the_probe(client):
    r = client.post("/heads", json={"probe": {"kind": "repeated_random", "length": 10, "seed": 3}})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = [t["id"] for t in body["tokens"]]
    assert body["probe"] == {"kind": "repeated_random", "length": 10, "seed": 3}
    assert len(ids) == 21 and ids[1:11] == ids[11:] and body["notes"]
    again = client.post("/heads", json={"probe": {"kind": "repeated_random", "length": 10, "seed": 3}}).json()
    assert again == body
    default = client.post("/heads", json={"probe": {"kind": "repeated_random"}}).json()
    assert default["probe"]["length"] == 31  # min(50, (64 - 1) // 2): the tiny model's context is 64


def test_a_one_token_input_answers_with_the_undefined_scores_null(client):
    r = client.post("/heads", json={"ids": [5]})
    assert r.status_code == 200, r.text
    cell = r.json()["heads"][0][0]
    assert cell["scores"]["previous_token"] == 0.0  # no pattern cell: nothing on it
    assert all(cell["scores"][k] is None for k in ("first_token", "self", "entropy", "mean_distance"))
    assert cell["role"] == "mixed"


@pytest.mark.parametrize("body,status,param", [
    ({}, 422, "text"),
    ({"text": "a", "ids": [1]}, 422, "ids"),
    ({"text": "a", "probe": {"kind": "repeated_random"}}, 422, "probe"),
    ({"probe": {"kind": "shuffled"}}, 422, "probe.kind"),
    ({"probe": {"kind": "repeated_random", "length": 0}}, 422, "probe.length"),
    ({"probe": {"kind": "repeated_random", "length": 32}}, 400, "probe.length"),
    ({"probe": {"kind": "repeated_random", "seed": -1}}, 422, "probe.seed"),
    ({"probe": {"kind": "repeated_random", "seed": 2**32}}, 422, "probe.seed"),
    ({"probe": {"kind": "repeated_random", "extra": 1}}, 422, "probe.extra"),
    ({"ids": list(range(65))}, 400, "ids"),
    ({"ids": [10**6]}, 422, "ids"),
    ({"text": "a", "target": "b"}, 422, "target"),
    ({"text": "a", "model": "nope"}, 404, "model"),
])
def test_heads_refuses_naming_the_field(client, body, status, param):
    r = client.post("/heads", json=body)
    assert r.status_code == status, r.text
    assert r.json()["param"] == param, r.json()


def test_maps_larger_than_the_answer_budget_are_refused_naming_the_input(client):
    budget = client.app.state.attnlens.answers
    limit = budget.limit
    budget.limit = 2 * 4 * 20 * 20 * 4  # the tiny model's maps of 20 tokens, float32
    try:
        assert client.post("/heads", json={"ids": list(range(1, 21))}).status_code == 200
        r = client.post("/heads", json={"ids": list(range(1, 22))})
        assert r.status_code == 400 and r.json()["param"] == "ids" and r.json()["code"] == "answer_too_large"
        r = client.post("/heads", json={"probe": {"kind": "repeated_random", "length": 10}})
        assert r.status_code == 400 and r.json()["param"] == "probe.length"
    finally:
        budget.limit = limit
    assert budget.in_use == 0


def test_heads_is_in_the_openapi_schema(client):
    schema = client.get("/openapi.json").json()
    op = schema["paths"]["/heads"]["post"]
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/HeadsResponse")
    request = schema["components"]["schemas"]["HeadsRequest"]
    assert {tuple(o["required"]) for o in request["oneOf"]} == {("text",), ("ids",), ("probe",)}


# --- every bundled family ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_client():
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    dirs = [REPO_ROOT / "checkpoints" / name for name in BUNDLED]
    if not all((d / "model.safetensors").is_file() for d in dirs):
        pytest.skip("the bundled checkpoints are not all here")
    settings = Settings(model=dirs[0], models=dirs, device="cpu", engine_process=False, warmup=False)
    with TestClient(create_app(settings)) as c:
        yield c


def test_every_bundled_model_answers(bundled_client):
    decoder = bundled_client.post("/heads", json={"probe": {"kind": "repeated_random", "length": 50}}).json()
    assert decoder["family"] == "decoder" and len(decoder["heads"]) == 4 and len(decoder["heads"][0]) == 8

    encoder = bundled_client.post("/heads", json={"model": "encoder", "probe": {"kind": "repeated_random",
                                                                               "length": 20}}).json()
    tok_ids = [t["id"] for t in encoder["tokens"]]
    assert len(tok_ids) == 42 and tok_ids[1:21] == tok_ids[21:41]  # [CLS] r r [SEP]
    group = encoder["groups"][0]
    assert group["bidirectional"] and not group["causal"]
    assert {"next_token", "previous_token", "induction"} <= set(encoder["heads"][0][0]["scores"])
    assert "OTHER" in encoder["definitions"]["induction"]

    tr = bundled_client.post("/heads", json={"model": "translator", "text": "March 3, 2021"})
    assert tr.status_code == 200, tr.text
    tr = tr.json()
    assert [(g["name"], g["rows"], g["columns"]) for g in tr["groups"]] == [
        ("encoder", "tokens", "tokens"), ("decoder", "target_tokens", "target_tokens"),
        ("cross", "target_tokens", "tokens")]
    assert tr["generated_target"] is True and tr["target_tokens"]
    assert set(tr["groups"][2]["heads"][0][0]["scores"]) == {"alignment", "first_token", "entropy"}
    assert "alignment" in tr["thresholds"] and "group:" in tr["definitions"]["induction"]
    fixed = bundled_client.post("/heads", json={"model": "translator", "text": "March 3, 2021",
                                                "target": "3 mars 2021"}).json()
    assert fixed["generated_target"] is False


def test_encoder_and_translator_scores_equal_the_definitions_on_their_attention_maps(bundled_client):
    """The groups are wired to the right maps and definitions: the encoder's (bidirectional) and the
    translator's three groups, against /attention's maps for the same input."""
    post = bundled_client.post
    enc = post("/heads", json={"model": "encoder", "text": "to be or not to be"}).json()
    maps = post("/attention", json={"model": "encoder", "text": "to be or not to be"}).json()
    ids = [t["id"] for t in enc["tokens"]]
    assert ids == [t["id"] for t in maps["tokens"]]  # framed as /attention frames it: [CLS] ... [SEP]
    for layer, row in enumerate(enc["heads"]):
        for head, cell in enumerate(row):
            for name, value in ref_self_scores(maps["attention"][layer][head], ids, causal=False).items():
                assert cell["scores"][name] == pytest.approx(value, abs=1e-5), name

    request = {"model": "translator", "text": "March 3, 2021", "target": "3 mars 2021"}
    tr, maps = post("/heads", json=request).json(), post("/attention", json=request).json()
    source = [t["id"] for t in tr["tokens"]]
    target = [t["id"] for t in tr["target_tokens"]]
    assert target == [t["id"] for t in maps["translation"]["target_tokens"]]
    expected = {"encoder": lambda l, h: ref_self_scores(maps["attention"][l][h], source, causal=False),
                "decoder": lambda l, h: ref_self_scores(maps["translation"]["decoder"]["attention"][l][h], target,
                                                        causal=True),
                "cross": lambda l, h: ref_cross_scores(maps["translation"]["cross"]["attention"][l][h])}
    for group in tr["groups"]:
        for layer, row in enumerate(group["heads"]):
            for head, cell in enumerate(row):
                ref = expected[group["name"]](layer, head)
                assert set(cell["scores"]) == set(ref)
                for name, value in ref.items():
                    assert cell["scores"][name] == pytest.approx(value, abs=1e-5), (group["name"], name)

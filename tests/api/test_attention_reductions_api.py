"""POST /attention's reductions over HTTP (pool, top_k, rows / cols) on the three bundled models,
every format: each equals the full answer of the same request, reduced here the plain way. The
model-side blocks are proven against the families' explicit forward in test_attention_blocks.py."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.codec import PRECISION, decode, decode_positions

TEXT = ("Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds "
        "that lour'd upon our house in the deep bosom of the ocean buried.")
MODELS = {"default": TEXT, "encoder": TEXT, "translator": "the cat sees the small dog and the old bird"}


def groups(answer: dict) -> dict[str, dict]:
    """Each group's fields by name (the primary one at the top level, the others under translation)."""
    names = [g["name"] for g in answer["groups"]]
    return {names[0]: answer, **{n: answer["translation"][n] for n in names[1:]}}


def ask(client, model: str, **body) -> dict:
    r = client.post("/attention", json={"model": model, "text": MODELS[model], "layers": [1, 0], "heads": [2, 0],
                                        **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def full(bundled_client):
    """Every model's full json answer (the translator's greedy target pinned for the reduced ones)."""
    out = {}
    for model in MODELS:
        answer = ask(bundled_client, model)
        target = [t["id"] for t in answer["translation"]["target_tokens"][1:]] if "translation" in answer else None
        out[model] = ({name: decode(g) for name, g in groups(answer).items()}, target)
    return out


def reduced(client, model: str, target, **body) -> dict:
    return ask(client, model, **({"target_ids": target} if target else {}), **body)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("fmt", ["json", "f16", "u8"])
def test_pooled_answers_are_the_full_maps_pooled(bundled_client, full, model, fmt):
    maps, target = full[model]
    answer = reduced(bundled_client, model, target, pool=5, format=fmt)
    for name, fields in groups(answer).items():
        whole = maps[name]
        Q, K = whole.shape[2:]
        re_, ce = fields["row_edges"], fields["col_edges"]
        assert re_[0] == 0 and re_[-1] == Q and ce[0] == 0 and ce[-1] == K
        assert len(re_) == min(5, Q) + 1 and fields["shape"] == [2, 2, len(re_) - 1, len(ce) - 1]
        expected = np.stack([np.stack([whole[..., re_[i]:re_[i + 1], ce[j]:ce[j + 1]].sum(-1).mean(-1)
                                       for j in range(len(ce) - 1)], -1) for i in range(len(re_) - 1)], -2)
        assert np.abs(decode(fields) - expected).max() <= PRECISION[fmt] + 1e-5, name
        assert fields["packing"] == "full" and fields["rows"] == [0, Q] and fields["cols"] == [0, K]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("fmt", ["json", "u8"])
def test_top_k_answers_are_each_rows_heaviest_keys(bundled_client, full, model, fmt):
    maps, target = full[model]
    answer = reduced(bundled_client, model, target, top_k=3, format=fmt)
    for name, fields in groups(answer).items():
        whole = maps[name]
        weights, positions = decode(fields), decode_positions(fields)
        assert positions.shape == weights.shape == (2, 2, whole.shape[2], min(3, whole.shape[3]))
        taken = np.take_along_axis(whole, np.maximum(positions, 0), -1)
        assert np.abs(np.where(positions >= 0, taken, 0) - weights).max() <= PRECISION[fmt] + 1e-5
        expected = -np.sort(-whole, axis=-1)[..., :weights.shape[-1]]  # the k heaviest, in order
        assert np.abs(np.where(positions >= 0, taken, 0) - expected).max() <= 1e-5, name


@pytest.mark.parametrize("model", list(MODELS))
def test_a_window_is_the_full_maps_cut(bundled_client, full, model):
    maps, target = full[model]
    packing = "tril" if model == "default" else "full"  # a window of a causal map is still sent full
    answer = reduced(bundled_client, model, target, rows=[2, 9], cols=[1, 6], format="f16", packing=packing)
    for name, fields in groups(answer).items():
        whole = maps[name]
        a, b = min(2, whole.shape[2]), min(9, whole.shape[2])  # clipped to each group's axes
        c, d = min(1, whole.shape[3]), min(6, whole.shape[3])
        assert fields["rows"] == [a, b] and fields["cols"] == [c, d] and fields["packing"] == "full"
        assert np.abs(decode(fields) - whole[..., a:b, c:d]).max() <= PRECISION["f16"]


def test_a_pooled_window(bundled_client, full):
    maps, _ = full["default"]
    answer = reduced(bundled_client, "default", None, pool=3, rows=[10, 20], cols=[0, 20])
    re_, ce = answer["row_edges"], answer["col_edges"]
    assert re_[0] == 10 and re_[-1] == 20 and ce == [0, 6, 13, 20]
    whole = maps["self"]
    expected = np.stack([np.stack([whole[..., re_[i]:re_[i + 1], ce[j]:ce[j + 1]].sum(-1).mean(-1)
                                   for j in range(3)], -1) for i in range(3)], -2)
    assert np.abs(decode(answer) - expected).max() <= 1e-5


@pytest.mark.parametrize("body,field,status", [
    ({"pool": 4, "top_k": 2}, "top_k", 422),
    ({"pool": 0}, "pool", 422),
    ({"top_k": 0}, "top_k", 422),
    ({"rows": [5, 3]}, "rows", 422),
    ({"rows": [-1, 3]}, "rows", 422),
    ({"cols": [1, 2, 3]}, "cols", 422),
    ({"rows": [500, 600]}, "rows", 400),
    ({"cols": [500, 600]}, "cols", 400),
])
def test_bad_reductions_name_their_field(bundled_client, body, field, status):
    r = bundled_client.post("/attention", json={"text": TEXT, **body})
    assert r.status_code == status, r.text
    if status == 422:
        assert any(field in e["loc"] for e in r.json()["detail"])
    else:
        assert r.json()["param"] == field and "past the last" in r.json()["detail"]


def test_an_answer_over_the_budget_names_a_pool_that_fits(tiny_checkpoint):
    settings = Settings(model=tiny_checkpoint, device="cpu", engine_process=False, max_answer_bytes=200_000)
    with TestClient(create_app(settings)) as client:
        body = {"text": TEXT[:60]}
        r = client.post("/attention", json=body)
        assert r.status_code == 400 and r.json()["code"] == "answer_too_large"
        message = r.json()["detail"]
        assert "use pool: " in message
        bins = int(message.split("use pool: ")[1].split(",")[0])
        assert client.post("/attention", json={**body, "pool": bins}).status_code == 200


def test_openapi_declares_the_reductions(bundled_client):
    schema = bundled_client.get("/openapi.json").json()["components"]["schemas"]
    props = schema["AttentionRequest"]["properties"]
    assert {"pool", "top_k", "rows", "cols"} <= set(props)
    assert {"row_edges", "col_edges", "positions", "rows", "cols"} <= set(schema["AttentionResponse"]["properties"])


def test_the_client_reads_reduced_answers(bundled_server, full):
    import attnlens

    maps, _ = full["default"]
    with attnlens.Client(bundled_server.url) as client:
        pooled = client.attention(TEXT, model="default", layers=[1, 0], heads=[2, 0], pool=4, format="u8")
        top = client.attention(TEXT, model="default", layers=[1, 0], heads=[2, 0], top_k=2, rows=(5, 9))
    g = pooled.groups["self"]
    assert g.kind == "pool" and g.row_edges[-1] == maps["self"].shape[2] and pooled.maps.shape == (2, 2, 4, 4)
    t = top.groups["self"]
    assert t.kind == "top_k" and t.query_range == (5, 9) and t.positions.shape == (2, 2, 4, 2)
    assert np.allclose(np.take_along_axis(maps["self"][:, :, 5:9], t.positions.astype(np.int64), -1), t.maps,
                       atol=1e-5)


def test_local_attention_reduces_as_the_server_does(full):
    from helpers import REPO_ROOT

    import attnlens.local

    maps, _ = full["default"]
    answer = attnlens.local.attention(TEXT, REPO_ROOT / "checkpoints" / "default", layers=[1, 0], heads=[2, 0],
                                      rows=(3, 12), cols=(0, 12))
    assert answer.groups["self"].query_range == (3, 12)
    assert np.abs(answer.maps - maps["self"][:, :, 3:12, :12]).max() <= 1e-5

"""POST /v1/embeddings: an encoder's sentence embeddings in OpenAI's shape. Answers are checked
against the encoder run directly (hidden states, the mean over the real tokens or [CLS], L2
normalised), a batch against the same texts one by one, base64 against float, the refusals
(dimensions, a decoder, too many inputs, too long, token ids), and the official `openai` client
and attnlens.Client against a live server."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from encoder_helpers import make_tiny_encoder
from fastapi.testclient import TestClient
from helpers import REPO_ROOT
from live_server import live_server

from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.model import load_checkpoint
from attnlens.model.analysis.encoder_outputs import embed_rows, length_batches

MAX_INPUTS = 4
TEXTS = ["To be, or not to be", "the question", "Whether 'tis nobler in the mind to suffer the slings and arrows"]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("emb") / "genre", seed=4)  # pooling "mean", context 64


@pytest.fixture(scope="module")
def cls_dir(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory.mktemp("emb") / "clsenc", seed=6, labels=[], pooling="cls")


@pytest.fixture(scope="module")
def client(tiny_checkpoint, encoder_dir, cls_dir):
    settings = Settings(model=tiny_checkpoint, models=[tiny_checkpoint, encoder_dir, cls_dir], device="cpu",
                        max_embedding_inputs=MAX_INPUTS)
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def enc(encoder_dir):
    return load_checkpoint(encoder_dir)


def direct(ckpt, text: str) -> np.ndarray:
    """The sentence embedding computed here: [CLS] text [SEP] through the encoder to its hidden
    states, pooled (the mean over every position, all real; or position 0), L2-normalised."""
    tok = ckpt.tokenizer
    ids = torch.tensor([[tok.cls_id, *tok.encode(text), tok.sep_id]])
    with torch.no_grad():
        hidden = ckpt.model(ids, task="hidden").logits[0]  # (T, C)
    pooled = hidden[0] if ckpt.config.pooling == "cls" else hidden.mean(dim=0)
    return (pooled / pooled.norm()).numpy()


def embed(client, **body) -> httpx.Response:
    return client.post("/v1/embeddings", json=body)


def vectors(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.array([d["embedding"] for d in data], dtype=np.float32)


def error(r: httpx.Response) -> dict:
    return r.json()["error"]


def test_shape_unit_norm_and_the_direct_computation(client, enc):
    r = embed(client, model="genre", input=TEXTS)
    body = r.json()
    assert body["object"] == "list" and body["model"] == "genre"
    assert all(d["object"] == "embedding" for d in body["data"])
    got = vectors(r)
    assert got.shape == (len(TEXTS), enc.config.d_model)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    for text, row in zip(TEXTS, got):
        np.testing.assert_allclose(row, direct(enc, text), atol=1e-5)
    framed = sum(len(enc.tokenizer.encode(t)) + 2 for t in TEXTS)  # [CLS] and [SEP] are read too
    assert body["usage"] == {"prompt_tokens": framed, "total_tokens": framed}


def test_one_string_is_one_embedding(client, enc):
    got = vectors(embed(client, model="genre", input=TEXTS[0]))
    assert got.shape == (1, enc.config.d_model)
    np.testing.assert_allclose(got[0], direct(enc, TEXTS[0]), atol=1e-5)


def test_cls_pooling_reads_the_first_position(client, cls_dir):
    ckpt = load_checkpoint(cls_dir)
    got = vectors(embed(client, model="clsenc", input=TEXTS))
    for text, row in zip(TEXTS, got):
        np.testing.assert_allclose(row, direct(ckpt, text), atol=1e-5)


def test_a_batch_equals_the_texts_one_by_one(client):
    batch = vectors(embed(client, model="genre", input=TEXTS))  # lengths differ: padded, masked
    alone = np.concatenate([vectors(embed(client, model="genre", input=[t])) for t in TEXTS])
    np.testing.assert_allclose(batch, alone, atol=1e-5)


def test_batches_of_similar_lengths_keep_the_input_order(enc):
    tok = enc.tokenizer
    rows = [[tok.cls_id, *tok.encode(t), tok.sep_id] for t in TEXTS * 3]
    assert sorted(i for b in length_batches([len(r) for r in rows], 40) for i in b) == list(range(len(rows)))
    assert length_batches([3, 9, 5], 10) == [[1], [2, 0]]  # longest first; 2 x 5 positions fit in 10
    pad = tok.pad_id if tok.pad_id is not None else 0
    small = embed_rows(enc.model, rows, pad, max_tokens=16)  # one text a forward
    whole = embed_rows(enc.model, rows, pad)
    np.testing.assert_allclose(small, whole, atol=1e-5)
    np.testing.assert_allclose(whole[:3], np.stack([direct(enc, t) for t in TEXTS]), atol=1e-5)


def test_base64_is_little_endian_float32(client):
    plain = vectors(embed(client, model="genre", input=TEXTS))
    r = embed(client, model="genre", input=TEXTS, encoding_format="base64")
    assert r.status_code == 200, r.text
    for d, row in zip(r.json()["data"], plain):
        assert isinstance(d["embedding"], str)
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4"), row)


def test_dimensions_only_the_models_width(client, enc):
    width = enc.config.d_model
    assert vectors(embed(client, model="genre", input="a", dimensions=width)).shape == (1, width)
    r = embed(client, model="genre", input="a", dimensions=8)
    assert r.status_code == 400 and error(r)["param"] == "dimensions"
    assert f"{width}-dimensional" in error(r)["message"]
    r = embed(client, model="genre", input="a", dimensions=0)
    assert r.status_code == 422 and error(r)["param"] == "dimensions"


def test_a_decoder_is_refused_naming_the_encoders(client, tiny_checkpoint):
    r = embed(client, model=tiny_checkpoint.name, input="a")
    assert r.status_code == 400 and error(r)["param"] == "model" and error(r)["code"] == "unsupported_task"
    message = error(r)["message"]
    assert "need an encoder" in message and "decoder" in message and "genre, clsenc" in message
    r = embed(client, model="nope", input="a")
    assert r.status_code == 404 and error(r)["code"] == "model_not_found" and "genre, clsenc" in error(r)["message"]
    # no model: the default (the decoder) cannot, and two encoders could: name one
    r = embed(client, input="a")
    assert r.status_code == 400 and "the default model" in error(r)["message"]


def test_the_one_encoder_is_the_default(tiny_checkpoint, encoder_dir, enc):
    settings = Settings(model=tiny_checkpoint, models=[tiny_checkpoint, encoder_dir], device="cpu", warmup=False)
    with TestClient(create_app(settings)) as c:
        r = embed(c, input=TEXTS[0])
        assert r.json()["model"] == "genre"
        np.testing.assert_allclose(vectors(r)[0], direct(enc, TEXTS[0]), atol=1e-5)


def test_bad_inputs_name_the_field(client):
    r = embed(client, model="genre", input=["a"] * (MAX_INPUTS + 1))
    assert r.status_code == 400 and error(r)["param"] == "input" and error(r)["code"] == "too_many_inputs"
    assert "ATTNLENS_MAX_EMBEDDING_INPUTS" in error(r)["message"]
    r = embed(client, model="genre", input=["a", "to be " * 40])
    assert r.status_code == 400 and error(r)["param"] == "input.1" and error(r)["code"] == "context_length_exceeded"
    assert "more than the 62" in error(r)["message"]
    r = embed(client, model="genre", input="x" * 100_000)  # its bytes alone prove it too long: not tokenised
    assert r.status_code == 400 and error(r)["param"] == "input" and error(r)["code"] == "prompt_too_long"
    for ids in ([1, 2, 3], [[1, 2], [3]]):
        r = embed(client, model="genre", input=ids)
        assert r.status_code == 400 and error(r)["param"] == "input" and "token ids" in error(r)["message"]
    r = embed(client, model="genre", input=[])
    assert r.status_code == 422 and error(r)["param"] == "input"
    r = embed(client, model="genre", input=["a", ""])
    assert r.status_code == 422 and error(r)["param"] == "input.1"
    r = embed(client, model="genre", input="a", encoding_format="f16")
    assert r.status_code == 422 and error(r)["param"] == "encoding_format"
    r = embed(client, model="genre", input="a", user="someone")
    assert r.status_code == 200  # accepted, not used


def test_models_lists_embeddings_among_an_encoders_tasks(client):
    by_name = {m["name"]: m for m in client.get("/models").json()["models"]}
    assert "embeddings" in by_name["genre"]["tasks"] and by_name["clsenc"]["pooling"] == "cls"
    assert "embeddings" not in next(m for m in by_name.values() if m["family"] == "decoder")["tasks"]


def test_the_bundled_encoder():
    path = REPO_ROOT / "checkpoints" / "encoder"
    if not (path / "model.safetensors").is_file():
        pytest.skip("the bundled encoder is not in checkpoints/encoder")
    settings = Settings(model=path, models=[path], device="cpu", warmup=False)
    with TestClient(create_app(settings)) as c:
        got = vectors(embed(c, model="encoder", input=["O Romeo, Romeo!", "Friends, Romans, countrymen"]))
    assert got.shape == (2, 256)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoint, encoder_dir):
    env = {"ATTNLENS_MODELS": f"{tiny_checkpoint},{encoder_dir}", "ATTNLENS_LOG_LEVEL": "warning",
           "OMP_NUM_THREADS": "1"}
    with live_server(tiny_checkpoint, tmp_path_factory.mktemp("emb-logs"), env=env) as s:
        yield s


def test_the_openai_client_float_and_base64(server, enc):
    openai = pytest.importorskip("openai")
    oai = server.openai_client()
    want = np.stack([direct(enc, t) for t in TEXTS])
    floats = oai.embeddings.create(model="genre", input=TEXTS, encoding_format="float")
    assert floats.model == "genre" and [d.index for d in floats.data] == [0, 1, 2]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), want, atol=1e-5)
    # the client's default: it asks for base64 and decodes it to numbers itself
    default = oai.embeddings.create(model="genre", input=TEXTS)
    np.testing.assert_array_equal(np.array([d.embedding for d in default.data], dtype=np.float32),
                                  np.array([d.embedding for d in floats.data], dtype=np.float32))
    raw = oai.embeddings.create(model="genre", input=TEXTS, encoding_format="base64")  # left as sent
    decoded = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data])
    np.testing.assert_array_equal(decoded, np.array([d.embedding for d in floats.data], dtype=np.float32))
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(model="genre", input="a", dimensions=3)
    assert e.value.body["param"] == "dimensions"


def test_attnlens_client_embeddings(server, enc, tiny_checkpoint):
    import attnlens

    with attnlens.Client(server.base_url) as c:
        answer = c.embeddings(TEXTS, model="genre")
        assert answer.model == "genre" and answer.vectors.shape == (3, enc.config.d_model)
        np.testing.assert_allclose(answer.vectors, np.stack([direct(enc, t) for t in TEXTS]), atol=1e-5)
        assert c.embeddings("the question", model="genre").vectors.shape == (1, enc.config.d_model)
        with pytest.raises(attnlens.BadRequestError) as e:
            c.embeddings(TEXTS, model=tiny_checkpoint.name)  # a decoder
        assert e.value.param == "model"

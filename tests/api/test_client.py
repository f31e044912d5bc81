"""attnlens.Client and AsyncClient against a real server on the three bundled models: every
format and packing decodes to the same maps within the format's precision, typed answers,
streams, and the server's errors as exceptions carrying its param, code and Retry-After."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from conftest import REPO_ROOT
from helpers import RecordingTransport, run_async

import attnlens
from attnlens import local
from attnlens.codec import PRECISION

pytestmark = pytest.mark.slow  # one server on three models, shared by the session

CKPT = REPO_ROOT / "checkpoints"
TEXTS = {"default": "To be, or not to be, that is the question:", "encoder": "O Romeo, Romeo, [MASK] art thou?",
         "translator": "ninety-seven"}
CROSS_PROCESS = 2e-6  # the engine process may block its matmuls differently from this one, and make maps in its kernel


@pytest.fixture(scope="module")
def client(bundled_server):
    with bundled_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    """Exact float32 maps of each model's text, computed in this process (attnlens.local)."""
    return {name: local.attention(text, CKPT / name) for name, text in TEXTS.items()}


def groups_of(answer: attnlens.Attention) -> dict[str, np.ndarray]:
    return {name: g.maps for name, g in answer.groups.items()}


def assert_same_maps(got: attnlens.Attention, want: attnlens.Attention, atol: float) -> None:
    assert [t.id for t in got.tokens] == [t.id for t in want.tokens]
    assert got.layers == want.layers and got.heads == want.heads
    assert got.groups.keys() == want.groups.keys()
    for name, maps in groups_of(want).items():
        assert got.groups[name].maps.dtype == np.float32
        assert got.groups[name].maps.shape == maps.shape, name
        np.testing.assert_allclose(got.groups[name].maps, maps, rtol=0, atol=atol, err_msg=name)


# an encoder's maps are full squares: the server refuses tril (see the errors test)
CASES = [(m, f, p) for m in TEXTS for f in ("json", "f16", "u8") for p in ("full", "tril", None)
         if not (m == "encoder" and p == "tril")]


@pytest.mark.parametrize(("model", "fmt", "packing"), CASES)
def test_every_format_and_packing_decodes_to_the_same_maps(client, reference, model, fmt, packing):
    answer = client.attention(TEXTS[model], model=model, format=fmt, packing=packing)
    assert answer.format == fmt and answer.family == reference[model].family
    assert_same_maps(answer, reference[model], PRECISION[fmt] + CROSS_PROCESS)
    # json is the server's float32 rounded to 6 decimals: exact, as it was sent
    if fmt == "json":
        for name, maps in groups_of(reference[model]).items():
            np.testing.assert_allclose(answer.groups[name].maps, np.round(maps, 6), rtol=0, atol=CROSS_PROCESS)


def test_formats_agree_with_each_other_within_their_precision(client):
    text = "Now is the winter of our discontent made glorious summer"
    exact = client.attention(text, format="json")
    for fmt in ("f16", "u8"):
        other = client.attention(text, format=fmt)
        err = np.abs(other.maps - exact.maps).max()
        assert err <= PRECISION[fmt] + 5e-7, (fmt, err)
        assert err > 0  # a real loss of precision, so the bound is the one being tested
    assert np.abs(client.attention(text, format="u8").maps - exact.maps).max() > PRECISION["f16"]


def test_layer_and_head_subsets_hold_those_maps_under_model_indices(client, reference):
    full = reference["default"]
    answer = client.attention(TEXTS["default"], layers=[3, 1], heads=[5, 0, 2], format="f16")
    assert answer.layers == [3, 1] and answer.heads == [5, 0, 2]
    assert answer.maps.shape == (2, 3, full.T, full.T)
    np.testing.assert_allclose(answer.head(1, 2), full.head(1, 2), atol=PRECISION["f16"] + CROSS_PROCESS)
    np.testing.assert_allclose(answer.maps[0, 0], full.maps[3, 5], atol=PRECISION["f16"] + CROSS_PROCESS)
    with pytest.raises(KeyError, match="layer 0 is not in this answer"):
        answer.head(0, 0)
    cross = client.attention(TEXTS["translator"], model="translator", layers=[2], heads=[1, 3], format="u8")
    want = reference["translator"]
    np.testing.assert_allclose(cross.head(2, 3, "cross"), want.head(2, 3, "cross"), atol=PRECISION["u8"] + CROSS_PROCESS)


def test_the_translator_answer_names_its_three_groups(client, reference):
    answer = client.attention(TEXTS["translator"], model="translator", format="f16")
    S, T = answer.T, len(answer.target_tokens)
    assert answer.generated is True and answer.target_tokens[0].text == "<|endoftext|>"
    assert answer.encoder.maps.shape[-2:] == (S, S) and answer.decoder.maps.shape[-2:] == (T, T)
    assert answer.cross.maps.shape[-2:] == (T, S)
    assert answer.cross.rows == answer.target_tokens and answer.cross.cols == answer.tokens
    assert answer.decoder.causal and not answer.cross.causal
    assert np.all(np.triu(answer.decoder.maps, 1) == 0)
    np.testing.assert_allclose(answer.cross.maps.sum(-1), 1, atol=S * PRECISION["f16"])
    with pytest.raises(AttributeError, match="no 'cross' group"):
        client.attention("To be", format="u8").cross
    given = client.attention(TEXTS["translator"], model="translator", target="quatre-vingt-dix-sept")
    assert given.generated is False


def test_packing_left_to_the_client_is_the_smaller_one_the_model_allows(bundled_server):
    transport = RecordingTransport()
    with attnlens.Client(bundled_server.url, transport=transport) as c:
        c.attention("To be", format="u8")
        c.attention("To be", model="encoder", format="u8")
        c.attention("seven", model="translator", format="u8")
        c.attention("To be", format="u8", packing="full")
    assert [b["packing"] for b in transport.bodies] == ["tril", "full", "tril", "full"]


def test_typed_answers_of_models_fill_mask_and_classify(client):
    models = {m.name: m for m in client.models()}
    assert set(models) == {"default", "encoder", "translator"}
    assert models["default"].default and models["encoder"].attention == "bidirectional"
    assert models["encoder"].labels == ["comedy", "history", "tragedy"]
    filled = client.fill_mask("The [MASK] of Denmark. To [MASK].", model="encoder", top_k=3)
    assert len(filled.masks) == 2 and all(len(row) == 3 for row in filled.masks)
    best = filled.masks[0][0]
    assert isinstance(best, attnlens.FillMaskCandidate)
    assert best.sequence.startswith("The" + best.token_str) and 0 < best.score <= 1
    labels = client.classify("O Romeo, Romeo", model="encoder")
    assert {l.label for l in labels.labels} == {"comedy", "history", "tragedy"}
    assert labels.label == labels.labels[0].label and abs(sum(l.score for l in labels.labels) - 1) < 1e-5
    assert client.model_info("encoder")["name"] == "encoder"


def test_generate_and_stream_give_typed_tokens(client):
    options = dict(max_new_tokens=6, temperature=0, logprobs=2, return_attention=True)
    gen = client.generate("ROMEO.", **options)
    assert isinstance(gen, attnlens.Generation) and gen.usage.completion_tokens == len(gen.tokens)
    first = gen.tokens[0]
    assert first.attention.shape == (4, 8, len(gen.prompt_tokens)) and len(first.top_logprobs) == 2
    assert gen.ids[: len(gen.prompt_tokens)] == [t.id for t in gen.prompt_tokens]
    stream = client.stream("ROMEO.", **options)
    tokens = list(stream)
    assert [t.id for t in tokens] == [t.id for t in gen.tokens]  # greedy: the same tokens
    assert [t.index for t in tokens] == list(range(len(tokens)))
    assert all(isinstance(t, attnlens.GeneratedToken) for t in tokens)
    assert stream.done.finish_reason == gen.finish_reason and stream.text == gen.text
    assert "".join(t.delta for t in tokens) + stream.done.delta == stream.done.text
    np.testing.assert_allclose(tokens[-1].attention, gen.tokens[-1].attention, atol=1e-6)
    prompt_ids = [t.id for t in gen.prompt_tokens]  # the same prompt as token ids: the same tokens
    assert [t.id for t in client.generate(ids=prompt_ids, **options).tokens] == [t.id for t in gen.tokens]
    assert [t.id for t in client.stream(ids=prompt_ids, **options)] == [t.id for t in gen.tokens]
    translated = client.generate("seven", model="translator", max_new_tokens=8, temperature=0, return_attention=True)
    assert translated.tokens[0].cross_attention.shape == (3, 4, len(translated.prompt_tokens))


def test_the_servers_errors_are_exceptions_with_its_param_and_code(client):
    with pytest.raises(attnlens.ValidationError) as e:
        client.attention("To be", layers=[9])
    assert e.value.status == 422 and e.value.param == "layers" and "out of range" in e.value.message
    assert isinstance(e.value, attnlens.BadRequestError)
    with pytest.raises(attnlens.BadRequestError) as e:
        client.attention("word " * 300)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded" and e.value.param == "text"
    with pytest.raises(attnlens.NotFoundError) as e:
        client.attention("To be", model="nope")
    assert e.value.code == "model_not_found" and "translator" in e.value.message
    with pytest.raises(attnlens.ValidationError) as e:
        client.attention("To be", model="encoder", packing="tril")
    assert e.value.param == "packing"
    with pytest.raises(attnlens.BadRequestError) as e:
        client.fill_mask("no mask here", model="encoder")
    assert e.value.code == "no_mask"
    with pytest.raises(attnlens.ValidationError) as e:
        list(client.stream("ROMEO.", max_new_tokens=0))
    assert e.value.param == "max_new_tokens"


def test_a_429_carries_its_retry_after():
    def answer(request):
        return httpx.Response(429, headers={"Retry-After": "3"},
                              json={"detail": "the generation queue is full (64 waiting)", "code": "queue_full"})

    with attnlens.Client("http://attnlens.test", transport=httpx.MockTransport(answer)) as c:
        with pytest.raises(attnlens.RateLimitError) as e:
            c.generate("ROMEO.")
    assert e.value.retry_after == 3.0 and e.value.code == "queue_full" and e.value.status == 429
    assert "queue is full" in str(e.value)


def test_a_stream_error_event_raises_stream_error():
    body = ('event: token\ndata: {"id": 1, "text": "a", "logprob": -0.1, "index": 0, "delta": "a"}\n\n'
            'event: error\ndata: {"message": "the engine has stopped"}\n\n')

    def answer(request):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    with attnlens.Client("http://attnlens.test", transport=httpx.MockTransport(answer)) as c:
        stream = c.stream("ROMEO.")
        with pytest.raises(attnlens.StreamError, match="engine has stopped"):
            for _ in stream:
                pass
    assert [t.text for t in stream.tokens] == ["a"] and stream.done is None


def test_no_server_is_a_connection_error():
    from attnlens.serve import free_port

    with attnlens.Client(f"http://127.0.0.1:{free_port()}", timeout=5) as c:
        with pytest.raises(attnlens.APIConnectionError, match="cannot reach"):
            c.models()
        assert not c.ready()


def test_the_async_client_gives_the_same_answers(client, bundled_server):
    async def run():
        async with attnlens.AsyncClient(bundled_server.url) as ac:
            answer = await ac.attention(TEXTS["translator"], model="translator", format="u8")
            models = await ac.models()
            tokens = [t async for t in ac.stream("ROMEO.", max_new_tokens=5, temperature=0)]
            with pytest.raises(attnlens.NotFoundError):
                await ac.classify("x", model="nope")
            return answer, models, tokens

    answer, models, tokens = run_async(run())  # on its own thread (a browser test may hold this one's loop)
    sync = client.attention(TEXTS["translator"], model="translator", format="u8")
    for name in ("encoder", "decoder", "cross"):
        np.testing.assert_array_equal(answer.groups[name].maps, sync.groups[name].maps)
    assert [m.name for m in models] == [m.name for m in client.models()]
    assert [t.id for t in tokens] == [t.id for t in client.generate("ROMEO.", max_new_tokens=5, temperature=0).tokens]


def test_the_local_path_gives_the_servers_answer(client, reference):
    """attnlens.local computes in this process what /attention answers (json: exact to 6 decimals)."""
    for name, text in TEXTS.items():
        served = client.attention(text, model=name)
        assert served.model == reference[name].model == name
        assert [t.text for t in served.tokens] == [t.text for t in reference[name].tokens]
        assert_same_maps(served, reference[name], PRECISION["json"] + CROSS_PROCESS)
    with pytest.raises(ValueError, match="out of range"):
        local.attention("To be", CKPT / "default", layers=[4])


def test_a_server_that_cannot_start_says_why(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(attnlens.APIConnectionError, match="stopped before it was ready") as e:
        attnlens.Server(broken, timeout=60).start()
    assert "cannot load the model" in str(e.value)

"""The OpenAI-compatible routes in-process: response shapes, logprobs, echo, n, lists of
prompts, streaming chunks and OpenAI-shaped errors. (The official client is exercised
against a real server in test_service_live.py.)"""

from __future__ import annotations

import json

import pytest
from helpers import MAX_NEW, data_chunks
from helpers import reference_ids as ref_ids

from attnlens.model import SamplingParams, generate_tokens


def test_models(client):
    d = client.get("/v1/models").json()
    assert d["object"] == "list" and [m["id"] for m in d["data"]] == ["tiny"]
    assert d["data"][0]["object"] == "model"


def test_completion_shape_and_text(client, ckpt):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "To be", "max_tokens": 10,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "text_completion" and d["id"].startswith("cmpl-") and d["model"] == "tiny"
    assert isinstance(d["created"], int)
    (choice,) = d["choices"]
    ids = ref_ids(ckpt, "To be", 10, temperature=0.0)
    assert choice["index"] == 0 and choice["text"] == ckpt.tokenizer.decode(ids)
    assert choice["logprobs"] is None
    assert choice["finish_reason"] == ("length" if len(ids) == 10 else "stop")
    n_prompt = len(ckpt.tokenizer.encode("To be"))
    assert d["usage"]["prompt_tokens"] == n_prompt
    assert d["usage"]["total_tokens"] == n_prompt + d["usage"]["completion_tokens"]


def test_default_max_tokens_is_16(client):
    d = client.post("/v1/completions", json={"prompt": "To be", "temperature": 0}).json()
    if d["choices"][0]["finish_reason"] == "length":
        assert d["usage"]["completion_tokens"] == 16


def test_logprobs_legacy_form(client, ckpt):
    d = client.post("/v1/completions", json={"prompt": "The slings", "max_tokens": 6, "temperature": 0,
                                             "logprobs": 3}).json()
    choice = d["choices"][0]
    lp = choice["logprobs"]
    tok = ckpt.tokenizer
    ref = list(generate_tokens(ckpt.model, tok.encode("The slings"), 6, SamplingParams(temperature=0.0),
                               n_logprobs=3))
    n = len(lp["tokens"])
    assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) >= 1
    assert lp["tokens"] == [tok.display_text(t.id) for t in ref[:n]]
    assert lp["token_logprobs"] == pytest.approx([t.logprob for t in ref[:n]], abs=1e-5)
    for top, want in zip(lp["top_logprobs"], ref):
        assert isinstance(top, dict) and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(want.top_logprobs[0], abs=1e-5)
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_with_logprobs_scores_the_prompt(client, ckpt):
    prompt = "To be, or"
    d = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                             "echo": True, "logprobs": 1}).json()
    choice = d["choices"][0]
    assert choice["text"].startswith(prompt)
    lp = choice["logprobs"]
    n_prompt = len(ckpt.tokenizer.encode(prompt))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert lp["text_offset"][n_prompt] == len(prompt)  # the first generated token
    # the prompt's scores are the model's: log p(token i | tokens < i)
    import torch

    ids = ckpt.tokenizer.encode(prompt)
    with torch.no_grad():
        logits = ckpt.model(torch.tensor([ids])).logits
    want = torch.log_softmax(logits[0, :-1].float(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp["token_logprobs"][1:n_prompt] == pytest.approx(want.tolist(), abs=1e-5)


def test_echo_with_zero_max_tokens(client):
    d = client.post("/v1/completions", json={"prompt": "To be", "max_tokens": 0, "echo": True}).json()
    assert d["choices"][0]["text"] == "To be" and d["usage"]["completion_tokens"] == 0


def test_n_and_list_of_prompts(client, ckpt):
    d = client.post("/v1/completions", json={"prompt": ["To be", "No more"], "n": 2, "max_tokens": 8,
                                             "temperature": 1.0, "seed": 5}).json()
    assert [c["index"] for c in d["choices"]] == [0, 1, 2, 3]
    for c in d["choices"]:
        prompt = ["To be", "No more"][c["index"] // 2]
        seed = 5 + c["index"] % 2
        assert c["text"] == ckpt.tokenizer.decode(ref_ids(ckpt, prompt, 8, temperature=1.0, seed=seed))


def test_stop_maps_to_stop(client):
    full = client.post("/v1/completions", json={"prompt": "Or to take", "max_tokens": 20, "temperature": 0}).json()
    text = full["choices"][0]["text"]
    ch = next((c for c in text[1:] if c.strip() and c != "\ufffd"), None)
    if ch is None:
        pytest.skip("no usable character in the greedy text")
    d = client.post("/v1/completions", json={"prompt": "Or to take", "max_tokens": 20, "temperature": 0,
                                             "stop": ch}).json()
    assert d["choices"][0]["finish_reason"] == "stop" and d["choices"][0]["text"] == text[: text.index(ch)]


def test_streaming_chunks(client):
    body = {"prompt": "To be", "max_tokens": 8, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()
    r = client.post("/v1/completions", json={**body, "stream": True, "logprobs": 1,
                                             "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = data_chunks(r.text)
    assert chunks[-1] == "[DONE]"
    objs = [json.loads(c) for c in chunks[:-1]]
    assert all(o["object"] == "text_completion" for o in objs)
    with_choices = [o for o in objs if o["choices"]]
    assert "".join(o["choices"][0]["text"] for o in with_choices) == plain["choices"][0]["text"]
    finishes = [o["choices"][0]["finish_reason"] for o in with_choices]
    assert finishes[-1] == plain["choices"][0]["finish_reason"] and all(f is None for f in finishes[:-1])
    assert all(len(o["choices"][0]["logprobs"]["tokens"]) == 1 for o in with_choices[:-1])
    assert objs[-1]["usage"]["total_tokens"] == plain["usage"]["total_tokens"]


def test_streaming_several_choices(client):
    r = client.post("/v1/completions", json={"prompt": ["To be", "No more"], "max_tokens": 5, "temperature": 0,
                                             "stream": True})
    objs = [json.loads(c) for c in data_chunks(r.text)[:-1]]
    done = [o["choices"][0]["index"] for o in objs if o["choices"][0]["finish_reason"]]
    assert sorted(done) == [0, 1]


@pytest.mark.parametrize("patch,param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": MAX_NEW + 1}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 6}, "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": []}, "prompt"),
])
def test_invalid_is_422_in_openai_shape(client, patch, param):
    r = client.post("/v1/completions", json={"prompt": "To be", **patch})
    assert r.status_code == 422
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"].split(".")[0] == param
    assert param in err["message"]


def test_context_overflow_in_openai_shape(client, ckpt):
    prompt = "To be, or not to be, that is"
    n = len(ckpt.tokenizer.encode(prompt))
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 64 - n + 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert f"({n} tokens)" in err["message"] and "64" in err["message"]


def test_413_in_openai_shape(client):
    r = client.post("/v1/completions", content=b"x" * 1_000_001, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

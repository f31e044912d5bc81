"""Issue 11's OpenAI protocol gaps, in-process: the four prompt shapes (string, list of
strings, token ids, list of token-id lists) with ids checked against the vocabulary, a
logprobs entry for every counted completion token (a generated EOS too), unknown model ids
as OpenAI-shaped 404s. (The lm-evaluation-harness request shapes against a live server are
in test_openai_harness.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO_ROOT, make_tiny_checkpoint
from fastapi.testclient import TestClient

from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.model import load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    with TestClient(create_app(Settings(model=tiny_checkpoint, device="cpu", max_new_tokens=32))) as c:
        yield c


def always_eos_checkpoint(path):
    """The tiny model edited so that EOS is by far the likeliest next token everywhere: with the
    final LayerNorm's weight all ones the normalised features sum to zero, so an EOS row of
    +5 * ones scores 5 * sum(ln_f.bias) = 16 at every position."""
    make_tiny_checkpoint(path, tie_embeddings=False)
    ck = load_checkpoint(path)
    with torch.no_grad():
        ck.model.ln_f.weight.fill_(1.0)
        ck.model.ln_f.bias.fill_(0.1)
        ck.model.lm_head.weight[ck.tokenizer.eos_id].fill_(5.0)
    save_checkpoint(path, ck.model, ck.tokenizer)
    return path


@torch.no_grad()
def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T, V) log-probabilities of the next token after each position, from the model itself."""
    out = model(torch.tensor([ids]))
    logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
    return torch.log_softmax(logits[0].float(), dim=-1)


def completion(client, **body):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# --- prompts: string, list of strings, token ids, list of lists of token ids -----------------
def test_the_four_prompt_shapes_agree(client, ckpt):
    tok = ckpt.tokenizer
    texts = ["To be, or not", "Whether 'tis nobler"]
    ids = [tok.encode(t) for t in texts]
    common = {"max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True}
    by_text = completion(client, prompt=texts, **common)
    by_ids = completion(client, prompt=ids, **common)
    one_text = completion(client, prompt=texts[1], **common)
    one_ids = completion(client, prompt=ids[1], **common)
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in by_text["choices"]]
    assert by_ids["choices"][0]["text"].startswith(texts[0])  # echo gives the ids' text
    # the same choice whichever way it was asked (log-probabilities to float tolerance: a batched
    # forward can change their last bits)
    for a, b in [(one_ids["choices"][0], one_text["choices"][0]), (one_ids["choices"][0], by_text["choices"][1])]:
        assert (a["text"], a["finish_reason"]) == (b["text"], b["finish_reason"])
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["text_offset"] == b["logprobs"]["text_offset"]
        assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(b["logprobs"]["token_logprobs"][1:], abs=1e-4)
    assert by_ids["usage"] == by_text["usage"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])


@pytest.mark.parametrize("prompt,param,bad", [
    ([5, 10**6, 7], "prompt", "10000"),
    ([[1, 2], [3, -1]], "prompt.1", "-1"),
])
def test_token_ids_outside_the_vocabulary_are_named(client, prompt, param, bad):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == param and bad in err["message"] and "vocabulary" in err["message"]


@pytest.mark.parametrize("prompt", [[], [[]], [[1], []], ["a", [1]], [1.5]])
def test_malformed_prompts_are_422(client, prompt):
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


# --- model ids ----------------------------------------------------------------------------
def test_unknown_model_is_404_in_openai_shape(client):
    listed = client.get("/v1/models").json()["data"][0]["id"]
    assert completion(client, model=listed, prompt="Hi", max_tokens=1)["model"] == listed
    assert completion(client, prompt="Hi", max_tokens=1)["model"] == listed  # left out: the loaded one
    r = client.post("/v1/completions", json={"model": "gpt-4o", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found" and listed in err["message"]


# --- every counted completion token has its logprobs entry (a generated EOS too) ---------
@pytest.fixture(scope="module")
def eos_client(tmp_path_factory):
    path = always_eos_checkpoint(tmp_path_factory.mktemp("eos") / "always-eos")
    with TestClient(create_app(Settings(model=path, device="cpu", max_new_tokens=8))) as c:
        yield c, load_checkpoint(path)


def test_generated_eos_has_its_logprobs_entry(eos_client):
    client, ck = eos_client
    tok = ck.tokenizer
    prompt = "To be, or not to be"
    ids = tok.encode(prompt)
    d = completion(client, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    (choice,) = d["choices"]
    assert d["usage"]["completion_tokens"] == 1 and choice["finish_reason"] == "stop"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids) + 1
    assert lp["tokens"][-1] == "<|endoftext|>" and choice["text"] == prompt  # EOS adds no text
    assert lp["text_offset"][-1] == len(prompt)
    want = model_logprobs(ck.model, ids)[-1, tok.eos_id].item()
    assert lp["token_logprobs"][-1] == pytest.approx(want, abs=1e-4)
    assert lp["top_logprobs"][-1] == {"<|endoftext|>": pytest.approx(want, abs=1e-4)}


def test_generated_eos_has_its_logprobs_entry_when_streamed(eos_client):
    client, _ = eos_client
    r = client.post("/v1/completions", json={"prompt": "To be", "max_tokens": 3, "logprobs": 0, "stream": True,
                                             "temperature": 0})
    chunks = [json.loads(line[6:]) for line in r.text.split("\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    entries = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    assert entries == ["<|endoftext|>"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# --- bos/eos: the checkpoint's tokenizer and the export both name the end-of-text token -----
def test_checkpoint_and_export_tokenizers_name_eos(tiny_checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    from attnlens.model.interop.hf import export_hf

    tok = load_checkpoint(tiny_checkpoint).tokenizer
    for directory in (tiny_checkpoint, export_hf(tiny_checkpoint, tmp_path / "hf"),
                      *([p] if (p := REPO_ROOT / "checkpoints" / "default").is_dir() else [])):
        hf = transformers.AutoTokenizer.from_pretrained(str(directory))
        assert hf.bos_token == hf.eos_token == "<|endoftext|>", directory
        if directory != REPO_ROOT / "checkpoints" / "default":
            assert hf.eos_token_id == tok.eos_id
            assert hf("To be, or not").input_ids == tok.encode("To be, or not")

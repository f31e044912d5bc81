"""Imported architectures served like the bundled decoder: a small random Llama 3 (GQA, rotary
with llama3 scaling, byte-level BPE) in a real `attnlens serve` process, and a Mistral
(sliding window, SentencePiece-style tokens) in-process; /attention, /generate and
/v1/completions answer, checked against transformers on the same weights."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from live_server import live_server

from attnlens.model import SamplingParams, generate_tokens, load_checkpoint
from attnlens.model.interop.convert import import_checkpoint

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

from arch_helpers import CASES, load_hf, write_hf_checkpoint  # noqa: E402

PROMPT = "To be, or not to be"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-llama")
    src, _ = write_hf_checkpoint(CASES["llama3"], root / "hf", seed=1)
    ours, _ = import_checkpoint(src, root / "llama3")
    return src, ours


@pytest.fixture(scope="module")
def http(llama, tmp_path_factory):
    env = {"ATTNLENS_MAX_CONCURRENT": "4", "OMP_NUM_THREADS": "1", "ATTNLENS_LOG_LEVEL": "warning"}
    with live_server(llama[1], tmp_path_factory.mktemp("served-llama-logs"), env=env) as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            yield client


def maps_and_greedy(src, case, ids: list[int], n: int):
    """transformers' eager maps (L, H, T, T) over ids, and its greedy continuation of them."""
    hf = load_hf(src, case)
    with torch.no_grad():
        maps = torch.stack([a[0] for a in hf(torch.tensor([ids]), output_attentions=True).attentions])
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return maps, out[0, len(ids):].tolist()


def test_a_served_llama_answers_attention_generate_and_completions(llama, http):
    src, ours = llama
    ckpt = load_checkpoint(ours)
    ids = ckpt.tokenizer.encode_prompt(PROMPT)  # BOS first, as transformers' tokenizer(PROMPT) gives them
    assert ids == transformers.AutoTokenizer.from_pretrained(src)(PROMPT)["input_ids"]
    want_maps, want_ids = maps_and_greedy(src, CASES["llama3"], ids, 10)
    info = http.get("/model").json()
    assert info["architecture"]["n_kv_heads"] == 2 and info["context_length"] == 64

    d = http.post("/attention", json={"text": PROMPT, "format": "json"}).json()
    assert d["shape"] == [2, 4, len(ids), len(ids)]  # one map per query head (2 key/value heads)
    assert [t["id"] for t in d["tokens"]] == ids
    assert "".join(t["text"] for t in d["tokens"][1:]) == PROMPT  # spaces shown as spaces, not Ġ
    torch.testing.assert_close(torch.tensor(d["attention"]), want_maps, atol=2e-6, rtol=0)

    g = http.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 10, "temperature": 0, "logprobs": 1}).json()
    eos = ckpt.tokenizer.eos_ids
    want = want_ids[:next((i for i, t in enumerate(want_ids) if t in eos), len(want_ids))]
    got = [t["id"] for t in g["tokens"]]
    assert got[:len(want)] == want and g["usage"]["prompt_tokens"] == len(ids)

    client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key="x", max_retries=0, timeout=60)
    c = client.completions.create(model="llama3", prompt=PROMPT, max_tokens=10, temperature=0)
    assert c.choices[0].text == g["text"]
    chunks = list(client.completions.create(model="llama3", prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == g["text"]


def test_a_mistral_with_its_window_and_sentencepiece_tokens_is_served(tmp_path):
    """In-process: the maps of a prompt longer than the window (8) equal transformers', and
    streamed generation equals the model's own greedy decoding."""
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    src, _ = write_hf_checkpoint(CASES["mistral"], tmp_path / "hf", seed=2)
    ours, _ = import_checkpoint(src, tmp_path / "mistral")
    ckpt = load_checkpoint(ours)
    text = "Whether 'tis nobler in the mind to suffer the slings"
    ids = ckpt.tokenizer.encode_prompt(text)  # <s> first, as transformers' tokenizer(text) gives them
    assert ids == transformers.AutoTokenizer.from_pretrained(src)(text)["input_ids"] and len(ids) > 12
    want_maps, _ = maps_and_greedy(src, CASES["mistral"], ids, 1)
    with TestClient(create_app(Settings(model=ours, device="cpu", warmup=False))) as client:
        d = client.post("/attention", json={"text": text, "format": "json"}).json()
        assert [t["id"] for t in d["tokens"]] == ids
        torch.testing.assert_close(torch.tensor(d["attention"]), want_maps, atol=2e-6, rtol=0)
        assert (torch.tensor(d["attention"])[:, :, -1, :len(ids) - 8] == 0).all()
        tokens = [t["text"] for t in d["tokens"]]
        assert "".join(tokens[1:]) == " " + text and tokens[1].startswith(" ")  # "▁" shown as a space
        g = client.post("/generate", json={"prompt": text, "max_new_tokens": 12, "temperature": 0}).json()
    ref = [t.id for t in generate_tokens(ckpt.model, ids, 12, SamplingParams(temperature=0))]
    ref = ref[:next((i for i, t in enumerate(ref) if t in ckpt.tokenizer.eos_ids), len(ref))]
    assert [t["id"] for t in g["tokens"]] == ref
    assert g["text"] == ckpt.tokenizer.decode_bytes(ref).decode("utf-8", errors="replace")

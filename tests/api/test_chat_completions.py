"""POST /v1/chat/completions (and `messages` on /attention and /generate) on a small random Llama
3-style checkpoint with a chat template, imported with import-hf and served by a real `attnlens
serve`: the official `openai` client works unchanged, the template renders a conversation to
the ids transformers' apply_chat_template gives, and greedy output and log-probabilities equal
transformers' on the same weights."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from helpers import data_chunks
from live_server import live_server

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

NAME = "llama3-chat"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Romeo?"},
                {"role": "assistant", "content": "A Montague."}, {"role": "user", "content": "And Juliet?"}]
NEW = 8


@pytest.fixture(scope="module")
def server(chat_checkpoint, tmp_path_factory):
    env = {"ATTNLENS_MAX_CONCURRENT": "4", "ATTNLENS_MAX_CHAT_MESSAGES": "8", "OMP_NUM_THREADS": "1",
           "ATTNLENS_LOG_LEVEL": "warning"}
    with live_server(chat_checkpoint[1], tmp_path_factory.mktemp("chat-logs"), env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(chat_checkpoint):
    """transformers on the same weights: the conversation's ids (apply_chat_template), its greedy
    continuation (up to a stop id) and each step's log-probabilities."""
    src = chat_checkpoint[0]
    auto = transformers.AutoTokenizer.from_pretrained(src)
    ids = auto.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = list(ids["input_ids"])
    hf = transformers.LlamaForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
        new = out[0, len(ids):].tolist()
        stops = set(hf.generation_config.eos_token_id)
        greedy = new[:next((i for i, t in enumerate(new) if t in stops), len(new))]
        logprobs = torch.log_softmax(hf(torch.tensor([ids + greedy])).logits[0].double(), -1)
    steps = [logprobs[len(ids) - 1 + k] for k in range(len(greedy))]
    return {"ids": ids, "greedy": greedy, "steps": steps, "tokenizer": auto, "text": auto.decode(greedy)}


def test_the_template_renders_the_conversation_to_transformers_ids(http, reference):
    """The attention views and /generate see exactly apply_chat_template's tokens."""
    ids = reference["ids"]
    a = http.post("/attention", json={"messages": CONVERSATION, "layers": [0], "heads": [0]}).json()
    assert [t["id"] for t in a["tokens"]] == ids and a["shape"] == [1, 1, len(ids), len(ids)]
    assert a["tokens"][0]["text"] == "<|begin_of_text|>"
    g = http.post("/generate", json={"messages": CONVERSATION, "max_new_tokens": NEW, "temperature": 0}).json()
    assert [t["id"] for t in g["prompt_tokens"]] == ids
    assert [t["id"] for t in g["tokens"]][:len(reference["greedy"])] == reference["greedy"]


def token_bytes(tok, i: int) -> bytes:
    """A byte-level BPE token's bytes, by GPT-2's byte <-> character table (transformers')."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(to_byte[c] for c in tok.convert_ids_to_tokens(i))


def test_openai_client_greedy_equals_transformers(client, reference):
    r = client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=NEW, temperature=0,
                                       logprobs=True, top_logprobs=3)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == NAME
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.index == 0
    greedy = reference["greedy"]
    entries = choice.logprobs.content
    tok = reference["tokenizer"]
    # token by token: the same tokens as transformers' greedy output, the same log-probabilities
    assert len(entries) == len(greedy)
    assert [bytes(e.bytes) for e in entries] == [token_bytes(tok, i) for i in greedy]
    for e, i in zip(entries, greedy):  # a whole character's token is its text (else a partial one's bytes)
        if bytes(e.bytes).decode("utf-8", "ignore").encode() == bytes(e.bytes):
            assert e.token == tok.decode([i])
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == choice.message.content
    for e, want, step in zip(entries, greedy, reference["steps"]):
        assert e.logprob == pytest.approx(step[want].item(), abs=1e-4)
        assert len(e.top_logprobs) == 3
        best = step.topk(3)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert [bytes(t.bytes) for t in e.top_logprobs] == [token_bytes(tok, i) for i in best.indices.tolist()]
    assert choice.message.content == reference["text"]
    assert choice.finish_reason == ("length" if len(greedy) == NEW else "stop")
    n_prompt = len(reference["ids"])
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == NEW if len(greedy) == NEW else len(greedy) + 1  # a final EOS counts
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens


def test_openai_client_stream(client, reference):
    chunks = list(client.chat.completions.create(model=NAME, messages=CONVERSATION, max_completion_tokens=NEW,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == reference["text"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length" if len(reference["greedy"]) == NEW else "stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(reference["ids"])
    assert all(c.usage is None for c in chunks[:-1])


def test_a_stream_of_two_choices_with_logprobs_equals_the_answer(client):
    kw = dict(model=NAME, messages=CONVERSATION, max_tokens=NEW, temperature=1.0, seed=3, n=2, logprobs=True,
              top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    content, entries = ["", ""], [[], []]
    for chunk in client.chat.completions.create(**kw, stream=True):
        (c,) = chunk.choices
        content[c.index] += c.delta.content or ""
        entries[c.index] += c.logprobs.content if c.logprobs else []
    for i, choice in enumerate(whole.choices):
        assert content[i] == choice.message.content
        assert [(e.token, e.bytes) for e in entries[i]] == [(e.token, e.bytes) for e in choice.logprobs.content]
        assert [e.logprob for e in entries[i]] == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-5)
        assert all(len(e.top_logprobs) == 2 for e in entries[i])


def test_the_stream_ends_with_done(http):
    with http.stream("POST", "/v1/chat/completions", json={"messages": CONVERSATION, "max_tokens": 3,
                                                           "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = data_chunks(r.read().decode())
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_n_choices_and_seed_repeat(client):
    kw = dict(model=NAME, messages=CONVERSATION, max_tokens=NEW, temperature=1.0, n=3, seed=7)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]  # the same seed, the same choices
    assert len(set(texts)) > 1  # choice k samples with seed + k


def test_stop_cuts_the_content(client, reference):
    text = reference["text"]
    if len(text) < 3:
        pytest.skip("the greedy answer is too short to cut")
    stop = text[len(text) // 2:len(text) // 2 + 2]
    r = client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=NEW, temperature=0,
                                       stop=[stop, "never said"])
    assert r.choices[0].message.content == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_max_tokens_and_max_completion_tokens_disagree(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=3, max_completion_tokens=4)
    assert e.value.body["param"] == "max_tokens"
    r = client.chat.completions.create(model=NAME, messages=CONVERSATION, max_tokens=2, max_completion_tokens=2,
                                       temperature=0)
    assert r.usage.completion_tokens <= 2


@pytest.mark.parametrize("body,param,status", [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", 422),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", 422),
    ({"messages": [{"role": "user"}]}, "messages.0.content", 422),
    ({"messages": []}, "messages", 422),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type", 422),
    ({"messages": [{"role": "user", "content": "hi"}] * 9}, "messages", 400),  # ATTNLENS_MAX_CHAT_MESSAGES=8
    ({"messages": [{"role": "user", "content": "hi " * 2000}]}, "messages", 400),  # more than the context
    ({"messages": CONVERSATION, "top_logprobs": 2}, "top_logprobs", 400),
    ({"messages": CONVERSATION, "max_tokens": 10_000}, "max_tokens", 422),
])
def test_bad_requests_name_the_field(http, body, param, status):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_text_parts_are_joined(http):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Who is"},
                                                       {"type": "text", "text": "Romeo?"}]}], "max_tokens": 1}
    joined = {"messages": [{"role": "user", "content": "Who is\nRomeo?"}], "max_tokens": 1}
    a = http.post("/v1/chat/completions", json=parts).json()
    b = http.post("/v1/chat/completions", json=joined).json()
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]


def test_models_list_the_chat_task(http):
    (m,) = http.get("/models").json()["models"]
    assert "chat" in m["tasks"]


def test_a_model_without_a_template_is_a_400_that_says_so(client_tiny):
    """The tiny GPT-2-shaped model (as every bundled one) has no chat template."""
    r = client_tiny.post("/v1/chat/completions", json={"messages": CONVERSATION})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "no_chat_template" and err["param"] == "model" and "chat template" in err["message"]
    r = client_tiny.post("/attention", json={"messages": CONVERSATION})
    assert r.status_code == 400 and r.json()["code"] == "no_chat_template" and r.json()["param"] == "messages"
    r = client_tiny.post("/generate", json={"messages": CONVERSATION, "prompt": "x"})
    assert r.status_code == 422
    r = client_tiny.post("/v1/chat/completions", json={"model": "nope", "messages": CONVERSATION})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client_tiny.post("/v1/chat/completions", json={"model": "genre", "messages": CONVERSATION})  # an encoder
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_task"
    assert "cannot do chat" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def client_tiny(tiny_checkpoint, tmp_path_factory):
    """In-process: the tiny decoder (no template, as every bundled model) and a tiny encoder."""
    from encoder_helpers import make_tiny_encoder
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    encoder = make_tiny_encoder(tmp_path_factory.mktemp("chat-enc") / "genre")
    settings = Settings(model=tiny_checkpoint, models=[tiny_checkpoint, encoder], device="cpu", warmup=False)
    with TestClient(create_app(settings)) as c:
        yield c


def test_openapi_says_exactly_one_input(client_tiny):
    """Generated clients and fuzzers build valid bodies: text | ids | messages, prompt | ids | messages."""
    schemas = client_tiny.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["AttentionRequest"]["oneOf"] == [{"required": [k]} for k in ("text", "ids", "messages")]
    assert schemas["GenerateRequest"]["oneOf"] == [{"required": [k]} for k in ("prompt", "ids", "messages")]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]


@pytest.mark.parametrize("arch", ["qwen2", "llama2"])
def test_other_templates_render_to_transformers_ids(arch, tmp_path):
    """ChatML (Qwen2: byte-level BPE, no BOS) and Llama 2's [INST] template (SentencePiece-style
    pieces, <s> written by the template): /attention's `messages` tokens are apply_chat_template's."""
    from arch_helpers import CASES, write_hf_checkpoint
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings
    from attnlens.model.interop.convert import import_checkpoint

    conversation = [{"role": "user", "content": "To be?"}, {"role": "assistant", "content": "Or not."},
                    {"role": "user", "content": "Why?"}]
    src, _ = write_hf_checkpoint(CASES[arch], tmp_path / "hf", seed=4)
    ours, _ = import_checkpoint(src, tmp_path / arch)
    auto = transformers.AutoTokenizer.from_pretrained(src)
    want = list(auto.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"])
    with TestClient(create_app(Settings(model=ours, device="cpu", warmup=False))) as c:
        a = c.post("/attention", json={"messages": conversation, "layers": [0], "heads": [0]})
        assert a.status_code == 200, a.text
        assert [t["id"] for t in a.json()["tokens"]] == want
        r = c.post("/v1/chat/completions", json={"messages": conversation, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)


def test_the_python_client_takes_messages(server, reference):
    import attnlens

    with attnlens.Client(server.base_url) as c:
        a = c.attention(messages=CONVERSATION, layers=[0], heads=[0])
        assert [t.id for t in a.tokens] == reference["ids"]
        g = c.generate(messages=CONVERSATION, max_new_tokens=3, temperature=0)
        assert [t.id for t in g.prompt_tokens] == reference["ids"]
        assert [t.id for t in g.tokens] == reference["greedy"][:3]
        streamed = c.stream(messages=CONVERSATION, max_new_tokens=3, temperature=0)
        assert [t.id for t in streamed] == reference["greedy"][:3]


def test_explain_routes_take_messages(http, reference):
    """/logits, /lens and /attention/explain read a conversation as /attention does (the template's
    ids); /logits' log-probabilities of the next prompt token equal transformers' on the same weights."""
    ids = reference["ids"]
    r = http.post("/logits", json={"messages": CONVERSATION, "top_k": 2}).json()
    assert [t["id"] for t in r["tokens"]] == ids
    hf = transformers.LlamaForCausalLM.from_pretrained(reference["tokenizer"].name_or_path,
                                                       attn_implementation="eager").eval()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    for p in r["positions"][:-1]:
        t = p["position"]
        assert p["next"]["id"] == ids[t + 1]
        assert p["next_logprob"] == pytest.approx(float(want[t, ids[t + 1]]), abs=1e-4)
    lens = http.post("/lens", json={"messages": CONVERSATION, "top_k": 1}).json()
    assert len(lens["layers"][0]["positions"]) == len(ids)
    e = http.post("/attention/explain", json={"messages": CONVERSATION, "layer": 1, "head": 3,
                                              "query": len(ids) - 1}).json()
    assert max(abs(a - b) for a, b in zip(e["softmax"], e["pattern_row"])) < 1e-6 and e["kv_head"] == 1

"""The request shapes of EleutherAI's lm-evaluation-harness (`local-completions` model)
against a live `attnlens serve`, checking that the scores it would read are the model's own
log-probabilities:

- loglikelihood: `{"prompt": [[ids], ...], "max_tokens": 1, "echo": true, "logprobs": 1,
  "temperature": 0, "seed": 1234}`, read as `sum(token_logprobs[ctxlen:-1])`;
- the same with string prompts (`tokenized_requests=False`) and batched prompt lists;
- generate_until: a list of string prompts with `stop` and `max_tokens`, greedy.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from live_server import live_server

from attnlens.model import SamplingParams, generate_tokens, load_checkpoint

pytestmark = pytest.mark.slow
SEED = 1234


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    with live_server(tiny_checkpoint, tmp_path_factory.mktemp("harness-logs"),
                     env={"ATTNLENS_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"}) as s:
        yield s, load_checkpoint(tiny_checkpoint)


@torch.no_grad()
def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    out = model(torch.tensor([ids]))
    logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
    return torch.log_softmax(logits[0].float(), dim=-1)


def harness_loglikelihood_payload(prompt) -> dict:
    return {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": SEED,
            "echo": True}


def check_scores(choice: dict, ids: list[int], ctxlen: int, ckpt) -> None:
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt's tokens, then the one generated
    ref = model_logprobs(ckpt.model, ids)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
    # what the harness computes: the continuation's log-likelihood and whether it is greedy
    continuation = lp["token_logprobs"][ctxlen:-1]
    assert sum(continuation) == pytest.approx(sum(want[ctxlen - 1:]), abs=1e-3)
    greedy = all(t == max(top.values()) for t, top in zip(continuation, lp["top_logprobs"][ctxlen:-1]))
    assert greedy == all(ref[i - 1].argmax().item() == ids[i] for i in range(ctxlen, len(ids)))


def test_loglikelihood_with_token_id_prompts_batched(served):
    server, ckpt = served
    tok = ckpt.tokenizer
    pairs = [("To be, or not to be,", " that is the question"), ("Whether 'tis nobler", " in the mind"),
             ("No more; and by a sleep", " to say we end")]
    requests = [(tok.encode(c), tok.encode(c) + tok.encode(x)) for c, x in pairs]
    r = httpx.post(server.base_url + "/v1/completions",
                   json=harness_loglikelihood_payload([ids for _, ids in requests]), timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 3
    for choice, (ctx, ids) in zip(choices, requests):
        check_scores(choice, ids, len(ctx), ckpt)


def test_loglikelihood_with_string_prompts(served):
    server, ckpt = served
    tok = ckpt.tokenizer
    texts = ["To be, or not to be, that is the question", "Café naïve résumé — 東京"]
    r = httpx.post(server.base_url + "/v1/completions", json=harness_loglikelihood_payload(texts), timeout=60)
    assert r.status_code == 200, r.text
    for choice, text in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), texts):
        assert choice["text"].startswith(text)
        ids = tok.encode(text)
        check_scores(choice, ids, max(1, len(ids) - 3), ckpt)


def test_loglikelihood_of_a_prompt_one_short_of_the_context(served):
    """The harness truncates to max_length - 1 tokens and asks for one more: that must fit."""
    server, ckpt = served
    ids = (ckpt.tokenizer.encode("To be, or not to be, that is the question: ") * 64)[: ckpt.config.context_length - 1]
    r = httpx.post(server.base_url + "/v1/completions", json=harness_loglikelihood_payload([ids]), timeout=60)
    assert r.status_code == 200, r.text
    check_scores(r.json()["choices"][0], ids, len(ids) - 5, ckpt)


def test_generate_until_batched(served):
    server, ckpt = served
    tok = ckpt.tokenizer
    prompts = ["To be, or not", "And by opposing"]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 12, "temperature": 0, "stop": ["\n\n"], "seed": SEED}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    for choice, prompt in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), prompts):
        ids = [t.id for t in generate_tokens(ckpt.model, tok.encode(prompt), 12, SamplingParams(temperature=0.0))]
        if tok.eos_id in ids:
            ids = ids[: ids.index(tok.eos_id)]
        assert choice["text"] == tok.decode(ids).split("\n\n")[0]

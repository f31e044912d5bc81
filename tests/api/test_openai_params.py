"""Issue 24, the OpenAI protocol: GET /v1/models/{id} (the openai client's models.retrieve),
logit_bias and the presence / frequency penalties as vLLM applies them (per row of the batched
sampler, over that row's generated tokens, before greedy and sampled picks alike; the log-
probabilities stay the model's own), best_of, suffix refused, unknown fields refused, and the
404 of an unknown model listing only the models /v1 can use. References are the model called
directly, step by step, with a full recompute."""

from __future__ import annotations

import asyncio

import pytest
import torch
from encoder_helpers import make_tiny_encoder
from fastapi.testclient import TestClient
from helpers import drain, run_async

from attnlens.app.engine import Engine, GenerationParams
from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.model import SamplingParams
from attnlens.model.decoding import RowSampler, make_generator, sample_rows
from attnlens.model.sampling import draw_uniforms, sample_batch

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(tiny_checkpoint, tmp_path_factory):
    encoder = make_tiny_encoder(tmp_path_factory.mktemp("oa") / "genre")
    settings = Settings(model=tiny_checkpoint, models=[tiny_checkpoint, encoder], device="cpu", max_new_tokens=40)
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="module")
def oa(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


@torch.no_grad()
def reference(ckpt, prompt_ids: list[int], n: int, *, bias: dict[int, float] | None = None, presence: float = 0.0,
              frequency: float = 0.0) -> tuple[list[int], list[float]]:
    """Greedy tokens with vLLM's adjustments, recomputing the whole sequence each step; and each
    chosen token's log-probability under the model's own distribution."""
    ids, out, lps = list(prompt_ids), [], []
    V = ckpt.config.vocab_size
    counts = torch.zeros(V)
    for _ in range(n):
        logits = ckpt.model(torch.tensor([ids])).logits[0, -1].float()
        adjusted = logits - frequency * counts - presence * (counts > 0).float()
        for t, b in (bias or {}).items():
            adjusted[t] += b
        t = int(adjusted.argmax())
        lps.append(float(torch.log_softmax(logits, -1)[t]))
        out.append(t)
        counts[t] += 1
        ids.append(t)
        if t == ckpt.tokenizer.eos_id:
            break
    return out, lps


# --- GET /v1/models/{id} and the 404s of /v1 ---------------------------------------------------
def test_models_retrieve_and_the_404_lists_only_v1_models(client, oa, tiny_checkpoint):
    name = tiny_checkpoint.name
    card = oa.models.retrieve(name)
    assert card.id == name and card.object == "model" and card.owned_by == "attnlens"
    assert [m.id for m in oa.models.list().data] == [name]
    for missing in ("gpt-5", "genre"):  # an encoder is loaded, but /v1 cannot use it
        with pytest.raises(openai.NotFoundError) as e:
            oa.models.retrieve(missing)
        assert e.value.body["code"] == "model_not_found"
    r = client.post("/v1/completions", json={"model": "gpt-5", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert name in message and "genre" not in message, message


# --- logit_bias and the penalties ----------------------------------------------------------------
def test_logit_bias_and_penalties_match_the_reference_per_row_in_one_batch(ckpt):
    """Five generations decoded together, each with its own adjustments (one with none): each
    gives exactly its reference's tokens, and log-probabilities under the model's own distribution."""
    tok = ckpt.tokenizer
    prompt = tok.encode("To be, or not")
    plain, _ = reference(ckpt, prompt, 20)
    favourite, banned = plain[3], plain[0]
    cases = [dict(), dict(presence=1.5), dict(frequency=0.8), dict(presence=-0.5, frequency=1.2),
             dict(bias={favourite: 4.0, banned: -100.0})]
    engine = Engine(ckpt, max_concurrent=8, max_queue=0)

    def params(case):
        return GenerationParams(prompt, 20, SamplingParams(temperature=0.0, logit_bias=case.get("bias"),
                                                           presence_penalty=case.get("presence", 0.0),
                                                           frequency_penalty=case.get("frequency", 0.0)),
                                n_logprobs=1)

    async def main():
        return await asyncio.gather(*(drain(g) for g in engine.submit_all([params(c) for c in cases])))

    try:
        results = run_async(main())
    finally:
        engine.close()
    for case, (tokens, done) in zip(cases, results):
        want, _ = reference(ckpt, prompt, 20, **case)
        want = [t for t in want if t != tok.eos_id]
        assert tokens == want, case
        if case:  # every adjustment changed the answer: the check bites
            assert tokens != results[0][0], case
    assert banned not in results[4][0] and results[4][0].count(favourite) > plain.count(favourite)


def test_sampled_rows_draw_from_their_adjusted_logits():
    """sample_rows: a sampled row with penalties draws, with its own number, from its adjusted
    logits; a greedy row's argmax is over its adjusted logits too; the counts follow the tokens."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    rules = [SamplingParams(temperature=0.9, seed=5, presence_penalty=2.0, frequency_penalty=0.5),
             SamplingParams(temperature=0.0, logit_bias={7: 50.0}),
             SamplingParams(temperature=0.7, seed=9)]
    samplers = [RowSampler(p, make_generator(p.seed)) for p in rules]
    samplers[0].counts = None
    first = sample_rows(logits, samplers)  # counts start at zero: row 0 is unpenalised on its first step
    assert first[1].id == 7
    copies = [make_generator(5), make_generator(9)]
    for g in copies:  # the number each sampled row drew at the first step
        torch.rand(1, generator=g, dtype=torch.float64)
    second = sample_rows(logits, samplers)
    counts = torch.zeros(50)
    counts[first[0].id] += 1
    adjusted = logits[0] - 0.5 * counts - 2.0 * (counts > 0).float()
    u = draw_uniforms([copies[0]])
    assert second[0].id == sample_batch(adjusted[None], [rules[0]], u).item()
    assert samplers[0].counts[first[0].id] == 1 and samplers[0].counts[second[0].id] >= 1
    assert samplers[2].counts is None  # a row without adjustments keeps no counts
    lp = torch.log_softmax(logits, -1)
    assert second[1].logprob == pytest.approx(lp[1, 7].item())  # the model's own log-probability


def test_the_parameters_reach_the_sampler_through_v1(client, ckpt):
    tok = ckpt.tokenizer
    prompt = tok.encode("Whether 'tis nobler")
    plain, _ = reference(ckpt, prompt, 12)
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0,
            "presence_penalty": 1.0, "frequency_penalty": 0.7, "logit_bias": {str(plain[1]): -100}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    want, lps = reference(ckpt, prompt, 12, presence=1.0, frequency=0.7, bias={plain[1]: -100.0})
    choice = r.json()["choices"][0]
    assert choice["text"] == tok.decode([t for t in want if t != tok.eos_id]) and choice["text"] != tok.decode(plain)
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(lps, abs=1e-4)


@pytest.mark.parametrize("bias,where", [({"999999": 1}, "not in the vocabulary"), ({"12": 101}, "-100 to 100"),
                                        ({"x": 1}, "token ids written as strings")])
def test_a_bad_logit_bias_names_itself(client, bias, where):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "logit_bias": bias})
    assert r.status_code in (400, 422) and r.json()["error"]["param"].startswith("logit_bias")
    assert where in r.json()["error"]["message"]


# --- best_of, suffix, unknown fields ------------------------------------------------------------
def test_best_of_returns_the_candidates_with_the_best_logprob_per_token(client, oa):
    common = dict(model="tiny", prompt="To be", max_tokens=8, temperature=1.0, logprobs=0)
    candidates = []
    for k in range(4):  # what best_of generates: seeds 11, 12, 13, 14
        c = oa.completions.create(**common, seed=11 + k).choices[0]
        lps = [lp for lp in c.logprobs.token_logprobs]
        candidates.append((sum(lps) / len(lps), c.text))
    best = oa.completions.create(**common, seed=11, best_of=4, n=2)
    ranked = [text for _, text in sorted(candidates, key=lambda c: -c[0])]
    assert [c.text for c in best.choices] == ranked[:2] and [c.index for c in best.choices] == [0, 1]
    assert len(set(ranked)) > 1  # the candidates differ: picking mattered
    plain = oa.completions.create(**common, seed=11, n=4)
    assert best.usage.completion_tokens == plain.usage.completion_tokens  # every candidate counts


@pytest.mark.parametrize("extra,param", [({"best_of": 1, "n": 2}, "best_of"),
                                         ({"best_of": 3, "stream": True}, "best_of"),
                                         ({"suffix": " the end"}, "suffix")])
def test_what_cannot_be_done_is_a_400_naming_it(client, extra, param):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_unknown_fields_are_refused_and_harmless_ones_accepted(client):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "repetition_penalty": 1.3})
    assert r.status_code == 422 and r.json()["error"]["param"] == "repetition_penalty"
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "user": "u1", "suffix": "",
                                             "best_of": 1, "stream_options": None})
    assert r.status_code == 200, r.text

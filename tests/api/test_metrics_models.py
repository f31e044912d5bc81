"""/metrics with several models: every series carries the model it is about, for every loaded
model (so a dashboard sums or splits across replicas and models)."""

from __future__ import annotations

import re

import pytest
from encoder_helpers import make_tiny_encoder
from fastapi.testclient import TestClient
from helpers import HeldModel, drain, make_tiny_checkpoint

from attnlens.app.engine import GenerationParams
from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings

SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        assert m, line
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m["labels"] or ""))
        out.append((m["name"], labels, float(m["value"])))
    return out


def value(text: str, name: str, **labels) -> float:
    found = [v for n, ls, v in samples(text) if n == name and all(ls.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def three_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    first = make_tiny_checkpoint(root / "first")
    second = make_tiny_checkpoint(root / "second", seed=1)
    words = make_tiny_encoder(root / "words")
    settings = Settings(model=first, models=[first, second, words], device="cpu", warmup=False,
                        engine_process=False, max_concurrent=2, max_queue=1)
    with TestClient(create_app(settings)) as c:
        yield c


def test_every_series_carries_a_model_and_every_model_has_its_gauges(three_models):
    c = three_models
    c.post("/generate", json={"prompt": "To be", "max_new_tokens": 3, "temperature": 0, "model": "second"})
    c.post("/generate", json={"prompt": "To be", "max_new_tokens": 2, "temperature": 0})
    text = c.get("/metrics").text
    every = samples(text)
    assert every and all("model" in labels for _, labels, _ in every), \
        [(n, ls) for n, ls, _ in every if "model" not in ls][:5]
    for model, family, default in (("first", "decoder", "true"), ("second", "decoder", "false"),
                                   ("words", "encoder", "false")):
        assert value(text, "attnlens_model_info", model=model, family=family, default=default) == 1
    for name in ("attnlens_requests_in_flight", "attnlens_queue_depth", "attnlens_generations_running_or_waiting",
                 "attnlens_attention_in_flight", "attnlens_engine_step_errors",
                 "attnlens_engine_cancelled_requests", "attnlens_kv_cache_used_bytes"):
        # an encoder runs its calls through an engine like the others: its gauges too
        assert value(text, name, model="first") == 0 and value(text, name, model="second") == 0
        assert value(text, name, model="words") == 0
    # what each request counted is labelled with the model it named, or the default one
    assert value(text, "attnlens_generated_tokens_total", model="second") == 3
    assert value(text, "attnlens_generated_tokens_total", model="first") == 2
    assert value(text, "attnlens_http_requests_total", model="second", route="/generate", status="200") == 1
    assert value(text, "attnlens_http_requests_total", model="first", route="/generate", status="200") == 1
    assert value(text, "attnlens_time_to_first_token_seconds_count", model="second") == 1
    assert value(text, "attnlens_generations_total", model="second", finish_reason="length") == 1


def test_an_encoder_request_and_a_refusal_carry_their_model(three_models):
    c = three_models
    assert c.post("/fill-mask", json={"text": "To be [MASK]", "model": "words"}).status_code == 200
    assert c.post("/generate", json={"prompt": "x", "model": "words"}).status_code == 400  # an encoder cannot
    assert c.post("/generate", json={"prompt": "x", "model": "nobody"}).status_code == 404
    text = c.get("/metrics").text
    assert value(text, "attnlens_http_requests_total", model="words", route="/fill-mask", status="200") == 1
    assert value(text, "attnlens_http_requests_total", model="words", route="/generate", status="400") == 1
    # no such model: the request is counted under the default one, never under a name a client made up
    assert value(text, "attnlens_http_requests_total", model="first", route="/generate", status="404") == 1
    assert not [ls for n, ls, _ in samples(text) if ls.get("model") == "nobody"]


def test_the_load_gauge_is_running_plus_waiting_per_model(three_models):
    """attnlens_generations_running_or_waiting (the autoscaler's metric) is what the engine of that
    model holds, running or waiting, at the scrape; the other engine's stays 0. A request refused
    by the full engine is counted for its model."""
    c = three_models
    engine = c.app.state.attnlens.registry.get("second").runner
    real = engine.client.core.model
    held = engine.client.core.model = HeldModel(real, hold_at=2)  # after the first forward (the prompts), everything stays
    ids = engine.tokenizer.encode("To be")

    async def submit():
        return engine.submit_all([GenerationParams(ids, 3) for _ in range(3)])  # 2 slots, 1 place in line

    async def finish(generations):
        return [await drain(g) for g in generations]

    try:
        generations = c.portal.call(submit)
        assert held.held.wait(30)
        text = c.get("/metrics").text
        running = value(text, "attnlens_requests_in_flight", model="second")
        waiting = value(text, "attnlens_queue_depth", model="second")
        assert running >= 1 and running + waiting == 3
        assert value(text, "attnlens_generations_running_or_waiting", model="second") == 3
        assert value(text, "attnlens_generations_running_or_waiting", model="first") == 0
        # the running generations' blocks of the KV cache, within its budget
        assert 0 < value(text, "attnlens_kv_cache_used_bytes", model="second") \
            < value(text, "attnlens_kv_cache_budget_bytes", model="second")
        full = c.post("/generate", json={"prompt": "To be", "max_new_tokens": 2, "model": "second"})
        assert full.status_code == 429
        text = c.get("/metrics").text
        assert value(text, "attnlens_rejected_total", model="second", reason="queue_full") == 1
        assert not [ls for n, ls, _ in samples(text) if n == "attnlens_rejected_total" and ls["model"] != "second"]
    finally:
        held.release.set()
    assert all(last.finish_reason == "length" for _, last in c.portal.call(finish, generations))
    engine.client.core.model = real
    text = c.get("/metrics").text
    assert value(text, "attnlens_generations_running_or_waiting", model="second") == 0
    assert value(text, "attnlens_kv_cache_used_bytes", model="second") == 0  # the blocks went back

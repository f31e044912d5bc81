"""Issue 11's defects, each as its own test, against the service in-process (TestClient runs
the lifespan) on the tiny random model. Live-server checks (slow readers, event-loop
latency, request timeouts) are in test_service_reliability_live.py."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from app.main import create_app
from app.settings import Settings
from model import SamplingParams
from model.generate import filter_logits


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    settings = Settings(model=tiny_checkpoint, device="cpu", max_new_tokens=32)
    with TestClient(create_app(settings)) as c:
        yield c


# --- defect 4: a top_p the schema accepts never gives a 500 ------------------------------
@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-9])
def test_filter_logits_tiny_top_p_keeps_the_top_token(top_p):
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    out = filter_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
    probs = torch.softmax(out, dim=-1)
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]  # only the most likely token is left
    assert (torch.isfinite(out).sum(dim=-1) == 1).all()


@pytest.mark.parametrize("stream", [False, True])
def test_generate_with_tiny_top_p_is_greedy_not_500(client, stream):
    body = {"prompt": "Hello", "max_new_tokens": 4, "temperature": 1.0, "top_p": 1e-300, "stream": stream}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert "event: error" not in r.text
    greedy = client.post("/generate", json={**body, "temperature": 0, "top_p": 1.0, "stream": False}).json()
    if not stream:
        assert [t["id"] for t in r.json()["tokens"]] == [t["id"] for t in greedy["tokens"]]


def test_v1_with_tiny_top_p_is_not_500(client):
    r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "top_p": 5e-324})
    assert r.status_code == 200, r.text

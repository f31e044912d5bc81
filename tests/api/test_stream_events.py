"""A streamed token's attention rows: arrays from the output stage to the JSON text.

A stream writer whose client reads nothing holds the last events it built while its write
waits. With a Python float per probability, 64 such streams held ~60 MB of floats in Python's
small-object arenas, which stay mapped while any object in them lives: the server kept tens
of MB after the clients left (test_service_faults_live.py's unread streams). The events hold
arrays instead, and their JSON is the text pydantic writes for the same floats."""

from __future__ import annotations

import sys

import numpy as np
import torch

from attnlens.app.api.generate_schemas import StreamToken
from attnlens.app.engine.outputs import Alternative, TokenEvent, attention_rows
from attnlens.app.serving.generation_streams import sse, token_event


def probabilities(layers: int, heads: int, keys: int, seed: int = 0) -> list[torch.Tensor]:
    """A step's attention rows as the engine hands them over: per layer (heads, keys) float32,
    with the values whose JSON has exponents (1e-6) or none (0.0, 1.0)."""
    rng = np.random.default_rng(seed)
    rows = [torch.from_numpy(rng.random((heads, keys), dtype=np.float32) ** 6) for _ in range(layers)]
    rows[0][0, :4] = torch.tensor([0.0, 1.0, 1e-6, 4e-7])
    return rows


def event(attention, cross=None) -> TokenEvent:
    return TokenEvent(id=7, text="a", logprob=-0.25, top_logprobs=[Alternative(3, "b", -1.5)], index=2, delta="a",
                      attention=attention, cross_attention=cross)


def test_a_token_events_json_is_what_pydantic_writes_for_its_floats():
    for cross in (None, probabilities(2, 4, 5, seed=1)):
        rows = probabilities(3, 4, 37)
        sent = sse("token", token_event(event(attention_rows(rows), cross and attention_rows(cross))))
        as_lists = StreamToken.model_construct(
            index=2, id=7, text="a", delta="a", logprob=-0.25,
            top_logprobs=token_event(event(None)).top_logprobs,
            attention=[np.round(r.numpy().astype(np.float64), 6).tolist() for r in rows],
            cross_attention=cross and [np.round(r.numpy().astype(np.float64), 6).tolist() for r in cross])
        assert sent == f"event: token\ndata: {as_lists.model_dump_json(exclude_none=True)}\n\n"
    assert sse("token", token_event(event(None))) == \
        f"event: token\ndata: {token_event(event(None)).model_dump_json(exclude_none=True)}\n\n"


def test_a_built_token_event_holds_no_python_object_per_probability():
    rows = probabilities(4, 8, 200)  # 6,400 probabilities: the tiny decoder's rows late in a 200-token stream
    before = sys.getallocatedblocks()
    held = token_event(event(attention_rows(rows)))
    text = sse("token", held)  # what a writer holds while its client does not read
    blocks = sys.getallocatedblocks() - before
    assert len(text) > 6400 and blocks < 200, blocks  # a float each: over 6,400

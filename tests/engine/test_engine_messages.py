"""The messages between the server and an engine process (app/engine/messages.py): declared
structs, one tagged union each way, that round-trip through their bytes; what is not one of a
direction's messages is refused whole."""

from __future__ import annotations

import ast
import inspect
import typing

import msgspec
import numpy as np
import pytest

from attnlens.app.engine import messages as m
from attnlens.app.engine import process, worker
from attnlens.app.engine.request import GenerationParams
from attnlens.model import SamplingParams
from attnlens.model.analysis.operations import AttentionCall
from attnlens.model.hooks import ZEdit

PARAMS = GenerationParams([5, 6, 7], 9, SamplingParams(temperature=0.3, top_k=4, seed=3, logit_bias={11: -2.5}),
                          ["\n"], n_logprobs=2, return_attention=True, prompt_logprobs=1,
                          ablate=(ZEdit("blocks.1.attn", 2, "mean"),), ignore_eos=True)

TO_ENGINE = [m.Start(m.EngineSpec("/models/x", "cpu", "float32", {"max_concurrent": 4, "kv_cache_bytes": None})),
             m.AddGeneration(3, PARAMS), m.CancelGeneration(3), m.StopGeneration(3),
             m.AddCall(4, m.pickled(AttentionCall([1, 2], [0], [1]))), m.CancelCall(4), m.Close()]
FROM_ENGINE = [m.Ready(m.EngineInfo("cpu", "float32", 1 << 20, False)), m.Failed("no such file"),
               m.Step(m.Counters(0.01, 1, 2, 3), []),
               m.CallDone(4, True, m.pickled({"maps": np.zeros(3)})), m.CallDone(4, False, m.pickled(ValueError("x")))]


@pytest.mark.parametrize("message", TO_ENGINE, ids=lambda msg: type(msg).__name__)
def test_each_command_round_trips(message):
    assert m.decode_to_engine(m.encode(message)) == message


@pytest.mark.parametrize("message", FROM_ENGINE, ids=lambda msg: type(msg).__name__)
def test_each_answer_round_trips(message):
    back = m.decode_from_engine(m.encode(message))
    assert type(back) is type(message)
    if isinstance(message, m.CallDone):
        assert (back.number, back.ok) == (message.number, message.ok)
        value = m.unpickled(back.payload)
        assert isinstance(value, ValueError) if not back.ok else np.array_equal(value["maps"], np.zeros(3))
    else:
        assert back == message


def test_a_step_carries_tokens_with_attention_rows_prompt_scores_and_finishes():
    rows = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((1, 4), np.float16)]
    step = m.Step(m.Counters(0.02, 0, 1, 4096), [
        m.TokenOut(3, 42, -0.5, [42, 7], [-0.5, -1.5], rows, None),
        m.PromptOut(3, [-1.0, -2.0], [[1], [2]], [[-0.1], [-0.2]]),
        m.FinishOut(3, "length", "", 9, 1.5, 1.6, None)])
    back = m.decode_from_engine(m.encode(step))
    token, prompt, finish = back.records
    assert isinstance(token, m.TokenOut) and token.top_ids == [42, 7] and token.cross_attention is None
    for got, sent in zip(token.attention, rows):
        assert got.dtype == sent.dtype and np.array_equal(got, sent) and got.flags.writeable
    assert prompt == step.records[1] and finish == step.records[2]


def test_a_generations_params_arrive_as_they_were_sent():
    back = m.decode_to_engine(m.encode(m.AddGeneration(1, PARAMS)))
    assert isinstance(back, m.AddGeneration) and back.params == PARAMS
    assert isinstance(back.params.sampling, SamplingParams) and isinstance(back.params.ablate[0], ZEdit)


def test_what_is_not_a_directions_message_is_refused():
    with pytest.raises(msgspec.ValidationError):
        m.decode_to_engine(m.encode(m.Ready(m.EngineInfo("cpu", "float32", 0, False))))
    with pytest.raises(msgspec.ValidationError):
        m.decode_from_engine(m.encode(m.Close()))
    with pytest.raises(msgspec.DecodeError):
        m.decode_to_engine(b"x" * 100)
    with pytest.raises(NotImplementedError):  # no object travels by accident: it raises where it is made
        m.encode(m.Step(m.Counters(), [m.TokenOut(1, 2, 0.0, [], [], [object()])]))


def _matched_classes(fn) -> set[str]:
    """The message classes a function's `match` statement has a case for."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(fn).strip())):
        if isinstance(node, ast.MatchClass) and isinstance(node.cls, ast.Name):
            names.add(node.cls.id)
    return names


def test_the_engine_process_has_a_case_for_every_command():
    commands = {cls.__name__ for cls in typing.get_args(m.ToEngine)}
    assert _matched_classes(worker._serve) == commands


def test_the_server_reads_every_answer():
    source = inspect.getsource(process)
    for cls in typing.get_args(m.FromEngine):
        assert f"isinstance(message, {cls.__name__})" in source, cls.__name__

"""model/analysis/operations.py: every model operation is plain data that names what it runs. Each
call pickles by value (what crosses to an engine process), runs by name through run_operation and
gives what the function behind it gives; anything else is refused by name."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from encoder_helpers import make_tiny_encoder

from attnlens.app.serving.encoder_tasks import fill_mask_call, framed_ids
from attnlens.model import load_checkpoint
from attnlens.model.analysis import explain
from attnlens.model.analysis.attention_maps import MapRequest, analyse_attention
from attnlens.model.analysis.encoder_outputs import class_probabilities, embed_rows, mask_scores
from attnlens.model.analysis.head_atlas_scores import score_heads
from attnlens.model.analysis.operations import (
    OPERATIONS,
    AttentionCall,
    ClassifyCall,
    EmbedCall,
    ExplainHeadCall,
    FillMaskCall,
    HeadScoresCall,
    LensCall,
    LogitAttributionCall,
    LogitsCall,
    PatchCall,
    ScoreDecompositionCall,
    WarmUpCall,
    run_operation,
)
from attnlens.model.hooks import ZEdit


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return load_checkpoint(make_tiny_encoder(tmp_path_factory.mktemp("ops") / "enc", seed=3))


def by_pickle(call):
    """The call as the engine process receives it."""
    copy = pickle.loads(pickle.dumps(call))
    assert copy == call and type(copy) is type(call)
    return copy


def test_every_operation_is_registered_under_its_calls_name():
    calls = [AttentionCall, HeadScoresCall, LogitsCall, LensCall, ExplainHeadCall, FillMaskCall, ClassifyCall,
             EmbedCall, WarmUpCall, PatchCall, LogitAttributionCall, ScoreDecompositionCall]
    assert sorted(c.operation for c in calls) == sorted(OPERATIONS)


def test_a_decoders_operations_run_by_name_as_their_functions(ckpt):
    model, ids = ckpt.model, ckpt.tokenizer.encode("To be, or not to be")
    edit = (ZEdit("blocks.0.attn", 1, "zero"),)
    want = MapRequest(pool=4)
    got = run_operation(model, by_pickle(AttentionCall(ids=ids, layers=[0, 1], heads=[1, 2], want=want)))
    direct = analyse_attention(model, ids, [0, 1], [1, 2], want=want)
    np.testing.assert_array_equal(got.maps["self"], direct.maps["self"])
    assert got.tokens == direct.tokens
    scores = run_operation(model, by_pickle(HeadScoresCall(ids=ids)))
    np.testing.assert_array_equal(scores.scores["self"]["previous_token"],
                                  score_heads(model, ids).scores["self"]["previous_token"])
    assert run_operation(model, by_pickle(LogitsCall(ids, None, edit, 3, False))) == \
        explain.logits_report(model, ids, None, edit, 3, False)
    assert run_operation(model, by_pickle(LensCall(ids, None, (), 2, [0, 3], True))) == \
        explain.lens_report(model, ids, None, (), 2, [0, 3], True)
    step = run_operation(model, by_pickle(ExplainHeadCall(ids, None, "self", 1, 2, 4)))
    assert step == explain.explain_head(model, ids, None, "self", 1, 2, 4, ())
    assert run_operation(model, by_pickle(WarmUpCall(ids=ids))) is None


def test_an_encoders_operations_run_by_name_as_their_functions(encoder):
    model, tok = encoder.model, encoder.tokenizer
    call, spans = fill_mask_call(encoder, "To be, or [MASK] to be", top_k=3, max_masks=2)
    got = run_operation(model, by_pickle(call))
    assert got == mask_scores(model, call.ids, call.positions, call.vocab_size, call.never, 3)
    assert len(got.ids) == len(spans) == 1 and len(got.ids[0]) == 3
    ids = framed_ids(encoder, "the question")
    assert run_operation(model, by_pickle(ClassifyCall(ids))) == class_probabilities(model, ids)
    rows = [ids, framed_ids(encoder, "whether 'tis nobler")]
    np.testing.assert_array_equal(run_operation(model, by_pickle(EmbedCall(rows, 0))), embed_rows(model, rows, 0))
    assert run_operation(model, WarmUpCall(ids=ids, encoder_ids=[tok.cls_id, tok.mask_id, tok.sep_id])) is None


def test_a_long_operation_reports_its_progress(ckpt):
    reports = []
    run_operation(ckpt.model, AttentionCall(ids=ckpt.tokenizer.encode("To be"), layers=[0], heads=[0]),
                  report=lambda: reports.append(1))
    assert reports  # the engine's heartbeat, and where a call whose caller went away stops


class _Stop(Exception):
    pass


@pytest.mark.parametrize("call", [LogitsCall([], None, (), 3, False), LogitsCall([], None, "ablate", 3, False),
                                  LensCall([], None, (), 2, None, True), ExplainHeadCall([], None, "self", 1, 2, 4)],
                         ids=["logits", "logits+ablation", "lens", "explain"])
def test_every_forward_of_an_explain_operation_reports_and_stops_there(ckpt, call):
    """/logits, /lens and /attention/explain at real length run for minutes on SmolLM2: without report
    points the engine process's watchdog (ATTNLENS_ENGINE_STALL_S) killed the engine under them, and
    the generations beside them with it. Each block of each forward (and each block of the lens's
    unembedding) reports; a report that raises (the caller went away) stops the call; the answer
    is the same with reports as without."""
    from dataclasses import replace

    model, ids = ckpt.model, ckpt.tokenizer.encode("To be, or not to be, that is the question")
    call = replace(call, ids=ids, **({"ablate": (ZEdit("blocks.1.attn", 0, "mean"),)} if call.ablate == "ablate"
                                     else {}))
    reports: list[int] = []
    got = run_operation(model, call, report=lambda: reports.append(1))
    assert len(reports) >= model.config.n_layers  # at least once a block
    if call.ablate:  # the ablated forward reports too, beyond the clean one's
        plain: list[int] = []
        run_operation(model, replace(call, ablate=()), report=lambda: plain.append(1))
        assert len(reports) > len(plain)
    assert got == run_operation(model, call)

    def stop():
        raise _Stop

    with pytest.raises(_Stop):
        run_operation(model, call, report=stop)


def test_anything_else_is_no_operation(ckpt):
    with pytest.raises(ValueError, match="not a model operation"):
        run_operation(ckpt.model, lambda model: model)


def test_an_encoders_engine_runs_its_calls_and_refuses_in_words_when_full(encoder):
    """A model that does not generate runs its operations through an engine like every model:
    no KV cache, no generation slots, the same answers as run_operation, and past its line
    (ATTNLENS_MAX_ENCODER_CONCURRENT + ATTNLENS_MAX_QUEUE) a 429 that names the settings."""
    from helpers import run_async

    from attnlens.app.engine import Engine, QueueFull

    limit = "ATTNLENS_MAX_ENCODER_CONCURRENT + ATTNLENS_MAX_QUEUE"
    engine = Engine(encoder, max_concurrent=0, max_queue=0, max_attention_concurrent=1, calls_limit=limit)
    try:
        assert engine.max_concurrent == 0 and engine.cache_bytes == 0 and engine.client.core.cache is None
        ids = framed_ids(encoder, "the king is dead")
        got = run_async(engine.call(ClassifyCall(ids)))
        assert got == run_operation(encoder.model, ClassifyCall(ids))
        engine.admission.calls.running.append(object())  # one call running, and none may wait beside it

        async def one_more():
            return await engine.call(WarmUpCall(ids=[1]))

        with pytest.raises(QueueFull, match=r"server busy: 1 model calls .*\(limit 1, "
                                            r"ATTNLENS_MAX_ENCODER_CONCURRENT \+ ATTNLENS_MAX_QUEUE\)"):
            run_async(one_more())
        engine.admission.calls.running.clear()
    finally:
        engine.close()

"""A long forward under a reporting call runs its attention and FFN in pieces of rows, a progress
point between (model/hooks.py's row_pieces): the same outputs and hook points as in one piece,
and the stream beside it waits a piece, not a sub-layer."""

from __future__ import annotations

import pytest
import torch
from helpers import small_config_model

from attnlens.model import hooks as model_hooks
from attnlens.model import load_checkpoint
from attnlens.model.families import family_of
from attnlens.model.hooks import Hooks, hooked, row_pieces


def test_no_pieces_without_a_listener(monkeypatch):
    monkeypatch.setattr(model_hooks, "PIECE_MACS", 10)
    assert row_pieces(100, lambda t: 1000.0 * t) is None  # no hooks
    with hooked(torch.nn.Module(), Hooks()):
        assert row_pieces(100, lambda t: 1000.0 * t) is None  # hooks that report nothing
    with hooked(torch.nn.Module(), Hooks(progress=lambda: None)):
        assert row_pieces(100, lambda t: 0.1 * t) is None  # one piece does
        assert row_pieces(1, lambda t: 1000.0 * t) is None


@pytest.mark.parametrize("rows", [7, 64, 1000])
def test_pieces_cover_the_rows_with_equal_work(monkeypatch, rows):
    causal = lambda t: 10.0 * (t * 3 + t * (t + 1) / 2)  # noqa: E731  (rows see 3 cached keys, then their own)
    monkeypatch.setattr(model_hooks, "PIECE_MACS", causal(rows) / 5.5)  # 6 pieces
    with hooked(torch.nn.Module(), Hooks(progress=lambda: None)):
        pieces = row_pieces(rows, causal)
    assert pieces is not None and pieces[0][0] == 0 and pieces[-1][1] == rows
    assert len(pieces) == 6 if rows >= 64 else 2 <= len(pieces) <= 6  # a few rows: pieces of one row at least
    assert all(a < b and b == c for (a, b), (c, _) in zip(pieces, pieces[1:]))
    if rows >= 64:  # each piece near 1 / 6 of the whole: later rows see more keys, so the pieces shrink
        work = [causal(b) - causal(a) for a, b in pieces]
        assert max(work) < 1.2 * causal(rows) / 6
        assert pieces[0][1] - pieces[0][0] > pieces[-1][1] - pieces[-1][0]


def models(tmp_path):
    from encoder_helpers import make_tiny_encoder
    from translator_helpers import make_tiny_translator

    return {
        "llama": small_config_model(positional="rotary", n_kv_heads=2, norm_type="rmsnorm", ffn="gated",
                                    activation="silu", bias=False, tie_embeddings=False, context_length=96),
        "neox": small_config_model(positional="rotary", rotary_pct=0.5, parallel_residual=True, context_length=96),
        "encoder": load_checkpoint(make_tiny_encoder(tmp_path / "enc")).model.eval(),
        "translator": load_checkpoint(make_tiny_translator(tmp_path / "tr")).model.eval(),
    }


def run(model, ids, record, progress):
    """The model's outputs of ids and the hook points `record` keeps, with `progress` as the listener."""
    hooks = Hooks(record=record, progress=progress)
    with torch.inference_mode(), hooked(model, hooks):
        if family_of(model).takes_target:  # the source through the encoder, a target through the decoder
            out = model(torch.tensor([ids[:20]]), source=torch.tensor([ids])).logits
        else:
            out = model(torch.tensor([ids])).logits
    return out, hooks.captured


def test_a_forward_in_pieces_is_the_forward_in_one(monkeypatch, tmp_path):
    for name, model in models(tmp_path).items():
        n = min(model.config.context_length, 90)
        ids = [(i * 13) % (model.config.vocab_size - 10) + 5 for i in range(n)]
        record = lambda point: point.endswith(("hook_z", "hook_mlp_out", "hook_resid_post"))  # noqa: E731
        whole, kept = run(model, ids, record, progress=lambda: None)
        calls = []
        monkeypatch.setattr(model_hooks, "PIECE_MACS", 2_000)  # every attention and FFN in several pieces
        pieced, kept_pieced = run(model, ids, record, progress=lambda: calls.append(1))
        monkeypatch.undo()
        points = sum(1 for point in kept if point.endswith(("hook_resid_post", "hook_attn_out", "hook_cross_out")))
        assert len(calls) > 2 * points, name  # progress between the pieces too
        torch.testing.assert_close(pieced, whole, atol=2e-5, rtol=0, msg=name)
        assert kept_pieced.keys() == kept.keys()
        for point in kept:
            torch.testing.assert_close(kept_pieced[point], kept[point], atol=2e-5, rtol=0, msg=f"{name} {point}")

"""The committed encoder (checkpoints/encoder): loads, has the promised shape, and meets the
figures its train_report.json claims — recomputed here on the report's sample of held-out
passages (every 8th), and the bag-of-words and majority baselines on the full split."""

from __future__ import annotations

import pytest
from conftest import REPO_ROOT

from attnlens.model import load_checkpoint
from attnlens.model.data.genres import GENRES
from attnlens.model.evaluation.evaluate_encoder import (
    SAMPLE_EVERY,
    bow_baseline,
    build_split,
    every_nth,
    genre_metrics,
    majority_baseline,
    mlm_metrics,
)

ENCODER_DIR = REPO_ROOT / "checkpoints" / "encoder"


@pytest.fixture(scope="module")
def ckpt():
    if not (ENCODER_DIR / "model.safetensors").is_file():
        pytest.skip("the bundled encoder is not in checkpoints/encoder")
    return load_checkpoint(ENCODER_DIR)


@pytest.fixture(scope="module")
def split(ckpt):
    return build_split(REPO_ROOT / "data" / "shakespeare", ckpt.tokenizer, ckpt.config.context_length)


def test_encoder_is_small_and_labelled(ckpt):
    cfg = ckpt.config
    assert cfg.family == "encoder" and cfg.labels == list(GENRES)
    assert cfg.n_layers >= 4 and cfg.n_heads >= 4 and cfg.context_length >= 128
    size = sum(p.stat().st_size for p in ENCODER_DIR.iterdir() if p.is_file())
    assert size <= 15 * 1024 * 1024
    assert (ENCODER_DIR / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert not (ENCODER_DIR / "optimizer.safetensors").exists()  # a checkpoint, not a training run


def test_report_has_every_figure_and_they_are_consistent(ckpt):
    r = ckpt.report
    for key in ("config", "steps", "wall_time_s", "hardware", "parameters", "mlm_steps", "classify_steps",
                "held_out_mlm", "held_out_genre", "bow_baseline", "majority_baseline", "held_out_sample"):
        assert key in r, key
    for figures in (r["held_out_genre"], r["bow_baseline"], r["majority_baseline"]):
        counts = figures["confusion_matrix"]["counts"]
        total = sum(map(sum, counts))
        assert total == figures["passages"] == r["held_out_genre"]["passages"]
        assert figures["accuracy"] == pytest.approx(sum(counts[i][i] for i in range(3)) / total)
        recalls = [counts[i][i] / sum(counts[i]) for i in range(3)]
        assert figures["balanced_accuracy"] == pytest.approx(sum(recalls) / 3)


def test_sample_figures_recomputed_match_the_report(ckpt, split):
    want = ckpt.report["held_out_sample"]
    assert want["every_nth_passage"] == SAMPLE_EVERY
    sample = every_nth(split, SAMPLE_EVERY)
    mlm = mlm_metrics(ckpt.model, sample.val_rows, ckpt.tokenizer)
    assert mlm["mlm_masked_tokens"] == want["held_out_mlm"]["mlm_masked_tokens"]
    assert mlm["mlm_loss"] == pytest.approx(want["held_out_mlm"]["mlm_loss"], abs=1e-4)
    assert mlm["mlm_accuracy"] == pytest.approx(want["held_out_mlm"]["mlm_accuracy"], abs=1e-4)
    genre = genre_metrics(ckpt.model, sample)
    assert genre["confusion_matrix"]["counts"] == want["held_out_genre"]["confusion_matrix"]["counts"]
    # the sample agrees with the full held-out figures it was drawn from
    full = ckpt.report["held_out_genre"]
    assert abs(genre["accuracy"] - full["accuracy"]) < 0.08
    assert abs(mlm["mlm_accuracy"] - ckpt.report["held_out_mlm"]["mlm_accuracy"]) < 0.03


def test_baselines_recomputed_match_the_report(ckpt, split):
    assert majority_baseline(split)["confusion_matrix"] == ckpt.report["majority_baseline"]["confusion_matrix"]
    pytest.importorskip("sklearn")
    bow = bow_baseline(split)
    assert bow["confusion_matrix"]["counts"] == ckpt.report["bow_baseline"]["confusion_matrix"]["counts"]


def test_fills_an_obvious_mask(ckpt):
    from attnlens.app.serving.encoder_tasks import fill_mask

    masks = fill_mask(ckpt, "O Romeo, Romeo! wherefore art thou [MASK]?", top_k=5, max_masks=4)
    assert len(masks) == 1 and len(masks[0]) == 5
    assert masks[0][0].score >= masks[0][-1].score


def test_refresh_report_keeps_a_recorded_baseline_it_cannot_recompute(tmp_path, monkeypatch):
    """`attnlens encoder-report` without scikit-learn (a `make serve` venv) must not overwrite
    the committed bag-of-words figures in train_report.json with an error."""
    import json
    from types import SimpleNamespace

    import attnlens.model.checkpoint as checkpoint_module
    import attnlens.model.evaluation.evaluate_encoder as encoder_eval

    old = {"steps": 7, "held_out_mlm": {"mlm_accuracy": 0.1},
           "bow_baseline": {"accuracy": 0.7}, "majority_baseline": {"accuracy": 0.5}}
    new = {"held_out_mlm": {"mlm_accuracy": 0.2},
           "bow_baseline": {"error": "scikit-learn is not installed (no module named sklearn)"},
           "majority_baseline": {"accuracy": 0.5}}
    fake = SimpleNamespace(report=old, model=None, tokenizer=None,
                           config=SimpleNamespace(context_length=8))
    monkeypatch.setattr(checkpoint_module, "load_checkpoint", lambda d: fake)
    monkeypatch.setattr(encoder_eval, "build_split", lambda *a, **k: None)
    monkeypatch.setattr(encoder_eval, "encoder_report", lambda m, s: new)

    written = encoder_eval.refresh_report(tmp_path, tmp_path)
    on_disk = json.loads((tmp_path / checkpoint_module.REPORT_FILE).read_text())
    for report in (written, on_disk):
        assert report["bow_baseline"] == {"accuracy": 0.7}  # kept, not the error
        assert report["held_out_mlm"] == {"mlm_accuracy": 0.2} and report["steps"] == 7
    # with nothing recorded before, the error is what there is to say
    assert encoder_eval.merge_report({}, new)["bow_baseline"] == new["bow_baseline"]

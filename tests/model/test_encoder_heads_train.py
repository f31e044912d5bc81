"""model/training/encoder_heads.py, tiny: heads trained on the bundled encoder (frozen) from a
sample of the passages, written as heads.safetensors + heads.json with reports, then put on a
copy of the checkpoint as model/interop/packaged.py puts them on a packaged model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from attnlens.model import load_checkpoint
from attnlens.model.interop.packaged import put_heads
from attnlens.model.training import encoder_heads

pytestmark = pytest.mark.slow

BASE = "checkpoints/encoder"


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    pytest.importorskip("sklearn")
    out = tmp_path_factory.mktemp("heads")
    common = ["--model", BASE, "--out", str(out), "--every", "40", "--epochs", "1", "--seed", "3"]
    encoder_heads.main(["genre", *common, "--layers", "1"])
    encoder_heads.main(["mlm", *common, "--batch-size", "256", "--compare", ""])
    return out


def test_both_heads_land_in_one_folder_with_their_reports(heads):
    assert json.loads((heads / "heads.json").read_text()) == {"classifier_layers": 1, "labels": ["comedy", "history", "tragedy"],
                                                              "mlm_head": True}
    genre = json.loads((heads / "genre_report.json").read_text())
    assert {"held_out_genre", "bow_baseline", "majority_baseline", "command"} <= set(genre)
    assert genre["held_out_genre"]["passages"] == genre["bow_baseline"]["passages"]
    mlm = json.loads((heads / "mlm_report.json").read_text())
    assert 0 <= mlm["fill_mask_common_words"]["top1"] <= 1 and mlm["command"].startswith(
        "python -m attnlens.model.training.encoder_heads mlm")
    for task in ("genre", "mlm"):
        assert (heads / f"{task}_metrics.jsonl").stat().st_size > 0
        assert (heads / f"{task}_loss.png").is_file() or not _has_matplotlib()


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_heads_put_on_the_model_change_only_the_heads(heads, tmp_path):
    copy = tmp_path / "encoder"
    shutil.copytree(BASE, copy)
    put_heads(copy, heads)
    before, after = load_checkpoint(BASE).model, load_checkpoint(copy)
    assert after.config.classifier_layers == 1 and (copy / "genre_report.json").is_file()
    old = before.state_dict()
    for name, tensor in after.model.state_dict().items():
        if name.startswith("blocks.") or name.startswith(("tok_emb", "pos_emb", "emb_norm", "ln_f")):
            assert torch.equal(tensor, old[name]), name
    ids = torch.tensor([[after.tokenizer.cls_id, *after.tokenizer.encode("Now is the winter of our discontent"),
                         after.tokenizer.sep_id]])
    with torch.no_grad():
        hidden = after.model(ids, task="hidden").logits
        assert torch.equal(hidden, before(ids, task="hidden").logits)  # embeddings and maps: the model's own
        assert after.model(ids, task="classify").logits.shape == (1, 3)


def test_head_figures_read_the_reports_and_say_which_head_is_weak(heads, tmp_path):
    from attnlens.model.evaluation.evaluate_encoder import FILL_MASK_GOAL, head_figures

    figures = head_figures(heads)
    genre = json.loads((heads / "genre_report.json").read_text())
    fill = json.loads((heads / "mlm_report.json").read_text())["fill_mask_common_words"]["top1"]
    assert figures["fill-mask"]["value"] == fill and figures["fill-mask"]["weak"] == (fill < FILL_MASK_GOAL)
    assert figures["classify"]["baseline"] == genre["bow_baseline"]["balanced_accuracy"]
    assert figures["classify"]["weak"] == (genre["held_out_genre"]["balanced_accuracy"] <= figures["classify"]["baseline"])
    bundled = head_figures(BASE)  # the bundled encoder's training report: its genre head loses to bag of words
    assert bundled["classify"]["weak"] and head_figures(tmp_path) == {}

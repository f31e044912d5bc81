"""The encoder's data and training: Folio genres, MLM masking, a tiny MLM + genre run, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT
from safetensors.torch import load_file

from attnlens.model.data.genres import EXCLUDED, FOLIO_GENRE, GENRES
from attnlens.model.data.mlm import IGNORE, mask_tokens
from attnlens.model.data.passages import load_works
from attnlens.model.data.shakespeare import VAL_WORKS, prepare_data
from attnlens.model.tokenizer import Tokenizer
from attnlens.model.training.train import load_run_config, train

TINY_ENCODER_TOML = """
[model]
family = "encoder"
vocab_size = 320
context_length = 32
d_model = 32
n_layers = 2
n_heads = 2
d_ff = 64
norm = "post"
activation = "relu"
labels = ["comedy", "history", "tragedy"]

[train]
data_dir = "{data}"
vocab_size = 320
batch_size = 8
max_steps = {mlm}
classify_steps = {cls}
classify_batch_size = 6
classify_warmup_steps = 2
lr = 3e-3
warmup_steps = 3
eval_interval = 6
log_interval = 2
checkpoint_interval = 1000
threads = 1
save_dtype = "float16"
"""


def test_every_work_has_a_folio_genre_or_a_reason_to_be_left_out():
    works = load_works(REPO_ROOT / "data/shakespeare")
    names = {w.name for w in works}
    assert names == set(FOLIO_GENRE) | set(EXCLUDED)
    assert not set(FOLIO_GENRE) & set(EXCLUDED)
    # the Folio's Catalogue: 14 comedies, 10 histories, 11 tragedies (Troilus is not listed)
    counts = {g: sum(1 for v in FOLIO_GENRE.values() if v == g) for g in GENRES}
    assert counts == {"comedy": 14, "history": 10, "tragedy": 11}
    held_out = {w.name: w.genre for w in works if w.split == "val"}
    assert held_out == {"julius_caesar": "tragedy", "twelfth_night": "comedy",
                        "richard_ii": "history", "winters_tale": "comedy"}
    assert FOLIO_GENRE["cymbeline"] == "tragedy" and "troilus_and_cressida" in EXCLUDED


def test_mask_tokens_picks_15_percent_and_splits_80_10_10():
    special = {0, 1, 2, 3, 4}
    ids = torch.randint(5, 500, (200, 100))
    ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
    g = torch.Generator().manual_seed(0)
    inputs, labels = mask_tokens(ids, mask_id=4, special_ids=special, vocab_size=500, generator=g)
    picked = labels != IGNORE
    assert not picked[:, 0].any() and not picked[:, -1].any()  # special tokens never picked
    assert torch.equal(labels[picked], ids[picked])
    assert abs(picked[:, 1:-1].float().mean().item() - 0.15) < 0.01
    n = picked.sum().item()
    masked = (inputs == 4) & picked
    kept = (inputs == ids) & picked
    assert abs(masked.sum().item() / n - 0.8) < 0.03
    # random replacements are ordinary tokens; a random draw can equal the original (~1/495)
    assert abs(kept.sum().item() / n - 0.1) < 0.03
    changed = picked & ~masked & ~kept
    assert abs(changed.sum().item() / n - 0.1) < 0.03
    assert not torch.isin(inputs[changed], torch.tensor(sorted(special))).any()
    assert torch.equal(inputs[~picked], ids[~picked])
    again = mask_tokens(ids, mask_id=4, special_ids=special, vocab_size=500,
                        generator=torch.Generator().manual_seed(0))
    assert torch.equal(again[0], inputs)  # seeded: the same corruption every time


def test_the_text_mask_is_the_mask_token_and_takes_its_space():
    tok = Tokenizer.train(["the king of Denmark, the queen of France"] * 8, vocab_size=300, encoder_tokens=True)
    assert (tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id) == (1, 2, 3, 4)
    ids = tok.encode("the [MASK] of Denmark")
    assert ids.count(tok.mask_id) == 1
    assert tok.display_text(ids[0]) == "the" and tok.display_text(ids[2]).startswith(" ")
    assert tok.encode("[MASK][MASK]") == [tok.mask_id, tok.mask_id]
    assert Tokenizer.from_str(tok.to_str()).encode("a [MASK]")[-1] == tok.mask_id


@pytest.fixture(scope="module")
def genre_corpus(tmp_path_factory) -> Path:
    """One training work of each genre, one the Folio leaves out, and the held-out works."""
    works = {w.name: w.text for w in load_works(REPO_ROOT / "data/shakespeare")}
    src = tmp_path_factory.mktemp("texts")
    for name in ("hamlet", "tempest", "henry_v", "sonnets", *VAL_WORKS):
        (src / f"{name}_gut.txt").write_text(works[name][:5000], encoding="utf-8")
    out = tmp_path_factory.mktemp("data")
    prepare_data(out, source=src)
    return out


def write_config(tmp_path: Path, corpus: Path, mlm: int, cls: int) -> Path:
    path = tmp_path / "enc.toml"
    path.write_text(TINY_ENCODER_TOML.format(data=corpus.as_posix(), mlm=mlm, cls=cls))
    return path


def test_tiny_encoder_run_pretrains_fine_tunes_and_reports(tmp_path, genre_corpus):
    run = load_run_config(write_config(tmp_path, genre_corpus, mlm=12, cls=6))
    out = tmp_path / "run"
    train(run, out, show_progress=False)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_report.json",
                 "optimizer.safetensors", "train_state.json", "metrics.jsonl", "loss.png"):
        assert (out / name).is_file(), name
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r.get("phase") for r in records if "train_loss" in r} == {"mlm", "classify"}
    assert any("val_genre_accuracy" in r for r in records)
    report = json.loads((out / "train_report.json").read_text())
    assert report["steps"] == 18 and report["mlm_steps"] == 12 and report["classify_steps"] == 6
    assert 0 <= report["held_out_mlm"]["mlm_accuracy"] <= 1 and report["held_out_mlm"]["mlm_loss"] > 0
    genre = report["held_out_genre"]
    assert genre["confusion_matrix"]["labels"] == list(GENRES)
    assert sum(map(sum, genre["confusion_matrix"]["counts"])) == genre["passages"]
    for key in ("bow_baseline", "majority_baseline"):
        assert report[key]["passages"] == genre["passages"]  # the same held-out split
    assert report["majority_baseline"]["balanced_accuracy"] == pytest.approx(1 / 3)
    tensors = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.float16 for t in tensors.values())
    assert "classifier.weight" in tensors and "mlm_bias" in tensors


def test_resumed_encoder_run_equals_an_uninterrupted_one(tmp_path, genre_corpus):
    cfg = write_config(tmp_path, genre_corpus, mlm=6, cls=4)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_run_config(cfg, ["train.bow_baseline=false"]), whole, show_progress=False)
    # stop inside the fine-tuning phase, then resume
    train(load_run_config(cfg, ["train.bow_baseline=false"]), parts, show_progress=False, stop_at_step=8)
    assert json.loads((parts / "train_state.json").read_text())["step"] == 8
    train(load_run_config(cfg, ["train.bow_baseline=false"]), parts, resume=True, show_progress=False)
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(parts / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name].float(), b[name].float(), atol=2e-3, rtol=0)


@pytest.mark.slow
def test_two_process_ddp_trains_the_encoder(tmp_path, genre_corpus):
    import os
    import subprocess
    import sys

    cfg = write_config(tmp_path, genre_corpus, mlm=3, cls=2)
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "attnlens.app.cli", "train", "--config", str(cfg), "--out", str(out), "--set", "train.bow_baseline=false"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    why = [line for line in done.stderr.splitlines() if "terminate called" in line or "what()" in line or "Error" in line]
    assert done.returncode == 0, "\n".join(why[-20:]) + done.stdout[-2000:] + done.stderr[-2000:]  # a rank's own abort first
    report = json.loads((out / "train_report.json").read_text())
    assert report["hardware"].startswith("2 x CPU") and report["steps"] == 5
    assert "held_out_genre" in report

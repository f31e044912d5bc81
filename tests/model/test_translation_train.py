"""`attnlens train` on the encoder-decoder: a tiny run with its metrics, plot and report; resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO_ROOT
from safetensors.torch import load_file
from translator_helpers import small_translation_tokenizer

from attnlens.model import load_checkpoint
from attnlens.model.families.encoder_decoder import EncoderDecoder
from attnlens.model.training.train import load_run_config, train

TINY_TRANSLATOR_TOML = """
[model]
family = "encoder-decoder"
vocab_size = 640
context_length = 48
d_model = 32
n_layers = 1
n_heads = 2
d_ff = 64
positional = "sinusoidal"
norm = "post"
activation = "relu"
scale_embeddings = true

[train]
tokenizer = "{tokenizer}"
batch_size = 8
max_steps = 8
lr = 3e-3
warmup_steps = 2
eval_interval = 4
log_interval = 2
checkpoint_interval = 1000
threads = 1
save_dtype = "float16"
eval_pairs = 12
"""


def write_config(tmp_path):
    tok_path = tmp_path / "tokenizer.json"
    small_translation_tokenizer().save(tok_path)
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TRANSLATOR_TOML.format(tokenizer=tok_path), encoding="utf-8")
    return cfg


def test_tiny_translator_run_logs_plots_and_reports(tmp_path):
    out = tmp_path / "run"
    result = train(load_run_config(write_config(tmp_path)), out, show_progress=False)
    assert result["step"] == 8
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [2, 4, 6, 8]
    evals = [r for r in records if "val_date_exact_match" in r]
    assert [r["step"] for r in evals] == [4, 8] and evals[-1]["full"]
    assert (out / "loss.png").stat().st_size > 1000
    report = json.loads((out / "train_report.json").read_text())
    for kind in ("dates", "numbers"):
        part = report[f"held_out_{kind}"]
        assert part["n"] == 12 and 0 <= part["exact_match"] <= 1
        assert len(part["mistakes"]) == min(10, 12 - part["correct"])
    assert report["held_out_rule"] == "int(sha256(source).hexdigest(), 16) % 10 == 0"
    ck = load_checkpoint(out)
    assert isinstance(ck.model, EncoderDecoder) and ck.config.family == "encoder-decoder"
    assert load_file(str(out / "model.safetensors"))["tok_emb.weight"].dtype == torch.float16


def test_resumed_translator_run_equals_an_uninterrupted_one(tmp_path):
    cfg = write_config(tmp_path)
    overrides = ["train.eval_interval=100", "train.eval_pairs=2"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(load_run_config(cfg, overrides), whole, show_progress=False)
    train(load_run_config(cfg, overrides), parts, show_progress=False, stop_at_step=5)
    assert json.loads((parts / "train_state.json").read_text())["step"] == 5
    train(load_run_config(cfg, overrides), parts, resume=True, show_progress=False)
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(parts / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name].float(), b[name].float(), atol=2e-3, rtol=0)


@pytest.mark.slow
def test_two_process_ddp_translator_run_over_gloo(tmp_path):
    cfg = write_config(tmp_path)
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "attnlens.app.cli", "train", "--config", str(cfg), "--out", str(out), "--set", "train.max_steps=4",
           "--set", "train.eval_pairs=4"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "train_report.json").read_text())
    assert report["hardware"].startswith("2 x CPU") and report["steps"] == 4
    assert report["held_out_numbers"]["n"] == 4
    assert isinstance(load_checkpoint(out).model, EncoderDecoder)

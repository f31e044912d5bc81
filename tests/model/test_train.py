"""Training: a tiny CPU run learns, resume continues exactly, DDP over gloo, CLI generate."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT
from safetensors.torch import load_file

from attnlens.model.data.shakespeare import VAL_WORKS, load_split, prepare_data
from attnlens.model.tokenizer import Tokenizer
from attnlens.model.training.train import encode_corpus, evaluate, load_run_config, token_byte_lengths, train

TINY_TOML = """
[model]
vocab_size = 320
context_length = 32
d_model = 32
n_layers = 2
n_heads = 2
d_ff = 64
dropout = {dropout}

[train]
data_dir = "{data}"
vocab_size = 320
batch_size = 8
max_steps = {steps}
lr = 3e-3
min_lr = 3e-4
warmup_steps = 4
eval_interval = 10
eval_batches = 4
log_interval = 2
checkpoint_interval = 1000
threads = 1
n_samples = 2
sample_tokens = 8
"""


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """A few kilobytes of each work, prepared exactly as the real corpus is."""
    src = tmp_path_factory.mktemp("texts")
    texts = dict(zip(["hamlet", "macbeth", "othello"], load_split(REPO_ROOT / "data/shakespeare", "train")[:3]))
    val = load_split(REPO_ROOT / "data/shakespeare", "val")
    texts.update({name: text for name, text in zip(sorted(VAL_WORKS), val)})
    for name, text in texts.items():
        (src / f"{name}_gut.txt").write_text(text[:12000], encoding="utf-8")
    out = tmp_path_factory.mktemp("data")
    prepare_data(out, source=src)
    return out


def write_config(tmp_path: Path, corpus: Path, steps: int = 20, dropout: float = 0.0) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_TOML.format(data=corpus.as_posix(), steps=steps, dropout=dropout))
    return path


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_lowers_held_out_loss_and_writes_everything(tmp_path, small_corpus):
    run = load_run_config(write_config(tmp_path, small_corpus, steps=40))
    out = tmp_path / "run"
    result = train(run, out, show_progress=False)

    tok = Tokenizer.from_file(out / "tokenizer.json")
    stream = encode_corpus(tok, load_split(small_corpus, "val"))
    torch.manual_seed(run.train.seed)
    from attnlens.model.families.decoder import Transformer

    untrained = Transformer(run.model)
    before = evaluate(untrained, stream, token_byte_lengths(tok, run.model.vocab_size), 32, "cpu")
    assert result["val_loss"] < before["val_loss"] - 0.5
    assert 0 < result["val_bits_per_byte"] < before["val_bits_per_byte"]

    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_report.json",
                 "optimizer.safetensors", "train_state.json", "metrics.jsonl", "loss.png"):
        assert (out / name).is_file(), name
    report = json.loads((out / "train_report.json").read_text())
    assert report["steps"] == 40 and report["tokens_seen"] == 40 * 8 * 32
    assert report["val_bits_per_byte"] == pytest.approx(result["val_bits_per_byte"])
    assert len(report["samples"]) == 2 and report["tokenizer_vocab_size"] == tok.vocab_size
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lrs = [m["lr"] for m in metrics(out) if "lr" in m]
    assert max(lrs) == pytest.approx(3e-3) and lrs[-1] < lrs[len(lrs) // 2]  # warm-up, then decay


def test_resume_continues_the_same_curve(tmp_path, small_corpus):
    run = load_run_config(write_config(tmp_path, small_corpus, steps=20, dropout=0.1))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(run, straight, show_progress=False)
    train(run, resumed, show_progress=False, stop_at_step=10)
    assert json.loads((resumed / "train_state.json").read_text())["step"] == 10
    train(run, resumed, resume=True, show_progress=False)

    def losses(out):
        return {m["step"]: m["train_loss"] for m in metrics(out) if "train_loss" in m}

    a, b = losses(straight), losses(resumed)
    assert set(a) == set(b)
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), step
    wa, wb = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-6)


def test_overrides_and_bad_configs(tmp_path, small_corpus):
    cfg = write_config(tmp_path, small_corpus)
    run = load_run_config(cfg, ["train.max_steps=3", "model.n_layers=1", "train.compile=false"])
    assert run.train.max_steps == 3 and run.model.n_layers == 1 and run.train.compile is False
    with pytest.raises(ValueError, match="unknown train setting"):
        load_run_config(cfg, ["train.nope=1"])
    with pytest.raises(ValueError, match="divisible"):
        load_run_config(cfg, ["model.n_heads=3"])


def test_ctrl_c_saves_a_checkpoint(tmp_path, small_corpus):
    cfg = write_config(tmp_path, small_corpus, steps=100000)
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "attnlens.app.cli", "train", "--config", str(cfg), "--out", str(out)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() or "train_loss" not in (out / "metrics.jsonl").read_text():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    state = json.loads((out / "train_state.json").read_text())
    assert 0 < state["step"] < 100000 and state["final"] is False
    assert (out / "model.safetensors").is_file() and (out / "optimizer.safetensors").is_file()


@pytest.mark.slow
def test_two_process_ddp_over_gloo_writes_one_checkpoint(tmp_path, small_corpus):
    cfg = write_config(tmp_path, small_corpus, steps=6)
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "attnlens.app.cli", "train", "--config", str(cfg), "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "train_report.json").read_text())
    assert report["hardware"].startswith("2 x CPU")
    assert report["tokens_seen"] == 6 * 8 * 32 * 2  # both ranks' batches count
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors", "optimizer.safetensors"]
    assert len([m for m in metrics(out) if m.get("step") == 6 and "train_loss" in m]) == 1  # rank 0 only


def test_generate_cli_streams_and_is_seeded(tiny_checkpoint):
    from attnlens.app.cli.generate_command import generate_to_terminal

    def run(seed):
        buf = io.StringIO()
        args = Namespace(model=str(tiny_checkpoint), prompt="To be", max_new_tokens=12, temperature=1.0,
                         top_k=None, top_p=1.0, seed=seed, device="cpu")
        assert generate_to_terminal(args, out=buf) == 0
        return buf.getvalue()

    first = run(7)
    assert first.startswith("To be") and len(first) > len("To be\n")
    assert run(7) == first
    assert any(run(s) != first for s in (8, 9, 10))

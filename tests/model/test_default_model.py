"""The committed default model: loads, has the promised shape and quality, and has not changed.

The pinned greedy continuation guards against committing a broken or different checkpoint.
"""

from __future__ import annotations

import pytest

from attnlens.model import SamplingParams, generate_tokens, load_checkpoint

PROMPT = "ROMEO.\nBut soft, what light"
# Greedy (temperature 0) continuation of PROMPT, 24 tokens, on the CPU in float32.
EXPECTED = "?\n\nMACBETH.\nThe ceremony of the world,\nAnd the world'st, the world"


@pytest.fixture(scope="module")
def ckpt(default_checkpoint):
    return load_checkpoint(default_checkpoint)


def test_default_model_is_gpt2_shaped_and_big_enough_to_look_at(ckpt, default_checkpoint):
    cfg = ckpt.config
    assert cfg.is_gpt2_shaped() == []
    assert cfg.context_length >= 256 and cfg.n_layers >= 4 and cfg.n_heads >= 4
    size = sum(p.stat().st_size for p in default_checkpoint.iterdir() if p.is_file())
    assert size <= 30 * 1024 * 1024
    assert (default_checkpoint / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_training_report_meets_the_quality_goal(ckpt):
    report = ckpt.report
    for key in ("config", "steps", "tokens_seen", "wall_time_s", "hardware", "final_train_loss",
                "final_val_loss", "val_bits_per_byte", "tokenizer_vocab_size", "samples"):
        assert key in report, key
    assert report["val_bits_per_byte"] <= 2.0
    assert len(report["samples"]) == 5
    assert report["tokenizer_vocab_size"] == ckpt.tokenizer.vocab_size


def test_greedy_continuation_is_stable(ckpt):
    ids = ckpt.tokenizer.encode(PROMPT)
    out = [t.id for t in generate_tokens(ckpt.model, ids, 24, SamplingParams(temperature=0))]
    assert ckpt.tokenizer.decode(out) == EXPECTED

"""Shared fixtures: a tiny randomly initialised checkpoint that every test can load fast."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Keep the 2-core CI machine responsive: tests never need more than one intra-op thread
# per process (the service tests start extra processes of their own).
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

REPO_ROOT = Path(__file__).resolve().parent.parent

TINY_TEXT = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
    "And by opposing end them. To die—to sleep,\n"
    "No more; and by a sleep to say we end\n"
    "Café naïve résumé — 東京 and emoji 😀🎭 too.\n"
)


def make_tiny_checkpoint(path: Path, *, seed: int = 0, **overrides) -> Path:
    """Write a small random checkpoint (byte-level BPE on TINY_TEXT) to `path`."""
    from model import ModelConfig, Tokenizer, Transformer, save_checkpoint

    tok = Tokenizer.train([TINY_TEXT] * 4, vocab_size=300)
    fields = dict(
        vocab_size=tok.vocab_size,
        context_length=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**fields))
    save_checkpoint(path, model, tok)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A GPT-2-shaped 2-layer, 4-head model with context 64, saved once per session."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def default_checkpoint() -> Path:
    path = REPO_ROOT / "checkpoints" / "default"
    if not (path / "model.safetensors").is_file():
        pytest.skip("the bundled default model is not in checkpoints/default")
    return path

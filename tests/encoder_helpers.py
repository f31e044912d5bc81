"""Helpers for encoder tests: a tiny random encoder checkpoint with the encoder's special tokens."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_TEXT = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
    "And by opposing end them. To die, to sleep,\n"
)


def make_tiny_encoder(path: Path, *, seed: int = 0, **overrides) -> Path:
    """A 2-layer, 4-head BERT-shaped encoder with a genre head, random weights, saved to `path`."""
    from attnlens.model import ModelConfig, Tokenizer, save_checkpoint
    from attnlens.model.families.encoder import Encoder

    tok = Tokenizer.train([TINY_TEXT] * 4, vocab_size=300, encoder_tokens=True)
    fields = dict(family="encoder", vocab_size=tok.vocab_size, context_length=64, d_model=32, n_layers=2,
                  n_heads=4, d_ff=64, norm="post", activation="relu",
                  labels=["comedy", "history", "tragedy"])
    fields.update(overrides)
    torch.manual_seed(seed)
    model = Encoder(ModelConfig(**fields))
    save_checkpoint(path, model, tok)
    return Path(path)

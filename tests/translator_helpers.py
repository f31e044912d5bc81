"""Helpers for translator tests: a small tokenizer for the dates/numbers task and a tiny
random encoder-decoder checkpoint built with it."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=1)
def small_translation_tokenizer_json() -> str:
    """The translator's tokenizer trained on a sparse corpus (fast; same alphabet and words)."""
    from attnlens.model.data.translation_pairs import tokenizer_corpus
    from attnlens.model.tokenizer import Tokenizer

    return Tokenizer.train(tokenizer_corpus(step=97), 600, encoder_tokens=True).to_str()


def small_translation_tokenizer():
    from attnlens.model.tokenizer import Tokenizer

    return Tokenizer.from_str(small_translation_tokenizer_json())


def make_tiny_translator(path: Path, *, seed: int = 0, **overrides) -> Path:
    """A 2+2-layer, 4-head encoder-decoder with random weights, saved to `path`."""
    from attnlens.model import ModelConfig, save_checkpoint
    from attnlens.model.families.encoder_decoder import EncoderDecoder

    tok = small_translation_tokenizer()
    fields = dict(family="encoder-decoder", vocab_size=tok.vocab_size, context_length=48, d_model=32,
                  n_layers=2, n_heads=4, d_ff=64, norm="post", activation="relu", positional="sinusoidal",
                  scale_embeddings=True)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = EncoderDecoder(ModelConfig(**fields))
    save_checkpoint(path, model, tok)
    return Path(path)

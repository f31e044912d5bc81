"""The three model families and the map from a config's `family` to its module class.

- decoder.py: `Transformer`, the decoder-only language model (GPT-2's shape).
- encoder.py: `Encoder`, the encoder-only model (BERT's shape).
- encoder_decoder.py: `EncoderDecoder`, the encoder-decoder translator (Vaswani et al.'s shape).

All three stack the same shared parts (model/parts.py).
"""

from __future__ import annotations

import torch.nn as nn

from ..config import ModelConfig
from .decoder import ModelOutput, Transformer
from .encoder import Encoder
from .encoder_decoder import EncoderDecoder

FAMILY_CLASSES: dict[str, type[nn.Module]] = {
    "decoder": Transformer,
    "encoder": Encoder,
    "encoder-decoder": EncoderDecoder,
}


def build_model(config: ModelConfig) -> nn.Module:
    """The module for a config's family."""
    family = FAMILY_CLASSES.get(config.family)
    if family is None:
        raise ValueError(f"family {config.family!r} is not built by this version of attnlens")
    return family(config)


__all__ = ["FAMILY_CLASSES", "Encoder", "EncoderDecoder", "ModelOutput", "Transformer", "build_model"]

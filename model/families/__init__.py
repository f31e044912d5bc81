"""The model families: each declares its contract (contract.py) and is built from model/parts.

- decoder.py: `Transformer`, the decoder-only language model (GPT's shape; Llama's and the others').
- encoder.py: `Encoder`, the encoder-only model (BERT's shape).
- encoder_decoder.py: `EncoderDecoder`, the encoder-decoder translator (Vaswani et al.'s shape).

Adding a family is one module that declares a `Family` and its nn.Module, one line in
FAMILY_CLASSES below, and its name and optional parts in model/family_parts.py (which the config
validates against without importing the families); the service, the engine and the page read
the declaration.
"""

from __future__ import annotations

import torch.nn as nn

from attnlens.model.config import ModelConfig
from attnlens.model.families.contract import (
    AttentionAnalysis,
    AttentionGroup,
    Family,
    GenerationSpec,
    TaskSpec,
    TrainingSpec,
    family_of,
)
from attnlens.model.families.decoder import DecoderOutput, Transformer
from attnlens.model.families.encoder import Encoder, EncoderOutput
from attnlens.model.families.encoder_decoder import EncoderDecoder, EncoderDecoderOutput

# config.family -> the module class; each class carries its declaration as `family`
FAMILY_CLASSES: dict[str, type[nn.Module]] = {cls.family.name: cls for cls in (Transformer, Encoder, EncoderDecoder)}
FAMILIES: dict[str, Family] = {name: cls.family for name, cls in FAMILY_CLASSES.items()}


def family_named(name: str) -> Family:
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"family {name!r} is not built by this version of attnlens (it builds: "
                         f"{', '.join(FAMILIES)})")
    return family


def build_model(config: ModelConfig) -> nn.Module:
    """The module for a config's family."""
    family_named(config.family)
    return FAMILY_CLASSES[config.family](config)


__all__ = ["FAMILIES", "FAMILY_CLASSES", "AttentionAnalysis", "AttentionGroup", "DecoderOutput", "Encoder",
           "EncoderDecoder", "EncoderDecoderOutput", "EncoderOutput", "Family", "GenerationSpec", "TaskSpec",
           "TrainingSpec", "Transformer", "build_model", "family_named", "family_of"]

"""The model's hyper-parameters: one dataclass that round-trips through JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot describe a working model."""


POOLINGS = ("mean", "cls")


@dataclass
class ModelConfig:
    # Which stack of the shared parts this is (a declared family: model/families). Old checkpoints
    # have no field: decoders.
    family: str = "decoder"  # "decoder" | "encoder" | "encoder-decoder"
    vocab_size: int = 4096
    context_length: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    dropout: float = 0.0
    positional: str = "learned"  # "learned" | "sinusoidal"
    norm: str = "pre"  # "pre" (GPT-2) | "post" (Vaswani et al. 2017)
    activation: str = "gelu"  # "gelu" (tanh approximation, as GPT-2) | "relu" | "gelu_exact" (erf, as BERT)
    bias: bool = True
    tie_embeddings: bool = True
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model)
    layer_norm_eps: float = 1e-5
    # encoder only: the classification head's labels (none: no head) and how it pools
    labels: list[str] = field(default_factory=list)
    pooling: str = "mean"  # "mean" over non-padding positions | "cls" (the first position)
    # encoder-decoder only: the token the decoder starts every target with (the tokenizer's EOS)
    decoder_start_id: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ConfigError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.positional == "sinusoidal" and self.d_model % 2 != 0:
            raise ConfigError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout!r}")
        choices = {
            "positional": ("learned", "sinusoidal"),
            "norm": ("pre", "post"),
            "activation": ("gelu", "relu", "gelu_exact"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        from .families import FAMILIES  # the declared families (model/families/__init__.py)

        if self.family not in FAMILIES:
            raise ConfigError(f"family must be one of {tuple(FAMILIES)}, got {self.family!r}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if not isinstance(self.labels, list) or not all(isinstance(x, str) and x for x in self.labels):
            raise ConfigError(f"labels must be a list of non-empty strings, got {self.labels!r}")
        if len(set(self.labels)) != len(self.labels):
            raise ConfigError(f"labels must be distinct, got {self.labels!r}")
        if self.labels and self.family != "encoder":
            raise ConfigError("only an encoder has a classification head (labels)")
        if not isinstance(self.decoder_start_id, int) or not 0 <= self.decoder_start_id < self.vocab_size:
            raise ConfigError(f"decoder_start_id must be a token id below vocab_size, got {self.decoder_start_id!r}")
        if not self.layer_norm_eps > 0:
            raise ConfigError(f"layer_norm_eps must be positive, got {self.layer_norm_eps!r}")

    # --- (de)serialisation -------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def is_gpt2_shaped(self) -> list[str]:
        """Reasons this config cannot be expressed as a Hugging Face GPT-2 (empty if it can)."""
        reasons = []
        if self.family != "decoder":
            reasons.append(f"GPT-2 is a decoder (family='decoder'), this is {self.family!r}")
        if self.positional != "learned":
            reasons.append("GPT-2 uses learned positions (positional='learned')")
        if self.norm != "pre":
            reasons.append("GPT-2 is pre-LN (norm='pre')")
        if self.activation != "gelu":
            reasons.append("GPT-2 uses tanh-GELU (activation='gelu')")
        if not self.bias:
            reasons.append("GPT-2 has biases (bias=True)")
        if not self.tie_embeddings:
            reasons.append("GPT-2 ties the LM head to the embedding (tie_embeddings=True)")
        if self.scale_embeddings:
            reasons.append("GPT-2 does not scale embeddings (scale_embeddings=False)")
        return reasons

    def is_bert_shaped(self) -> list[str]:
        """Reasons this config cannot be expressed as a Hugging Face BERT (empty if it can)."""
        reasons = []
        if self.family != "encoder":
            reasons.append(f"BERT is an encoder (family='encoder'), this is {self.family!r}")
        if self.positional != "learned":
            reasons.append("BERT uses learned positions (positional='learned')")
        if self.norm != "post":
            reasons.append("BERT is post-LN (norm='post')")
        if not self.bias:
            reasons.append("BERT has biases (bias=True)")
        if not self.tie_embeddings:
            reasons.append("BERT ties the MLM decoder to the embedding (tie_embeddings=True)")
        if self.scale_embeddings:
            reasons.append("BERT does not scale embeddings (scale_embeddings=False)")
        return reasons

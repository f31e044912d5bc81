"""The model's hyper-parameters: one dataclass that round-trips through JSON.

An architecture is a config choosing parts (model/parts): GPT-2 is the defaults; Llama is
rotary positions, RMSNorm, a gated SiLU FFN (SwiGLU), no biases, grouped-query attention and
an untied head; Qwen2 adds biases to q/k/v only; Mistral adds a sliding window; Qwen3 drops
the biases and adds an RMSNorm over each head's queries and keys (qk_norm); GPT-NeoX (Pythia)
is partial rotary positions, LayerNorm and the parallel attention + FFN residual. Gemma 2 / 3,
Phi-3, OLMo 2, Granite, StableLM, GPT-J and Mixtral add the parts listed by `special_parts`
(soft-caps, per-layer windows and rotary bases, post-norms, multipliers, experts, ...).
Every field added since the first checkpoints has a default that means "as before", so their
config.json files still load.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from attnlens.model.family_parts import FAMILY_PARTS


class ConfigError(ValueError):
    """A configuration that cannot describe a working model."""


class ContextLengthError(ValueError):
    """The sequence does not fit in the model's context window (context_length)."""


POOLINGS = ("mean", "cls")
# Rotary scalings by their transformers name (rope_type); each with the keys it needs.
ROPE_SCALINGS = {
    "linear": ("factor",),  # positions divided by factor (Chen et al. 2023)
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


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
    positional: str = "learned"  # "learned" | "sinusoidal" | "rotary" (applied to queries and keys)
    norm: str = "pre"  # "pre" (GPT-2) | "post" (Vaswani et al. 2017)
    # "gelu" (tanh approximation, as GPT-2) | "relu" | "gelu_exact" (erf, as BERT) | "silu" (Llama's SwiGLU)
    activation: str = "gelu"
    bias: bool = True  # every linear layer and LayerNorm (unless qkv_bias / attn_out_bias / ffn_bias say otherwise)
    tie_embeddings: bool = True
    scale_embeddings: bool = False  # multiply token embeddings by sqrt(d_model)
    layer_norm_eps: float = 1e-5  # LayerNorm's or RMSNorm's epsilon
    # encoder only: the classification head's labels (none: no head) and how it pools
    labels: list[str] = field(default_factory=list)
    pooling: str = "mean"  # "mean" over non-padding positions | "cls" (the first position)
    # encoder only: False when the weights came without a masked-LM head (a transformers BertModel,
    # e.g. a sentence-transformers model): fill-mask is then not offered
    mlm_head: bool = True
    # encoder only: the classification head's own copies of the top blocks, fine-tuned for it (0:
    # none). classify runs the shared blocks below them, then these; every other task is unchanged
    classifier_layers: int = 0
    # encoder-decoder only: the token the decoder starts every target with (the tokenizer's EOS)
    decoder_start_id: int = 0
    # --- the parts of newer decoders (defaults: GPT-2's) ---------------------------------------
    # key/value heads: None = n_heads (multi-head); fewer = grouped-query (Llama 2 70B, Llama 3,
    # Mistral, Qwen2); 1 = multi-query. Query head h reads key/value head h // (n_heads / n_kv_heads).
    n_kv_heads: int | None = None
    head_dim: int | None = None  # None = d_model // n_heads; q/k/v project to n_heads * head_dim
    norm_type: str = "layernorm"  # "layernorm" | "rmsnorm" (Llama, Qwen2, Mistral)
    ffn: str = "plain"  # "plain": Linear, act, Linear | "gated": act(x W_gate) * (x W_up), then W_down
    parallel_residual: bool = False  # GPT-NeoX: x + attn(ln1(x)) + ffn(ln2(x)), one residual sum
    # biases of the linear layers: None = follow `bias` (Qwen2: q/k/v biased, o_proj not)
    qkv_bias: bool | None = None
    attn_out_bias: bool | None = None
    ffn_bias: bool | None = None
    # positional="rotary": the first int(head_dim * rotary_pct) dims of each query/key head are rotated
    rotary_pct: float = 1.0  # GPT-NeoX (Pythia): 0.25
    rope_theta: float = 10000.0  # the base of the rotary frequencies
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear" | "llama3", ...} (ROPE_SCALINGS)
    sliding_window: int | None = None  # Mistral: a query sees only the last `sliding_window` positions
    # Qwen3: an RMSNorm (eps layer_norm_eps, weights q_norm / k_norm of d_head) over each head's D dims
    # of the queries and of the keys, after their projection and before rotary positions (every
    # attention module: model/parts/attention.py)
    qk_norm: bool = False
    # --- Gemma 2 / 3 ---------------------------------------------------------------------------
    # the scores' factor: None = 1/sqrt(d_head); Gemma: query_pre_attn_scalar ** -0.5
    attn_scale: float | None = None
    # soft-capping (Gemma 2): scores = cap * tanh(scores / cap) before the mask, and the same on the
    # final logits; None = no cap. The capped scores have no fused kernel: attention takes the explicit path
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # which layers the sliding window applies to: None = every one (Mistral), else one entry a layer,
    # "sliding" (windowed by sliding_window) or "full" (Gemma 2: alternating; Gemma 3: 5 sliding, 1 full)
    layer_types: list[str] | None = None
    # the rotary base of the "sliding" layers (Gemma 3's rope_local_base_freq; they take no rope_scaling);
    # None = rope_theta for every layer
    rope_local_theta: float | None = None
    # a norm on each sub-layer's output before it joins the residual (Gemma 2 / 3: beside the pre-norms):
    # x = x + ln1_post(attn(ln1(x))); x = x + ln2_post(ffn(ln2(x)))
    post_norms: bool = False
    # the norms before each sub-layer (ln1, ln2); False (OLMo 2, with post_norms): none,
    # x = x + ln1_post(attn(x)); x = x + ln2_post(ffn(x))
    pre_norms: bool = True
    # what config.qk_norm normalises over: "head" (each head's D dims: Qwen3, Gemma 3), "all" (the
    # whole projection, H * D queries and K * D keys, before the split into heads: OLMo 2) or
    # "own" (each head's D dims by a LayerNorm without bias of the head's own weights: StableLM 2)
    qk_norm_over: str = "head"
    # parallel_residual with one norm (GPT-J, StableLM 2 12B): x + attn(ln1(x)) + ffn(ln1(x)), no ln2
    parallel_shared_norm: bool = False
    # --- GPT-J --------------------------------------------------------------------------------
    # rotary pairs (0, 1), (2, 3), ... of each head's rotated dims (GPT-J's rotate_every_two) instead
    # of (i, i + R/2) (GPT-NeoX's rotate_half, which Llama's checkpoints use)
    rotary_interleaved: bool = False
    lm_head_bias: bool = False  # a bias on the LM head (GPT-J)
    # --- Mixtral ------------------------------------------------------------------------------
    # a mixture of experts in place of the FFN: 0 = the dense FFN; else n_experts FFNs (each as
    # ffn / activation / d_ff say), a router scoring them per token, the experts_per_token best
    # kept and their outputs weighed by the softmax of the router's scores renormalised over them
    n_experts: int = 0
    experts_per_token: int = 2
    # --- Granite ------------------------------------------------------------------------------
    embedding_multiplier: float = 1.0  # the token embeddings times this (after scale_embeddings)
    residual_multiplier: float = 1.0  # each sub-layer's output times this before it joins the residual
    logits_divisor: float = 1.0  # the logits divided by this (Granite's logits_scaling)
    # the transformers class this model was imported from (e.g. "LlamaForCausalLM"): what it is
    # called, and the architecture `export-hf` writes back by default; None for attnlens' own
    architecture: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (what the KV cache stores per layer)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def rotary_dims(self) -> int:
        """Dims of each query/key head that rotary positions rotate (0 without them)."""
        return int(self.d_head * self.rotary_pct) if self.positional == "rotary" else 0

    @property
    def scores_scale(self) -> float:
        """What q . k is multiplied by before the softmax."""
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.d_head)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it sees every earlier position)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding":
            return None
        return self.sliding_window

    def bias_of(self, layer: str) -> bool:
        """Whether the linear layer "qkv", "attn_out" or "ffn" has a bias."""
        own = {"qkv": self.qkv_bias, "attn_out": self.attn_out_bias, "ffn": self.ffn_bias}[layer]
        return self.bias if own is None else own

    def validate(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("n_kv_heads", "head_dim", "sliding_window"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive integer or null, got {value!r}")
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            raise ConfigError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.kv_heads != 0:
            raise ConfigError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads}): "
                              "each key/value head serves the same number of query heads")
        if self.positional == "sinusoidal" and self.d_model % 2 != 0:
            raise ConfigError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout!r}")
        choices = {
            "positional": ("learned", "sinusoidal", "rotary"),
            "norm": ("pre", "post"),
            "activation": ("gelu", "relu", "gelu_exact", "silu"),
            "norm_type": ("layernorm", "rmsnorm"),
            "ffn": ("plain", "gated"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.family not in FAMILY_PARTS:  # the families this version builds (model/family_parts.py)
            raise ConfigError(f"family must be one of {tuple(FAMILY_PARTS)}, got {self.family!r}")
        if not 0 <= self.classifier_layers <= self.n_layers or (self.classifier_layers and not self.labels):
            raise ConfigError(f"classifier_layers must be 0..n_layers ({self.n_layers}) and needs labels, "
                              f"got {self.classifier_layers}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if not isinstance(self.labels, list) or not all(isinstance(x, str) and x for x in self.labels):
            raise ConfigError(f"labels must be a list of non-empty strings, got {self.labels!r}")
        if len(set(self.labels)) != len(self.labels):
            raise ConfigError(f"labels must be distinct, got {self.labels!r}")
        if not isinstance(self.decoder_start_id, int) or not 0 <= self.decoder_start_id < self.vocab_size:
            raise ConfigError(f"decoder_start_id must be a token id below vocab_size, got {self.decoder_start_id!r}")
        if not self.layer_norm_eps > 0:
            raise ConfigError(f"layer_norm_eps must be positive, got {self.layer_norm_eps!r}")
        for name in ("attn_scale", "attn_softcap", "final_softcap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0):
                raise ConfigError(f"{name} must be a positive number or null, got {value!r}")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_divisor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.layer_types is not None:
            if not isinstance(self.layer_types, list) or len(self.layer_types) != self.n_layers \
                    or any(t not in ("full", "sliding") for t in self.layer_types):
                raise ConfigError(f"layer_types must be null or one of 'full' / 'sliding' per layer "
                                  f"({self.n_layers}), got {self.layer_types!r}")
            if self.sliding_window is None and "sliding" in self.layer_types:
                raise ConfigError("layer_types has sliding layers: it needs a sliding_window")
        for name in ("n_experts", "experts_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ConfigError(f"experts_per_token must be 1..n_experts ({self.n_experts}), got {self.experts_per_token}")
        if self.lm_head_bias and self.tie_embeddings:
            raise ConfigError("lm_head_bias (GPT-J) needs an untied head (tie_embeddings=False)")
        if self.rope_local_theta is not None and self.positional != "rotary":
            raise ConfigError("rope_local_theta is a rotary base: it needs positional='rotary'")
        for name in ("parallel_residual", "bias", "tie_embeddings", "scale_embeddings", "qk_norm", "post_norms",
                     "pre_norms", "parallel_shared_norm", "rotary_interleaved", "lm_head_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("qkv_bias", "attn_out_bias", "ffn_bias"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true, false or null (= bias), got {getattr(self, name)!r}")
        if self.post_norms and (self.norm != "pre" or self.parallel_residual):
            raise ConfigError("post_norms (Gemma) needs norm='pre' and no parallel_residual")
        if not self.pre_norms and not self.post_norms:
            raise ConfigError("pre_norms=False (OLMo 2) needs post_norms: a block normalises somewhere")
        if self.qk_norm_over not in ("head", "all", "own"):
            raise ConfigError(f"qk_norm_over must be 'head', 'all' or 'own', got {self.qk_norm_over!r}")
        if self.parallel_shared_norm and not self.parallel_residual:
            raise ConfigError("parallel_shared_norm (GPT-J) needs parallel_residual")
        if self.parallel_residual and self.norm != "pre":
            raise ConfigError("parallel_residual (GPT-NeoX) needs norm='pre': both sub-layers read the block's input")
        self._validate_rotary()
        self._validate_family_parts()
        if self.architecture is not None and not (isinstance(self.architecture, str) and self.architecture):
            raise ConfigError(f"architecture must be a non-empty string or null, got {self.architecture!r}")

    def _validate_rotary(self) -> None:
        if not isinstance(self.rotary_pct, (int, float)) or isinstance(self.rotary_pct, bool) \
                or not 0.0 < self.rotary_pct <= 1.0:
            raise ConfigError(f"rotary_pct must be in (0, 1], got {self.rotary_pct!r}")
        if not isinstance(self.rope_theta, (int, float)) or isinstance(self.rope_theta, bool) or not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        if self.positional == "rotary":
            rot = self.rotary_dims
            if rot < 2 or rot % 2:
                raise ConfigError(f"rotary positions rotate pairs of dims: int(head_dim {self.d_head} x rotary_pct "
                                  f"{self.rotary_pct}) = {rot} must be even and at least 2")
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise ConfigError(f"rope_scaling must be an object or null, got {scaling!r}")
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ROPE_SCALINGS:
            raise ConfigError(f"rope_scaling rope_type {kind!r} is not supported (supported: "
                              f"{', '.join(ROPE_SCALINGS)})")
        for key in ROPE_SCALINGS[kind]:
            value = scaling.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"rope_scaling ({kind}) needs a positive number {key!r}, got {value!r}")
        if kind == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
            raise ConfigError("rope_scaling (llama3) needs high_freq_factor > low_freq_factor")
        if self.positional != "rotary":
            raise ConfigError("rope_scaling scales rotary positions: it needs positional='rotary'")

    def parts_used(self) -> set[str]:
        """The optional parts this config asks its family's module to build (Family.builds)."""
        used = {
            "rotary": self.positional == "rotary",
            "sliding_window": self.sliding_window is not None,
            "rmsnorm": self.norm_type != "layernorm",
            "grouped_query": self.kv_heads != self.n_heads,
            "parallel_residual": self.parallel_residual,
            "classifier": bool(self.labels),
        }
        return {name for name, on in used.items() if on}

    def _validate_family_parts(self) -> None:
        """Each family declares the optional parts its module builds (Family.builds): a config
        that asks its family for another is refused, naming it."""
        builds = FAMILY_PARTS[self.family]
        missing = sorted(self.parts_used() - set(builds))
        if missing:
            raise ConfigError(f"the {self.family} family does not build {', '.join(missing)} "
                              f"(it builds: {', '.join(sorted(builds)) or 'none of them'})")

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
        return reasons + self._classic_parts_reasons("GPT-2")

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
        if self.activation == "silu":
            reasons.append("BERT's activations are GELU or ReLU, not SiLU")
        return reasons + self._classic_parts_reasons("BERT")

    def special_parts(self) -> dict[str, str]:
        """The parts past Llama's this config uses (Gemma's and later), by field: {field: what it
        is}. An export to an architecture without one of them is refused, naming it."""
        parts = {
            "attn_scale": (self.attn_scale is not None, f"scores scaled by {self.attn_scale} (attn_scale)"),
            "attn_softcap": (self.attn_softcap is not None, "soft-capped attention scores (attn_softcap)"),
            "final_softcap": (self.final_softcap is not None, "soft-capped logits (final_softcap)"),
            "layer_types": (self.layer_types is not None, "sliding-window and full layers (layer_types)"),
            "rope_local_theta": (self.rope_local_theta is not None, "a rotary base per layer type (rope_local_theta)"),
            "post_norms": (self.post_norms, "norms after each sub-layer (post_norms)"),
            "embedding_multiplier": (self.embedding_multiplier != 1.0,
                                     f"embeddings multiplied by {self.embedding_multiplier} (embedding_multiplier)"),
            "residual_multiplier": (self.residual_multiplier != 1.0,
                                    f"sub-layer outputs multiplied by {self.residual_multiplier} (residual_multiplier)"),
            "logits_divisor": (self.logits_divisor != 1.0, f"logits divided by {self.logits_divisor} (logits_divisor)"),
            "rotary_interleaved": (self.rotary_interleaved, "rotary positions on interleaved pairs (rotary_interleaved)"),
            "lm_head_bias": (self.lm_head_bias, "a bias on the LM head (lm_head_bias)"),
            "n_experts": (self.n_experts > 0,
                          f"a mixture of {self.n_experts} experts, {self.experts_per_token} a token (n_experts)"),
            "pre_norms": (not self.pre_norms, "sub-layers without a norm before them (pre_norms=False)"),
            "qk_norm_over": (self.qk_norm_over != "head", f"a q/k norm over {self.qk_norm_over!r} (qk_norm_over)"),
            "parallel_shared_norm": (self.parallel_shared_norm, "one norm for attention and MLP (parallel_shared_norm)"),
        }
        return {name: what for name, (on, what) in parts.items() if on}

    def _classic_parts_reasons(self, name: str) -> list[str]:
        """What GPT-2 and BERT share: none of the newer decoders' parts."""
        reasons = [f"{name} has no {what}" for what in self.special_parts().values()]
        if self.kv_heads != self.n_heads:
            reasons.append(f"{name} has as many key/value heads as query heads (n_kv_heads={self.n_kv_heads})")
        if self.head_dim is not None and self.head_dim * self.n_heads != self.d_model:
            reasons.append(f"{name}'s heads split d_model (head_dim={self.head_dim})")
        if self.norm_type != "layernorm":
            reasons.append(f"{name} uses LayerNorm (norm_type='layernorm')")
        if self.ffn != "plain":
            reasons.append(f"{name}'s FFN is not gated (ffn='plain')")
        if self.parallel_residual:
            reasons.append(f"{name} adds attention and FFN in turn (parallel_residual=False)")
        if any(getattr(self, n) not in (None, self.bias) for n in ("qkv_bias", "attn_out_bias", "ffn_bias")):
            reasons.append(f"{name} has biases on every linear layer or none (qkv_bias, attn_out_bias, ffn_bias)")
        if self.sliding_window is not None:
            reasons.append(f"{name} attends to every earlier position (sliding_window=None)")
        if self.qk_norm:
            reasons.append(f"{name} does not normalise queries and keys (qk_norm=False)")
        return reasons

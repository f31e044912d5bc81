"""What an architecture module declares, and the helpers its declarations are made of.

An architecture (one module in this package) says:

    name, title, hf_class, model_type   how it is called here, in messages, and by transformers
    config_from_hf(data, path, cap)     transformers config.json -> ModelConfig (context length at
                                        most `cap` when given), refusing (with a CheckpointError
                                        naming the option) what we cannot run
    config_to_hf(config)                ModelConfig -> transformers config.json (export)
    export_reasons(config)              why a ModelConfig cannot be written as this architecture
    tensors(config)                     the weight-name map: one Rule per attnlens tensor
    ignored, renames, head              their tensors that are not weights (old buffers), other
                                        names a tensor is saved under, their LM head's name

model/interop/convert.py runs every architecture's import and export from these alone.
GPT-2 and BERT, whose converters predate this package, declare `import_dir` / `export_dir`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from attnlens.model.checkpoint import CheckpointError
from attnlens.model.config import ROPE_SCALINGS, ConfigError, ModelConfig

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """One attnlens tensor and the transformers tensor(s) it is made of.

    `join` builds ours from theirs (in `theirs` order); `split` gives theirs back from ours.
    Several of theirs are fused in one of ours (q|k|v, gate|up) by concatenating rows."""

    ours: str
    theirs: tuple[str, ...]
    join: Callable[[list[torch.Tensor]], torch.Tensor]
    split: Callable[[torch.Tensor], list[torch.Tensor]]


def same(ours: str, theirs: str) -> Rule:
    """A tensor that copies as it is."""
    return Rule(ours, (theirs,), lambda ts: ts[0], lambda t: [t])


def fused(ours: str, theirs: list[str], sizes: list[int]) -> Rule:
    """Ours is theirs concatenated along dim 0 (rows of sizes `sizes`): Llama's q_proj, k_proj,
    v_proj -> our qkv; gate_proj, up_proj -> our gated fc."""
    return Rule(ours, tuple(theirs), lambda ts: torch.cat(ts, dim=0), lambda t: list(t.split(sizes, dim=0)))


def converted(ours: str, theirs: str, to_ours: Callable[[torch.Tensor], torch.Tensor],
              to_theirs: Callable[[torch.Tensor], torch.Tensor]) -> Rule:
    """One tensor laid out differently (GPT-NeoX's per-head interleaved q|k|v)."""
    return Rule(ours, (theirs,), lambda ts: to_ours(ts[0]), lambda t: [to_theirs(t)])


@dataclass(frozen=True)
class Architecture:
    name: str  # what `export-hf --architecture` takes: "llama"
    title: str  # what messages call it: "Llama"
    hf_class: str  # config.json "architectures": "LlamaForCausalLM"
    model_type: str  # config.json "model_type": "llama"
    config_from_hf: Callable[[dict[str, Any], Path, int | None], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    export_reasons: Callable[[ModelConfig], list[str]]
    tensors: Callable[[ModelConfig], list[Rule]] | None = None
    ignored: tuple[str, ...] = ()  # suffixes of their tensor names that are buffers, not weights
    renames: tuple[tuple[str, str], ...] = ()  # (a name some files use, the name `tensors` uses)
    head: str = "lm_head.weight"  # their LM head: absent, or equal to the embedding, when tied
    # transformers classes besides hf_class whose weights are the same (None: any with this model_type)
    also_accepts: tuple[str, ...] | None = ()
    # converters of their own (GPT-2, BERT): (src, out, context_length) -> Path / (model_dir, out) -> Path
    import_dir: Callable[..., Path] | None = None
    export_dir: Callable[..., Path] | None = None


# --- reading a transformers config.json ------------------------------------------------------

class HFConfig:
    """A transformers config.json being translated: typed reads with the class's defaults, and
    the reasons to refuse gathered so that one error names every one."""

    def __init__(self, data: dict[str, Any], path: Path, title: str):
        self.data, self.path, self.title = data, path, title
        self.reasons: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def need(self, key: str, *fallbacks: str) -> Any:
        for k in (key, *fallbacks):
            if self.data.get(k) is not None:
                return self.data[k]
        raise CheckpointError(f"{self.path}: missing field {key!r}")

    def refuse(self, reason: str) -> None:
        self.reasons.append(reason)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            self.refuse(f"{key} must be true or false, got {value!r}")
            return default
        return value

    def check(self) -> None:
        """Refuse (CheckpointError) with every reason gathered, and anything quantised."""
        if self.data.get("quantization_config") is not None:
            method = self.data["quantization_config"].get("quant_method", "?") \
                if isinstance(self.data["quantization_config"], dict) else "?"
            self.refuse(f"quantized weights (quantization_config, {method}) are not supported")
        if self.reasons:
            raise CheckpointError(f"{self.path}: cannot import this {self.title}: " + "; ".join(self.reasons))

    def build(self, **fields) -> ModelConfig:
        """ModelConfig(**fields) once nothing was refused; a ConfigError becomes a CheckpointError."""
        self.check()
        try:
            return ModelConfig(**fields)
        except (ConfigError, TypeError, ValueError) as e:
            raise CheckpointError(f"{self.path}: invalid {self.title} config ({e})") from e


# transformers' hidden_act values and ours (gelu_fast and the others differ: refused)
ACTIVATIONS_FROM_HF = {"silu": "silu", "swish": "silu", "gelu": "gelu_exact", "gelu_new": "gelu",
                       "gelu_pytorch_tanh": "gelu", "relu": "relu"}
ACTIVATIONS_TO_HF = {"silu": "silu", "gelu_exact": "gelu", "gelu": "gelu_pytorch_tanh", "relu": "relu"}


def activation_from_hf(cfg: HFConfig, default: str) -> str:
    act = cfg.get("hidden_act", default)
    if act not in ACTIVATIONS_FROM_HF:
        cfg.refuse(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS_FROM_HF)})")
        return "silu"
    return ACTIVATIONS_FROM_HF[act]


def rope_from_hf(cfg: HFConfig, *, theta_key: str = "rope_theta", pct_key: str = "partial_rotary_factor",
                 default_pct: float = 1.0) -> dict[str, Any]:
    """rotary_pct, rope_theta and rope_scaling from either layout transformers writes:
    `rope_parameters` (transformers 5: {"rope_type", "rope_theta", "partial_rotary_factor",
    scaling keys}) or the older top-level rope_theta + `rope_scaling` ({"type" | "rope_type", ...}).
    Scalings other than ROPE_SCALINGS (dynamic, yarn, longrope, ...) are refused by name."""
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        cfg.refuse("rope_parameters / rope_scaling must be objects")
        params, legacy = {}, {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        cfg.refuse(f"rotary parameters per layer type ({', '.join(params)}) are not supported")
        params = {}
    merged = {**legacy, **params}
    theta = merged.get("rope_theta", cfg.get(theta_key, 10000.0))
    pct = merged.get("partial_rotary_factor", cfg.get(pct_key, default_pct))
    kind = merged.get("rope_type", merged.get("type", "default"))
    scaling = None
    if kind in ROPE_SCALINGS:
        scaling = {"rope_type": kind}
        for key in ROPE_SCALINGS[kind]:
            value = merged.get(key)
            if value is None and key == "original_max_position_embeddings":  # as transformers defaults it
                value = cfg.get("max_position_embeddings")
            scaling[key] = value
    elif kind != "default":
        cfg.refuse(f"rope scaling rope_type {kind!r} is not supported (supported: default, "
                   f"{', '.join(ROPE_SCALINGS)})")
    return {"rotary_pct": float(pct) if isinstance(pct, (int, float)) else pct,
            "rope_theta": float(theta) if isinstance(theta, (int, float)) else theta,
            "rope_scaling": scaling}


def rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    """rope_theta and rope_scaling as config.json keys that transformers 4 and 5 both read."""
    out: dict[str, Any] = {"rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        kind = config.rope_scaling.get("rope_type", config.rope_scaling.get("type"))
        assert kind is not None  # ModelConfig.validate (run when made): a rope_type of ROPE_SCALINGS
        out["rope_scaling"] = {"rope_type": kind, **{k: config.rope_scaling[k] for k in ROPE_SCALINGS[kind]}}
    return out


def context_length(cfg: HFConfig, cap: int | None, default: int) -> int:
    """max_position_embeddings, or `cap` when that is smaller (the KV cache holds a row of this
    many positions per concurrent request: Llama 3.1's 131072 is rarely what a server wants)."""
    n = cfg.get("max_position_embeddings", default)
    if cap is not None:
        if not isinstance(cap, int) or cap < 1:
            raise CheckpointError(f"context length cap must be a positive integer, got {cap!r}")
        n = min(n, cap) if isinstance(n, int) else n
    return n


def common_export_reasons(config: ModelConfig, title: str, *, qk_norm: bool = False,
                          has: tuple[str, ...] = ()) -> list[str]:
    """What no transformers decoder here can express: another family, learned positions beside
    rotary ones, scaled embeddings, post-LN; a q/k norm (config.qk_norm) where the
    architecture has none, or none where it has one (`qk_norm`: Qwen3); and the newer parts
    (ModelConfig.special_parts) but those it `has`."""
    reasons = [f"{title} has no {what}" for name, what in config.special_parts().items() if name not in has]
    if config.family != "decoder":
        reasons.append(f"{title} is a decoder (family='decoder'), this is {config.family!r}")
    if config.positional != "rotary":
        reasons.append(f"{title} uses rotary positions (positional='rotary')")
    if config.norm != "pre":
        reasons.append(f"{title} is pre-LN (norm='pre')")
    if config.scale_embeddings and "scale_embeddings" not in has:
        reasons.append(f"{title} does not scale embeddings (scale_embeddings=False)")
    if config.qk_norm != qk_norm:
        reasons.append(f"{title} normalises each head's queries and keys (qk_norm=True)" if qk_norm
                       else f"{title} does not normalise queries and keys (qk_norm=False)")
    return reasons

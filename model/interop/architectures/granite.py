"""Granite (GraniteForCausalLM: IBM Granite 3.x): a Llama (model/interop/architectures/llama.py,
the same names) with four multipliers: the embeddings times embedding_multiplier, each
sub-layer's output times residual_multiplier before the residual sum, the scores times
attention_multiplier (instead of 1/sqrt(head_dim): config.attn_scale), the logits divided by
logits_scaling (config.logits_divisor). Biases by attention_bias and mlp_bias, as Llama's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from attnlens.model.config import ModelConfig
from attnlens.model.interop.architectures.base import Architecture, HFConfig
from attnlens.model.interop.architectures.llama import (
    llama_tensors,
    rotary_decoder_config,
    rotary_decoder_hf,
    rotary_decoder_reasons,
)

MULTIPLIERS = {"embedding_multiplier": "embedding_multiplier", "residual_multiplier": "residual_multiplier",
               "logits_scaling": "logits_divisor"}  # theirs -> ours


def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    cfg = HFConfig(data, path, "Granite")
    values = {}
    for theirs in (*MULTIPLIERS, "attention_multiplier"):
        value = cfg.get(theirs, 1.0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            cfg.refuse(f"{theirs} must be a positive number, got {value!r}")
            value = 1.0
        values[theirs] = float(value)
    attention_bias, mlp_bias = cfg.flag("attention_bias", False), cfg.flag("mlp_bias", False)
    llama = rotary_decoder_config(cfg, cap, architecture="GraniteForCausalLM", qkv_bias=attention_bias,
                                  attn_out_bias=attention_bias, ffn_bias=mlp_bias)
    return replace(llama, attn_scale=values["attention_multiplier"], embedding_multiplier=values["embedding_multiplier"],
                   residual_multiplier=values["residual_multiplier"], logits_divisor=values["logits_scaling"])


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {**rotary_decoder_hf(config, "GraniteForCausalLM", "granite"), "attention_bias": config.bias_of("qkv"),
            "mlp_bias": config.bias_of("ffn"), "attention_multiplier": config.scores_scale,
            **{theirs: getattr(config, ours) for theirs, ours in MULTIPLIERS.items()}}


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = rotary_decoder_reasons(config, "Granite", has=("attn_scale", *MULTIPLIERS.values()))
    if config.bias_of("qkv") != config.bias_of("attn_out"):
        reasons.append("Granite's attention_bias covers q, k, v and o alike (qkv_bias == attn_out_bias)")
    if config.sliding_window is not None:
        reasons.append("Granite attends to every earlier position (sliding_window=None)")
    return reasons


ARCHITECTURE = Architecture(
    name="granite", title="Granite", hf_class="GraniteForCausalLM", model_type="granite",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=llama_tensors, ignored=(".rotary_emb.inv_freq",),
)

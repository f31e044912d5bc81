"""Mistral (MistralForCausalLM: Mistral 7B and its fine-tunes): a Llama without biases
(model/interop/architectures/llama.py, the same names) whose attention may be limited to a
sliding window: with `sliding_window` W, a query sees itself and the W - 1 positions before
it (config.sliding_window; the decoder family masks the rest, from each row's own positions).

Alternating layer types (Ministral's layer_types) are refused.
"""

from __future__ import annotations

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


def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    cfg = HFConfig(data, path, "Mistral")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        cfg.refuse(f"layer_types other than full_attention ({sorted(set(layer_types))}) are not supported")
    window = cfg.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        cfg.refuse(f"sliding_window must be a positive integer or null, got {window!r}")
        window = None
    return rotary_decoder_config(cfg, cap, architecture="MistralForCausalLM", qkv_bias=False, attn_out_bias=False,
                                 ffn_bias=False, sliding_window=window)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {**rotary_decoder_hf(config, "MistralForCausalLM", "mistral"), "sliding_window": config.sliding_window}


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = rotary_decoder_reasons(config, "Mistral")
    if config.bias_of("qkv") or config.bias_of("attn_out") or config.bias_of("ffn"):
        reasons.append("Mistral has no biases (qkv_bias, attn_out_bias, ffn_bias all False)")
    return reasons


ARCHITECTURE = Architecture(
    name="mistral", title="Mistral", hf_class="MistralForCausalLM", model_type="mistral",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=llama_tensors, ignored=(".rotary_emb.inv_freq",),
)

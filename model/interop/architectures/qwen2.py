"""Qwen2 (Qwen2ForCausalLM: Qwen2, Qwen2.5): a Llama (model/interop/architectures/llama.py,
the same names) whose q, k and v projections have biases and whose o_proj and MLP do not.

Qwen2's optional sliding window (use_sliding_window, from layer max_window_layers on) is
refused: the released models leave it off.
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
    cfg = HFConfig(data, path, "Qwen2")
    if cfg.get("use_sliding_window", False):
        cfg.refuse("use_sliding_window=true (a sliding window on the layers from max_window_layers on) "
                   "is not supported")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        cfg.refuse(f"layer_types other than full_attention ({sorted(set(layer_types))}) are not supported")
    return rotary_decoder_config(cfg, cap, architecture="Qwen2ForCausalLM", qkv_bias=True, attn_out_bias=False,
                                 ffn_bias=False)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {**rotary_decoder_hf(config, "Qwen2ForCausalLM", "qwen2"),
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": config.n_layers}


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = rotary_decoder_reasons(config, "Qwen2")
    if not config.bias_of("qkv") or config.bias_of("attn_out") or config.bias_of("ffn"):
        reasons.append("Qwen2 has biases on q, k, v only (qkv_bias=True, attn_out_bias=False, ffn_bias=False)")
    if config.sliding_window is not None:
        reasons.append("Qwen2 is exported without a sliding window (sliding_window=None)")
    return reasons


ARCHITECTURE = Architecture(
    name="qwen2", title="Qwen2", hf_class="Qwen2ForCausalLM", model_type="qwen2",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=llama_tensors, ignored=(".rotary_emb.inv_freq",),
)

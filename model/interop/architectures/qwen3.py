"""Qwen3 (Qwen3ForCausalLM): a Llama (model/interop/architectures/llama.py, the same names)
whose queries and keys are normalised per head: an RMSNorm over the head_dim dims of each
head (self_attn.q_norm, self_attn.k_norm; eps rms_norm_eps) after q_proj / k_proj and before
rotary positions (config.qk_norm, model/parts/attention.py). No biases unless attention_bias
(then on q, k, v and o alike, never the MLP); head_dim given in config.json (128 when absent,
as transformers' Qwen3Config has it); the head tied or not, by tie_word_embeddings.

Qwen3's optional sliding window (use_sliding_window, from layer max_window_layers on) is
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
    if data.get("head_dim") is None:  # Qwen3Config's default, not hidden_size // num_attention_heads
        data = {**data, "head_dim": 128}
    cfg = HFConfig(data, path, "Qwen3")
    if cfg.get("use_sliding_window", False):
        cfg.refuse("use_sliding_window=true (a sliding window on the layers from max_window_layers on) "
                   "is not supported")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        cfg.refuse(f"layer_types other than full_attention ({sorted(set(layer_types))}) are not supported")
    bias = cfg.flag("attention_bias", False)
    return rotary_decoder_config(cfg, cap, architecture="Qwen3ForCausalLM", qkv_bias=bias, attn_out_bias=bias,
                                 ffn_bias=False, qk_norm=True)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {**rotary_decoder_hf(config, "Qwen3ForCausalLM", "qwen3"), "attention_bias": config.bias_of("qkv"),
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": config.n_layers}


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = rotary_decoder_reasons(config, "Qwen3", qk_norm=True)
    if config.bias_of("qkv") != config.bias_of("attn_out") or config.bias_of("ffn"):
        reasons.append("Qwen3's attention_bias covers q, k, v and o alike and its MLP has none "
                       "(qkv_bias == attn_out_bias, ffn_bias=False)")
    if config.sliding_window is not None:
        reasons.append("Qwen3 is exported without a sliding window (sliding_window=None)")
    return reasons


ARCHITECTURE = Architecture(
    name="qwen3", title="Qwen3", hf_class="Qwen3ForCausalLM", model_type="qwen3",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=llama_tensors, ignored=(".rotary_emb.inv_freq",),
)

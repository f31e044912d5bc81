"""Phi-3 (Phi3ForCausalLM: Phi-3 mini / medium, Phi-3.5 mini, Phi-4 mini): a Llama
(model/interop/architectures/llama.py) whose q, k, v projections are one matrix (qkv_proj, rows
q then k then v: our own layout) and whose gate and up projections are one (gate_up_proj, rows
gate then up: our own), with an optional partial rotary factor (Phi-4 mini: 0.75) and an
optional sliding window on every layer. No biases. Names (ours <- Phi-3's)::

    tok_emb                <- model.embed_tokens
    blocks.i.ln1           <- model.layers.i.input_layernorm
    blocks.i.attn.qkv      <- model.layers.i.self_attn.qkv_proj
    blocks.i.attn.proj     <- model.layers.i.self_attn.o_proj
    blocks.i.ln2           <- model.layers.i.post_attention_layernorm
    blocks.i.ffn.fc        <- model.layers.i.mlp.gate_up_proj
    blocks.i.ffn.proj      <- model.layers.i.mlp.down_proj
    ln_f                   <- model.norm
    lm_head                <- lm_head (absent when tied)

LongRoPE (the 128k models' rope_scaling "longrope", short and long factors per frequency) is
refused by name: its scaling is not computed here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlens.model.config import ModelConfig
from attnlens.model.interop.architectures.base import Architecture, HFConfig, Rule, same
from attnlens.model.interop.architectures.llama import (
    rotary_decoder_config,
    rotary_decoder_hf,
    rotary_decoder_reasons,
)


def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    cfg = HFConfig(data, path, "Phi-3")
    window = cfg.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        cfg.refuse(f"sliding_window must be a positive integer or null, got {window!r}")
        window = None
    return rotary_decoder_config(cfg, cap, architecture="Phi3ForCausalLM", qkv_bias=False, attn_out_bias=False,
                                 ffn_bias=False, sliding_window=window, partial_rotary=True)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    out = rotary_decoder_hf(config, "Phi3ForCausalLM", "phi3")
    return {**out, "partial_rotary_factor": config.rotary_pct, "sliding_window": config.sliding_window,
            "original_max_position_embeddings": config.context_length, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "pad_token_id": None}  # not Phi3Config's 32000, which a smaller vocabulary lacks


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = [r for r in rotary_decoder_reasons(config, "Phi-3") if "rotary_pct" not in r]
    if config.bias_of("qkv") or config.bias_of("attn_out") or config.bias_of("ffn"):
        reasons.append("Phi-3 has no biases (qkv_bias, attn_out_bias, ffn_bias all False)")
    return reasons


def tensors(config: ModelConfig) -> list[Rule]:
    rules = [same("tok_emb.weight", "model.embed_tokens.weight"), same("ln_f.weight", "model.norm.weight")]
    if not config.tie_embeddings:
        rules.append(same("lm_head.weight", "lm_head.weight"))
    for i in range(config.n_layers):
        ours, layer = f"blocks.{i}.", f"model.layers.{i}."
        rules += [same(ours + "ln1.weight", layer + "input_layernorm.weight"),
                  same(ours + "attn.qkv.weight", layer + "self_attn.qkv_proj.weight"),
                  same(ours + "attn.proj.weight", layer + "self_attn.o_proj.weight"),
                  same(ours + "ln2.weight", layer + "post_attention_layernorm.weight"),
                  same(ours + "ffn.fc.weight", layer + "mlp.gate_up_proj.weight"),
                  same(ours + "ffn.proj.weight", layer + "mlp.down_proj.weight")]
    return rules


ARCHITECTURE = Architecture(
    name="phi3", title="Phi-3", hf_class="Phi3ForCausalLM", model_type="phi3",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=tensors, ignored=(".rotary_emb.inv_freq",),
)

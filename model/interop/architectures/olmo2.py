"""OLMo 2 (Olmo2ForCausalLM): a Llama (model/interop/architectures/llama.py) whose norms come
after each sub-layer instead of before (x = x + norm(attn(x)); x = x + norm(mlp(x)):
config.pre_norms=False, post_norms=True) and whose queries and keys are normalised by one
RMSNorm over the whole projection (H * D queries, K * D keys: qk_norm_over="all"), before
the split into heads and rotary positions. No biases unless attention_bias. Names (ours <- OLMo 2's)::

    tok_emb                <- model.embed_tokens
    blocks.i.attn.qkv      <- model.layers.i.self_attn.{q,k,v}_proj      (rows fused: q, k, v)
    blocks.i.attn.q_norm   <- model.layers.i.self_attn.q_norm            (H * D wide)
    blocks.i.attn.k_norm   <- model.layers.i.self_attn.k_norm            (K * D wide)
    blocks.i.attn.proj     <- model.layers.i.self_attn.o_proj
    blocks.i.ln1_post      <- model.layers.i.post_attention_layernorm
    blocks.i.ffn.fc        <- model.layers.i.mlp.{gate,up}_proj          (rows fused: gate, up)
    blocks.i.ffn.proj      <- model.layers.i.mlp.down_proj
    blocks.i.ln2_post      <- model.layers.i.post_feedforward_layernorm
    ln_f                   <- model.norm
    lm_head                <- lm_head (absent when tied)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from attnlens.model.config import ModelConfig
from attnlens.model.interop.architectures.base import Architecture, HFConfig, Rule, fused, same
from attnlens.model.interop.architectures.llama import (
    rotary_decoder_config,
    rotary_decoder_hf,
    rotary_decoder_reasons,
)


def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    cfg = HFConfig(data, path, "OLMo 2")
    bias = cfg.flag("attention_bias", False)
    llama = rotary_decoder_config(cfg, cap, architecture="Olmo2ForCausalLM", qkv_bias=bias, attn_out_bias=bias,
                                  ffn_bias=False, qk_norm=True)
    return replace(llama, pre_norms=False, post_norms=True, qk_norm_over="all")  # validated again


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {**rotary_decoder_hf(config, "Olmo2ForCausalLM", "olmo2"), "attention_bias": config.bias_of("qkv")}


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = rotary_decoder_reasons(config, "OLMo 2", qk_norm=True, has=("pre_norms", "post_norms", "qk_norm_over"))
    if config.pre_norms or not config.post_norms or config.qk_norm_over != "all":
        reasons.append("OLMo 2 normalises after each sub-layer only and its queries and keys over all heads "
                       "(pre_norms=False, post_norms=True, qk_norm_over='all')")
    if config.bias_of("qkv") != config.bias_of("attn_out") or config.bias_of("ffn"):
        reasons.append("OLMo 2's attention_bias covers q, k, v and o alike and its MLP has none")
    return reasons


def tensors(config: ModelConfig) -> list[Rule]:
    H, K, D, F = config.n_heads, config.kv_heads, config.d_head, config.d_ff
    rules = [same("tok_emb.weight", "model.embed_tokens.weight"), same("ln_f.weight", "model.norm.weight")]
    if not config.tie_embeddings:
        rules.append(same("lm_head.weight", "lm_head.weight"))
    for i in range(config.n_layers):
        ours, layer = f"blocks.{i}.", f"model.layers.{i}."
        attn = layer + "self_attn."
        for k in ["weight"] + (["bias"] if config.bias_of("qkv") else []):
            rules += [fused(ours + f"attn.qkv.{k}", [attn + f"{p}_proj.{k}" for p in "qkv"], [H * D, K * D, K * D]),
                      same(ours + f"attn.proj.{k}", attn + f"o_proj.{k}")]
        rules += [same(ours + f"attn.{n}.weight", attn + f"{n}.weight") for n in ("q_norm", "k_norm")]
        rules += [fused(ours + "ffn.fc.weight", [layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"], [F, F]),
                  same(ours + "ffn.proj.weight", layer + "mlp.down_proj.weight"),
                  same(ours + "ln1_post.weight", layer + "post_attention_layernorm.weight"),
                  same(ours + "ln2_post.weight", layer + "post_feedforward_layernorm.weight")]
    return rules


ARCHITECTURE = Architecture(
    name="olmo2", title="OLMo 2", hf_class="Olmo2ForCausalLM", model_type="olmo2",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=tensors, ignored=(".rotary_emb.inv_freq",),
)

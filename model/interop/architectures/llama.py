"""Llama (LlamaForCausalLM: Llama 2 and 3, TinyLlama, SmolLM, and whatever else is saved as one).

Parts: rotary positions (base rope_theta; scaling default, linear or llama3), RMSNorm before
each sub-layer and at the end, grouped-query attention (num_key_value_heads), SwiGLU
(gate_proj, up_proj, down_proj), no biases unless attention_bias / mlp_bias, an untied
lm_head unless tie_word_embeddings. Names (ours <- Llama's)::

    tok_emb                <- model.embed_tokens
    blocks.i.ln1           <- model.layers.i.input_layernorm
    blocks.i.attn.qkv      <- model.layers.i.self_attn.{q,k,v}_proj   (rows fused: q, k, v)
    blocks.i.attn.q_norm   <- model.layers.i.self_attn.q_norm         (with config.qk_norm: Qwen3)
    blocks.i.attn.k_norm   <- model.layers.i.self_attn.k_norm         (with config.qk_norm: Qwen3)
    blocks.i.attn.proj     <- model.layers.i.self_attn.o_proj
    blocks.i.ln2           <- model.layers.i.post_attention_layernorm
    blocks.i.ffn.fc        <- model.layers.i.mlp.{gate,up}_proj       (rows fused: gate, up)
    blocks.i.ffn.proj      <- model.layers.i.mlp.down_proj
    ln_f                   <- model.norm
    lm_head                <- lm_head (absent when tied)

Qwen2, Mistral and Qwen3 are Llamas with other biases, a sliding window or a per-head q/k
norm: their modules call `rotary_decoder_config`, `rotary_decoder_hf`, `rotary_decoder_reasons`
and `llama_tensors` with their differences.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlens.model.config import ModelConfig
from attnlens.model.interop.architectures.base import (
    ACTIVATIONS_TO_HF,
    Architecture,
    HFConfig,
    Rule,
    activation_from_hf,
    common_export_reasons,
    context_length,
    fused,
    rope_from_hf,
    rope_to_hf,
    same,
)


def rotary_decoder_config(cfg: HFConfig, cap: int | None, *, architecture: str, qkv_bias: bool, attn_out_bias: bool,
                          ffn_bias: bool, sliding_window: int | None = None, qk_norm: bool = False,
                          partial_rotary: bool = False) -> ModelConfig:
    """The ModelConfig of a Llama-shaped config.json (Llama, Qwen2, Mistral, Qwen3, Phi-3): their
    differences are the biases, the sliding window, the q/k norm and whether a partial_rotary_factor
    is theirs (Phi-3), passed in."""
    rope = rope_from_hf(cfg)
    if rope["rotary_pct"] != 1.0 and not partial_rotary:
        cfg.refuse(f"partial_rotary_factor {rope['rotary_pct']} is not supported by {cfg.title} (it rotates whole heads)")
        rope["rotary_pct"] = 1.0
    d_model, n_heads = cfg.need("hidden_size"), cfg.need("num_attention_heads")
    n_kv = cfg.get("num_key_value_heads", n_heads)
    head_dim = cfg.get("head_dim")
    if isinstance(d_model, int) and isinstance(n_heads, int) and n_heads and head_dim == d_model // n_heads \
            and d_model % n_heads == 0:
        head_dim = None  # the default split: leave it implied
    return cfg.build(
        vocab_size=cfg.need("vocab_size"),
        context_length=context_length(cfg, cap, 2048),
        d_model=d_model,
        n_layers=cfg.need("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=None if n_kv == n_heads else n_kv,
        head_dim=head_dim,
        d_ff=cfg.need("intermediate_size"),
        dropout=0.0,  # attention_dropout only matters while training
        positional="rotary",
        norm="pre",
        norm_type="rmsnorm",
        activation=activation_from_hf(cfg, "silu"),
        ffn="gated",
        bias=False,
        qkv_bias=qkv_bias or None,
        attn_out_bias=attn_out_bias or None,
        ffn_bias=ffn_bias or None,
        tie_embeddings=cfg.flag("tie_word_embeddings", False),
        layer_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        sliding_window=sliding_window,
        qk_norm=qk_norm,
        architecture=architecture,
        **rope,
    )


def rotary_decoder_hf(config: ModelConfig, hf_class: str, model_type: str) -> dict[str, Any]:
    """The config.json keys Llama, Qwen2 and Mistral share."""
    return {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.d_head,
        "hidden_act": ACTIVATIONS_TO_HF[config.activation],
        "max_position_embeddings": config.context_length,
        "rms_norm_eps": config.layer_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        **rope_to_hf(config),
    }


def rotary_decoder_reasons(config: ModelConfig, title: str, *, qk_norm: bool = False,
                           has: tuple[str, ...] = ()) -> list[str]:
    """Why a config is not a Llama-shaped decoder at all (before each one's own biases);
    `qk_norm`: whether this one normalises queries and keys (Qwen3); `has`: the newer parts it
    has (ModelConfig.special_parts: OLMo 2's post-norms)."""
    reasons = common_export_reasons(config, title, qk_norm=qk_norm, has=has)
    if config.norm_type != "rmsnorm":
        reasons.append(f"{title} uses RMSNorm (norm_type='rmsnorm')")
    if config.ffn != "gated":
        reasons.append(f"{title}'s FFN is gated (ffn='gated')")
    if config.parallel_residual:
        reasons.append(f"{title} adds attention and FFN in turn (parallel_residual=False)")
    if config.positional == "rotary" and config.rotary_pct != 1.0:
        reasons.append(f"{title} rotates whole heads (rotary_pct=1.0)")
    return reasons


def llama_tensors(config: ModelConfig) -> list[Rule]:
    H, K, D, F = config.n_heads, config.kv_heads, config.d_head, config.d_ff
    rules = [same("tok_emb.weight", "model.embed_tokens.weight"), same("ln_f.weight", "model.norm.weight")]
    if not config.tie_embeddings:
        rules.append(same("lm_head.weight", "lm_head.weight"))
    for i in range(config.n_layers):
        ours, attn, mlp = f"blocks.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        kinds = ["weight"] + (["bias"] if config.bias_of("qkv") else [])
        rules += [fused(ours + f"attn.qkv.{k}", [attn + f"{p}_proj.{k}" for p in "qkv"], [H * D, K * D, K * D])
                  for k in kinds]
        if config.qk_norm:
            rules += [same(ours + f"attn.{n}.weight", attn + f"{n}.weight") for n in ("q_norm", "k_norm")]
        rules += [same(ours + f"attn.proj.{k}", attn + f"o_proj.{k}")
                  for k in ["weight"] + (["bias"] if config.bias_of("attn_out") else [])]
        for k in ["weight"] + (["bias"] if config.bias_of("ffn") else []):
            rules += [fused(ours + f"ffn.fc.{k}", [mlp + f"gate_proj.{k}", mlp + f"up_proj.{k}"], [F, F]),
                      same(ours + f"ffn.proj.{k}", mlp + f"down_proj.{k}")]
        rules += [same(ours + "ln1.weight", f"model.layers.{i}.input_layernorm.weight"),
                  same(ours + "ln2.weight", f"model.layers.{i}.post_attention_layernorm.weight")]
    return rules


# --- Llama itself ----------------------------------------------------------------------------

def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    cfg = HFConfig(data, path, "Llama")
    attention_bias, mlp_bias = cfg.flag("attention_bias", False), cfg.flag("mlp_bias", False)
    return rotary_decoder_config(cfg, cap, architecture="LlamaForCausalLM", qkv_bias=attention_bias,
                                 attn_out_bias=attention_bias, ffn_bias=mlp_bias)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {**rotary_decoder_hf(config, "LlamaForCausalLM", "llama"),
            "attention_bias": config.bias_of("qkv"), "mlp_bias": config.bias_of("ffn")}


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = rotary_decoder_reasons(config, "Llama")
    if config.bias_of("qkv") != config.bias_of("attn_out"):
        reasons.append("Llama's attention_bias covers q, k, v and o alike (qkv_bias == attn_out_bias)")
    if config.sliding_window is not None:
        reasons.append("Llama attends to every earlier position (sliding_window=None)")
    return reasons


ARCHITECTURE = Architecture(
    name="llama", title="Llama", hf_class="LlamaForCausalLM", model_type="llama",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=llama_tensors,
    ignored=(".rotary_emb.inv_freq",),  # a buffer older transformers saved in every layer
)

"""StableLM (StableLmForCausalLM: StableLM 2 1.6B / 12B, StableLM 3B 4E1T, Zephyr).

Parts: partial rotary positions (partial_rotary_factor: 0.25), LayerNorm with biases, q/k/v
biases by use_qkv_bias (o_proj none), a SwiGLU MLP without biases, grouped-query attention,
optionally the parallel residual with one norm (use_parallel_residual: x + attn(ln1(x)) +
mlp(ln1(x)), StableLM 2 12B) and a LayerNorm per head on queries and keys, each head its own
weights (qk_layernorm: qk_norm_over="own"), an untied head. Names (ours <- StableLM's)::

    tok_emb                <- model.embed_tokens
    blocks.i.ln1           <- model.layers.i.input_layernorm
    blocks.i.attn.qkv      <- model.layers.i.self_attn.{q,k,v}_proj          (rows fused: q, k, v)
    blocks.i.attn.q_norm   <- model.layers.i.self_attn.q_layernorm.norms.h   (stacked: (H, D))
    blocks.i.attn.k_norm   <- model.layers.i.self_attn.k_layernorm.norms.h   (stacked: (K, D))
    blocks.i.attn.proj     <- model.layers.i.self_attn.o_proj
    blocks.i.ln2           <- model.layers.i.post_attention_layernorm        (none when parallel)
    blocks.i.ffn.fc        <- model.layers.i.mlp.{gate,up}_proj              (rows fused: gate, up)
    blocks.i.ffn.proj      <- model.layers.i.mlp.down_proj
    ln_f                   <- model.norm
    lm_head                <- lm_head (absent when tied)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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


def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    cfg = HFConfig(data, path, "StableLM")
    rope = rope_from_hf(cfg, default_pct=0.25)
    n_heads = cfg.need("num_attention_heads")
    n_kv = cfg.get("num_key_value_heads", n_heads)
    parallel, qk = cfg.flag("use_parallel_residual", False), cfg.flag("qk_layernorm", False)
    return cfg.build(
        vocab_size=cfg.need("vocab_size"),
        context_length=context_length(cfg, cap, 4096),
        d_model=cfg.need("hidden_size"),
        n_layers=cfg.need("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=None if n_kv == n_heads else n_kv,
        d_ff=cfg.need("intermediate_size"),
        dropout=0.0,
        positional="rotary",
        norm="pre",
        norm_type="layernorm",
        activation=activation_from_hf(cfg, "silu"),
        ffn="gated",
        bias=True,  # the LayerNorms'
        qkv_bias=cfg.flag("use_qkv_bias", False),
        attn_out_bias=False,
        ffn_bias=False,
        parallel_residual=parallel,
        parallel_shared_norm=parallel,
        qk_norm=qk,
        qk_norm_over="own" if qk else "head",
        tie_embeddings=cfg.flag("tie_word_embeddings", False),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
        architecture="StableLmForCausalLM",
        **rope,
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["StableLmForCausalLM"],
        "model_type": "stablelm",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "hidden_act": ACTIVATIONS_TO_HF[config.activation],
        "max_position_embeddings": config.context_length,
        "layer_norm_eps": config.layer_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "use_qkv_bias": config.bias_of("qkv"),
        "qk_layernorm": config.qk_norm,
        "use_parallel_residual": config.parallel_residual,
        "partial_rotary_factor": config.rotary_pct,
        **rope_to_hf(config),
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = common_export_reasons(config, "StableLM", qk_norm=config.qk_norm,
                                    has=("qk_norm_over", "parallel_shared_norm"))
    if config.norm_type != "layernorm" or not config.bias:
        reasons.append("StableLM uses LayerNorm with biases (norm_type='layernorm', bias=True)")
    if config.ffn != "gated" or config.bias_of("ffn") or config.bias_of("attn_out"):
        reasons.append("StableLM's MLP is gated without biases and its o_proj has none (ffn='gated', "
                       "ffn_bias=False, attn_out_bias=False)")
    if config.qk_norm and config.qk_norm_over != "own":
        reasons.append("StableLM's q/k norm is a LayerNorm of each head's own weights (qk_norm_over='own')")
    if config.parallel_residual != config.parallel_shared_norm:
        reasons.append("StableLM's parallel residual reads one norm (parallel_shared_norm=parallel_residual)")
    if config.d_head * config.n_heads != config.d_model:
        reasons.append("StableLM's heads split hidden_size (head_dim=None)")
    if config.sliding_window is not None:
        reasons.append("StableLM attends to every earlier position (sliding_window=None)")
    return reasons


def stacked(ours: str, theirs: list[str]) -> Rule:
    """Ours (N, D) is their N (D,) weights stacked (one LayerNorm per head)."""
    return Rule(ours, tuple(theirs), lambda ts: torch.stack(ts), lambda t: list(t.unbind(0)))


def tensors(config: ModelConfig) -> list[Rule]:
    H, K, D, F = config.n_heads, config.kv_heads, config.d_head, config.d_ff
    rules = [same("tok_emb.weight", "model.embed_tokens.weight")]
    rules += [same(f"ln_f.{k}", f"model.norm.{k}") for k in ("weight", "bias")]
    if not config.tie_embeddings:
        rules.append(same("lm_head.weight", "lm_head.weight"))
    for i in range(config.n_layers):
        ours, layer = f"blocks.{i}.", f"model.layers.{i}."
        attn = layer + "self_attn."
        rules += [fused(ours + f"attn.qkv.{k}", [attn + f"{p}_proj.{k}" for p in "qkv"], [H * D, K * D, K * D])
                  for k in ["weight"] + (["bias"] if config.bias_of("qkv") else [])]
        rules += [same(ours + "attn.proj.weight", attn + "o_proj.weight"),
                  fused(ours + "ffn.fc.weight", [layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"], [F, F]),
                  same(ours + "ffn.proj.weight", layer + "mlp.down_proj.weight")]
        rules += [same(ours + f"ln1.{k}", layer + f"input_layernorm.{k}") for k in ("weight", "bias")]
        if not config.parallel_shared_norm:
            rules += [same(ours + f"ln2.{k}", layer + f"post_attention_layernorm.{k}") for k in ("weight", "bias")]
        if config.qk_norm:
            rules += [stacked(ours + "attn.q_norm.weight", [attn + f"q_layernorm.norms.{h}.weight" for h in range(H)]),
                      stacked(ours + "attn.k_norm.weight", [attn + f"k_layernorm.norms.{h}.weight" for h in range(K)])]
    return rules


ARCHITECTURE = Architecture(
    name="stablelm", title="StableLM", hf_class="StableLmForCausalLM", model_type="stablelm",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=tensors, ignored=(".rotary_emb.inv_freq",),
)

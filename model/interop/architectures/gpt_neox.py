"""GPT-NeoX (GPTNeoXForCausalLM: Pythia, GPT-NeoX-20B).

Parts: partial rotary positions (rotary_pct of each head, base rotary_emb_base), LayerNorm
with biases, the parallel residual x + attn(ln1(x)) + mlp(ln2(x)) (use_parallel_residual),
a plain GELU MLP with biases, attention biases unless attention_bias=false, an untied head
(embed_out) unless tie_word_embeddings. Names (ours <- GPT-NeoX's)::

    tok_emb                <- gpt_neox.embed_in
    blocks.i.ln1           <- gpt_neox.layers.i.input_layernorm
    blocks.i.attn.qkv      <- gpt_neox.layers.i.attention.query_key_value  (rows per head
                              interleaved: q_h, k_h, v_h; ours: all q, then all k, then all v)
    blocks.i.attn.proj     <- gpt_neox.layers.i.attention.dense
    blocks.i.ln2           <- gpt_neox.layers.i.post_attention_layernorm
    blocks.i.ffn.fc        <- gpt_neox.layers.i.mlp.dense_h_to_4h
    blocks.i.ffn.proj      <- gpt_neox.layers.i.mlp.dense_4h_to_h
    ln_f                   <- gpt_neox.final_layer_norm
    lm_head                <- embed_out (transformers 5 calls it lm_head; both are read)
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
    converted,
    rope_from_hf,
    rope_to_hf,
    same,
)


def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    cfg = HFConfig(data, path, "GPT-NeoX")
    rope = rope_from_hf(cfg, theta_key="rotary_emb_base", pct_key="rotary_pct", default_pct=0.25)
    attention_bias = cfg.flag("attention_bias", True)
    return cfg.build(
        vocab_size=cfg.need("vocab_size"),
        context_length=context_length(cfg, cap, 2048),
        d_model=cfg.need("hidden_size"),
        n_layers=cfg.need("num_hidden_layers"),
        n_heads=cfg.need("num_attention_heads"),
        d_ff=cfg.need("intermediate_size"),
        dropout=0.0,  # attention_dropout / hidden_dropout only matter while training
        positional="rotary",
        norm="pre",
        norm_type="layernorm",
        activation=activation_from_hf(cfg, "gelu"),
        ffn="plain",
        parallel_residual=cfg.flag("use_parallel_residual", True),
        bias=True,
        qkv_bias=None if attention_bias else False,
        attn_out_bias=None if attention_bias else False,
        tie_embeddings=cfg.flag("tie_word_embeddings", False),
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
        architecture="GPTNeoXForCausalLM",
        **rope,
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    rope = rope_to_hf(config)
    return {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "intermediate_size": config.d_ff,
        "hidden_act": ACTIVATIONS_TO_HF[config.activation],
        "max_position_embeddings": config.context_length,
        "layer_norm_eps": config.layer_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "use_parallel_residual": config.parallel_residual,
        "attention_bias": config.bias_of("qkv"),
        "rotary_pct": config.rotary_pct,
        "rotary_emb_base": rope.pop("rope_theta"),
        **rope,  # rope_scaling, when there is one
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = common_export_reasons(config, "GPT-NeoX")
    if config.norm_type != "layernorm" or not config.bias:
        reasons.append("GPT-NeoX uses LayerNorm with biases (norm_type='layernorm', bias=True)")
    if config.ffn != "plain" or not config.bias_of("ffn"):
        reasons.append("GPT-NeoX's MLP is plain, with biases (ffn='plain', ffn_bias=True)")
    if config.bias_of("qkv") != config.bias_of("attn_out"):
        reasons.append("GPT-NeoX's attention_bias covers query_key_value and dense alike")
    if config.kv_heads != config.n_heads:
        reasons.append("GPT-NeoX has as many key/value heads as query heads (n_kv_heads=None)")
    if config.d_head * config.n_heads != config.d_model:
        reasons.append("GPT-NeoX's heads split d_model (head_dim=None)")
    if config.sliding_window is not None:
        reasons.append("GPT-NeoX attends to every earlier position (sliding_window=None)")
    return reasons


def interleaved_to_ours(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(3C, ...) rows per head [q_h; k_h; v_h] -> rows [q; k; v], each head in order."""
    rest = t.shape[1:]
    return t.reshape(n_heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def ours_to_interleaved(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(3, n_heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def tensors(config: ModelConfig) -> list[Rule]:
    H = config.n_heads
    rules = [same("tok_emb.weight", "gpt_neox.embed_in.weight"),
             same("ln_f.weight", "gpt_neox.final_layer_norm.weight"),
             same("ln_f.bias", "gpt_neox.final_layer_norm.bias")]
    if not config.tie_embeddings:
        rules.append(same("lm_head.weight", "embed_out.weight"))
    for i in range(config.n_layers):
        ours, theirs = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        for k in ("weight", "bias"):
            rules += [same(ours + f"ln1.{k}", theirs + f"input_layernorm.{k}"),
                      same(ours + f"ln2.{k}", theirs + f"post_attention_layernorm.{k}"),
                      same(ours + f"ffn.fc.{k}", theirs + f"mlp.dense_h_to_4h.{k}"),
                      same(ours + f"ffn.proj.{k}", theirs + f"mlp.dense_4h_to_h.{k}")]
        for k in ["weight"] + (["bias"] if config.bias_of("qkv") else []):
            rules += [converted(ours + f"attn.qkv.{k}", theirs + f"attention.query_key_value.{k}",
                                lambda t: interleaved_to_ours(t, H), lambda t: ours_to_interleaved(t, H)),
                      same(ours + f"attn.proj.{k}", theirs + f"attention.dense.{k}")]
    return rules


ARCHITECTURE = Architecture(
    name="gpt_neox", title="GPT-NeoX", hf_class="GPTNeoXForCausalLM", model_type="gpt_neox",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons, tensors=tensors,
    # buffers older transformers saved in every layer: the causal mask, its fill value, the frequencies
    ignored=(".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq"),
    renames=(("lm_head.weight", "embed_out.weight"),), head="embed_out.weight",
)

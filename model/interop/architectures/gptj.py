"""GPT-J (GPTJForCausalLM: GPT-J 6B and its fine-tunes).

Parts: rotary positions on the first rotary_dim dims of each head, rotated in interleaved pairs
(0, 1), (2, 3), ... (config.rotary_interleaved), the parallel residual with one LayerNorm
(x + attn(ln_1(x)) + mlp(ln_1(x)): parallel_shared_norm), attention without biases, a plain
MLP with biases and tanh GELU (gelu_new), an untied LM head with a bias (lm_head_bias).
Names (ours <- GPT-J's)::

    tok_emb                <- transformer.wte
    blocks.i.ln1           <- transformer.h.i.ln_1
    blocks.i.attn.qkv      <- transformer.h.i.attn.{q,k,v}_proj  (rows fused: q, k, v)
    blocks.i.attn.proj     <- transformer.h.i.attn.out_proj
    blocks.i.ffn.fc        <- transformer.h.i.mlp.fc_in
    blocks.i.ffn.proj      <- transformer.h.i.mlp.fc_out
    ln_f                   <- transformer.ln_f
    lm_head                <- lm_head (weight and bias)
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
    same,
)


def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    cfg = HFConfig({**data, "hidden_act": data.get("activation_function", "gelu_new"),
                    "max_position_embeddings": data.get("n_positions", 2048)}, path, "GPT-J")
    d_model, n_heads = cfg.need("n_embd", "hidden_size"), cfg.need("n_head", "num_attention_heads")
    rotary_dim = cfg.get("rotary_dim")
    if rotary_dim is None:
        cfg.refuse("rotary_dim null (GPT-J then rotates by hidden_size's frequencies) is not supported")
    if cfg.get("rope_scaling") is not None:
        cfg.refuse("rope_scaling is not supported by GPT-J")
    head_dim = d_model // n_heads if isinstance(d_model, int) and isinstance(n_heads, int) and n_heads else 1
    n_inner = cfg.get("n_inner") or (4 * d_model if isinstance(d_model, int) else d_model)
    if cfg.flag("tie_word_embeddings", False):
        cfg.refuse("a tied head (tie_word_embeddings=true) is not supported: GPT-J's head has a bias")
    return cfg.build(
        vocab_size=cfg.need("vocab_size"),
        context_length=context_length(cfg, cap, 2048),
        d_model=d_model,
        n_layers=cfg.need("n_layer", "num_hidden_layers"),
        n_heads=n_heads,
        d_ff=n_inner,
        dropout=0.0,
        positional="rotary",
        norm="pre",
        norm_type="layernorm",
        activation=activation_from_hf(cfg, "gelu_new"),
        ffn="plain",
        bias=True,
        qkv_bias=False,
        attn_out_bias=False,
        parallel_residual=True,
        parallel_shared_norm=True,
        rotary_interleaved=True,
        rotary_pct=(rotary_dim or head_dim) / head_dim,
        rope_theta=10000.0,
        tie_embeddings=False,
        lm_head_bias=True,
        layer_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        architecture="GPTJForCausalLM",
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        "architectures": ["GPTJForCausalLM"],
        "model_type": "gptj",
        "vocab_size": config.vocab_size,
        "n_positions": config.context_length,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.d_ff,
        "rotary_dim": config.rotary_dims,
        "activation_function": ACTIVATIONS_TO_HF[config.activation].replace("gelu_pytorch_tanh", "gelu_new"),
        "layer_norm_epsilon": config.layer_norm_eps,
        "tie_word_embeddings": False,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = common_export_reasons(config, "GPT-J", has=("rotary_interleaved", "lm_head_bias", "parallel_shared_norm"))
    if not (config.rotary_interleaved and config.lm_head_bias and config.parallel_shared_norm):
        reasons.append("GPT-J rotates interleaved pairs, has a bias on its head and one norm for attention and MLP "
                       "(rotary_interleaved, lm_head_bias, parallel_shared_norm)")
    if config.norm_type != "layernorm" or not config.bias or config.ffn != "plain" or not config.bias_of("ffn"):
        reasons.append("GPT-J uses LayerNorm with biases and a plain MLP with biases")
    if config.bias_of("qkv") or config.bias_of("attn_out"):
        reasons.append("GPT-J's attention has no biases (qkv_bias=False, attn_out_bias=False)")
    if config.kv_heads != config.n_heads or config.d_head * config.n_heads != config.d_model:
        reasons.append("GPT-J's heads split n_embd, as many for keys as for queries (n_kv_heads, head_dim None)")
    if config.sliding_window is not None or config.rope_scaling is not None or config.rope_theta != 10000.0:
        reasons.append("GPT-J attends to every earlier position with unscaled rotary positions of base 10000")
    return reasons


def tensors(config: ModelConfig) -> list[Rule]:
    C = config.d_model
    rules = [same("tok_emb.weight", "transformer.wte.weight"), same("lm_head.weight", "lm_head.weight"),
             same("lm_head.bias", "lm_head.bias")]
    rules += [same(f"ln_f.{k}", f"transformer.ln_f.{k}") for k in ("weight", "bias")]
    for i in range(config.n_layers):
        ours, layer = f"blocks.{i}.", f"transformer.h.{i}."
        rules += [fused(ours + "attn.qkv.weight", [layer + f"attn.{p}_proj.weight" for p in "qkv"], [C, C, C]),
                  same(ours + "attn.proj.weight", layer + "attn.out_proj.weight")]
        for k in ("weight", "bias"):
            rules += [same(ours + f"ln1.{k}", layer + f"ln_1.{k}"), same(ours + f"ffn.fc.{k}", layer + f"mlp.fc_in.{k}"),
                      same(ours + f"ffn.proj.{k}", layer + f"mlp.fc_out.{k}")]
    return rules


ARCHITECTURE = Architecture(
    name="gptj", title="GPT-J", hf_class="GPTJForCausalLM", model_type="gptj",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=tensors, ignored=(".attn.bias", ".attn.masked_bias", ".attn.rotary_emb.inv_freq"),
)

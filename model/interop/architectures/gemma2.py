"""Gemma 2 (Gemma2ForCausalLM).

Parts: rotary positions, grouped-query attention with its own head_dim, the scores scaled by
query_pre_attn_scalar ** -0.5 (config.attn_scale) and soft-capped (attn_logit_softcapping:
cap * tanh(s / cap) before the mask), sliding-window layers alternating with full ones
(layer_types; the window sliding_window), RMSNorms before and after each sub-layer (post_norms),
a GeGLU MLP with tanh GELU, the embedding scaled by sqrt(hidden_size), the logits soft-capped
(final_logit_softcapping), a tied head unless tie_word_embeddings=false.

Gemma's RMSNorm multiplies by (1 + w): the weights are stored here as 1 + w (as llama.cpp's
GGUF files store them), so the norm is our plain RMSNorm. Names (ours <- Gemma 2's)::

    tok_emb                <- model.embed_tokens
    blocks.i.ln1           <- model.layers.i.input_layernorm             (1 + w)
    blocks.i.attn.qkv      <- model.layers.i.self_attn.{q,k,v}_proj      (rows fused: q, k, v)
    blocks.i.attn.q_norm   <- model.layers.i.self_attn.q_norm            (Gemma 3; 1 + w)
    blocks.i.attn.k_norm   <- model.layers.i.self_attn.k_norm            (Gemma 3; 1 + w)
    blocks.i.attn.proj     <- model.layers.i.self_attn.o_proj
    blocks.i.ln1_post      <- model.layers.i.post_attention_layernorm    (1 + w)
    blocks.i.ln2           <- model.layers.i.pre_feedforward_layernorm   (1 + w)
    blocks.i.ffn.fc        <- model.layers.i.mlp.{gate,up}_proj          (rows fused: gate, up)
    blocks.i.ffn.proj      <- model.layers.i.mlp.down_proj
    blocks.i.ln2_post      <- model.layers.i.post_feedforward_layernorm  (1 + w)
    ln_f                   <- model.norm                                 (1 + w)
    lm_head                <- lm_head (absent when tied)
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
    converted,
    fused,
    rope_from_hf,
    rope_to_hf,
    same,
)

LAYER_TYPES_FROM_HF = {"sliding_attention": "sliding", "full_attention": "full"}
LAYER_TYPES_TO_HF = {v: k for k, v in LAYER_TYPES_FROM_HF.items()}


def plus_one(t):
    return t + 1


def minus_one(t):
    return t - 1


def gemma_norm(ours: str, theirs: str) -> Rule:
    """A Gemma RMSNorm weight w (it multiplies by 1 + w) as ours (which multiplies by the weight)."""
    return converted(ours, theirs, plus_one, minus_one)


def layer_types_from_hf(cfg: HFConfig, window: Any, pattern: int) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) of config.json's layer_types: None when every layer is alike.
    Without layer_types (the configs Gemma 2 and 3 were released with) transformers' default: every
    `pattern`-th layer full, the others sliding (Gemma 2: 2, from a sliding first layer; Gemma 3:
    sliding_window_pattern, 6)."""
    given = cfg.get("layer_types")
    if given is None:
        n = cfg.need("num_hidden_layers")
        given = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)] \
            if isinstance(n, int) and isinstance(pattern, int) and pattern > 0 else []
    if any(t not in LAYER_TYPES_FROM_HF for t in given):
        cfg.refuse(f"layer_types other than sliding_attention / full_attention ({sorted(set(given))}) "
                   "are not supported")
        return None, None
    types = [LAYER_TYPES_FROM_HF[t] for t in given]
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        cfg.refuse(f"sliding_window must be a positive integer or null, got {window!r}")
        return None, None
    if "sliding" not in types or window is None:
        return None, None
    return (None if "full" not in types else types), window


def gemma_config(cfg: HFConfig, cap: int | None, *, architecture: str, rope: dict[str, Any],
                 qk_norm: bool, pattern: int, rope_local_theta: float | None = None) -> ModelConfig:
    """The ModelConfig of a Gemma 2 or Gemma 3 text config.json (their rotary parameters read
    by each: Gemma 3 has one per layer type; `pattern`: every pattern-th layer is full where
    config.json lists no layer_types)."""
    if cfg.get("use_bidirectional_attention", False):
        cfg.refuse("use_bidirectional_attention=true is not supported (a decoder attends causally)")
    if rope["rotary_pct"] != 1.0:
        cfg.refuse(f"partial_rotary_factor {rope['rotary_pct']} is not supported by {cfg.title}")
        rope["rotary_pct"] = 1.0
    cfg.data = {**cfg.data, "hidden_act": cfg.get("hidden_activation", cfg.get("hidden_act", "gelu_pytorch_tanh"))}
    d_model, n_heads = cfg.need("hidden_size"), cfg.need("num_attention_heads")
    n_kv = cfg.get("num_key_value_heads", n_heads)
    head_dim = cfg.get("head_dim", 256)
    scalar = cfg.get("query_pre_attn_scalar", 256)
    if not isinstance(scalar, (int, float)) or isinstance(scalar, bool) or not scalar > 0:
        cfg.refuse(f"query_pre_attn_scalar must be a positive number, got {scalar!r}")
        scalar = head_dim
    layer_types, window = layer_types_from_hf(cfg, cfg.data.get("sliding_window", 4096), pattern)
    if rope_local_theta is not None:
        if layer_types is None and window is not None:  # every layer sliding: theirs is the only base
            rope = {**rope, "rope_theta": rope_local_theta, "rope_scaling": None}
            rope_local_theta = None
        elif layer_types is None or (rope_local_theta == rope["rope_theta"] and rope["rope_scaling"] is None):
            rope_local_theta = None  # no sliding layer, or they rotate as the full ones: one base
    softcaps = {}
    for ours, theirs in (("attn_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping")):
        softcaps[ours] = float(cfg.data[theirs]) if cfg.data.get(theirs) is not None else None
    return cfg.build(
        vocab_size=cfg.need("vocab_size"),
        context_length=context_length(cfg, cap, 8192),
        d_model=d_model,
        n_layers=cfg.need("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=None if n_kv == n_heads else n_kv,
        head_dim=None if head_dim * n_heads == d_model else head_dim,
        d_ff=cfg.need("intermediate_size"),
        dropout=0.0,
        positional="rotary",
        norm="pre",
        norm_type="rmsnorm",
        activation=activation_from_hf(cfg, "gelu_pytorch_tanh"),
        ffn="gated",
        bias=False,
        qkv_bias=cfg.flag("attention_bias", False) or None,
        attn_out_bias=cfg.flag("attention_bias", False) or None,
        tie_embeddings=cfg.flag("tie_word_embeddings", True),
        scale_embeddings=True,
        layer_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        sliding_window=window,
        layer_types=layer_types,
        qk_norm=qk_norm,
        attn_scale=None if scalar == head_dim else float(scalar) ** -0.5,
        post_norms=True,
        rope_local_theta=rope_local_theta,
        architecture=architecture,
        **softcaps,
        **rope,
    )


def gemma_hf(config: ModelConfig, hf_class: str, model_type: str) -> dict[str, Any]:
    """The config.json keys Gemma 2 and Gemma 3 share."""
    scale = config.scores_scale
    scalar = scale ** -2
    if abs(scalar - round(scalar)) < 1e-6:  # an integer as Gemma's are: 256, 144 ...
        scalar = round(scalar)
    types = config.layer_types or ["sliding" if config.sliding_window is not None else "full"] * config.n_layers
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
        "hidden_activation": ACTIVATIONS_TO_HF[config.activation],
        "max_position_embeddings": config.context_length,
        "rms_norm_eps": config.layer_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.bias_of("qkv"),
        "attention_dropout": 0.0,
        "query_pre_attn_scalar": scalar,
        "sliding_window": config.sliding_window,
        "layer_types": [LAYER_TYPES_TO_HF[t] for t in types],
        "attn_logit_softcapping": config.attn_softcap,
        "final_logit_softcapping": config.final_softcap,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def gemma_reasons(config: ModelConfig, title: str, *, qk_norm: bool, has: tuple[str, ...]) -> list[str]:
    """Why a config is not a Gemma-shaped decoder."""
    reasons = common_export_reasons(config, title, qk_norm=qk_norm, has=("scale_embeddings", *has))
    if config.norm_type != "rmsnorm":
        reasons.append(f"{title} uses RMSNorm (norm_type='rmsnorm')")
    if config.ffn != "gated":
        reasons.append(f"{title}'s MLP is gated (ffn='gated')")
    if config.parallel_residual:
        reasons.append(f"{title} adds attention and MLP in turn (parallel_residual=False)")
    if not config.post_norms:
        reasons.append(f"{title} normalises each sub-layer's output too (post_norms=True)")
    if not config.scale_embeddings:
        reasons.append(f"{title} scales its embeddings by sqrt(d_model) (scale_embeddings=True)")
    if config.rotary_pct != 1.0:
        reasons.append(f"{title} rotates whole heads (rotary_pct=1.0)")
    if config.bias_of("qkv") != config.bias_of("attn_out") or config.bias_of("ffn"):
        reasons.append(f"{title}'s attention_bias covers q, k, v and o alike and its MLP has none")
    return reasons


def gemma_tensors(config: ModelConfig) -> list[Rule]:
    H, K, D, F = config.n_heads, config.kv_heads, config.d_head, config.d_ff
    rules = [same("tok_emb.weight", "model.embed_tokens.weight"), gemma_norm("ln_f.weight", "model.norm.weight")]
    if not config.tie_embeddings:
        rules.append(same("lm_head.weight", "lm_head.weight"))
    for i in range(config.n_layers):
        ours, layer = f"blocks.{i}.", f"model.layers.{i}."
        attn = layer + "self_attn."
        for k in ["weight"] + (["bias"] if config.bias_of("qkv") else []):
            rules += [fused(ours + f"attn.qkv.{k}", [attn + f"{p}_proj.{k}" for p in "qkv"], [H * D, K * D, K * D]),
                      same(ours + f"attn.proj.{k}", attn + f"o_proj.{k}")]
        if config.qk_norm:
            rules += [gemma_norm(ours + f"attn.{n}.weight", attn + f"{n}.weight") for n in ("q_norm", "k_norm")]
        rules += [fused(ours + "ffn.fc.weight", [layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"], [F, F]),
                  same(ours + "ffn.proj.weight", layer + "mlp.down_proj.weight")]
        rules += [gemma_norm(ours + f"{n}.weight", layer + f"{t}.weight") for n, t in (
            ("ln1", "input_layernorm"), ("ln1_post", "post_attention_layernorm"),
            ("ln2", "pre_feedforward_layernorm"), ("ln2_post", "post_feedforward_layernorm"))]
    return rules


# --- Gemma 2 itself ----------------------------------------------------------------------------

def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    cfg = HFConfig(data, path, "Gemma 2")
    return gemma_config(cfg, cap, architecture="Gemma2ForCausalLM", rope=rope_from_hf(cfg), qk_norm=False, pattern=2)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {**gemma_hf(config, "Gemma2ForCausalLM", "gemma2"), **rope_to_hf(config)}


def export_reasons(config: ModelConfig) -> list[str]:
    return gemma_reasons(config, "Gemma 2", qk_norm=False,
                         has=("attn_scale", "attn_softcap", "final_softcap", "layer_types", "post_norms"))


ARCHITECTURE = Architecture(
    name="gemma2", title="Gemma 2", hf_class="Gemma2ForCausalLM", model_type="gemma2",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=gemma_tensors, ignored=(".rotary_emb.inv_freq",),
)

"""Gemma 3 text (Gemma3ForCausalLM, config model_type gemma3_text): a Gemma 2
(model/interop/architectures/gemma2.py, the same names and parts) with an RMSNorm per head on
queries and keys (q_norm, k_norm: Gemma's (1 + w), stored as 1 + w), five sliding-window layers
to one full one (layer_types), and a rotary base per layer type: the sliding layers'
(rope_parameters.sliding_attention, formerly rope_local_base_freq; config.rope_local_theta,
unscaled) and the full layers' (rope_parameters.full_attention, with its linear scaling where
given). No soft-caps unless config.json sets them.

The multimodal Gemma3ForConditionalGeneration (vision tower, model_type gemma3) is not this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlens.model.config import ModelConfig
from attnlens.model.interop.architectures.base import Architecture, HFConfig, rope_from_hf, rope_to_hf
from attnlens.model.interop.architectures.gemma2 import gemma_config, gemma_hf, gemma_reasons, gemma_tensors


def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    cfg = HFConfig(data, path, "Gemma 3")
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        full, sliding = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:  # the older layout: rope_theta, rope_scaling (the full layers'), rope_local_base_freq
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1_000_000.0)}
        sliding = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    if not isinstance(full, dict) or not isinstance(sliding, dict):
        cfg.refuse("rope_parameters must hold objects")
        full, sliding = {}, {}
    if sliding.get("rope_type", sliding.get("type", "default")) != "default":
        cfg.refuse(f"a scaled rotary base on the sliding layers (rope_type {sliding.get('rope_type')!r}) is not supported")
    local = sliding.get("rope_theta", 10_000.0)
    if not isinstance(local, (int, float)) or isinstance(local, bool):
        cfg.refuse(f"the sliding layers' rope_theta must be a number, got {local!r}")
        local = 10_000.0
    # the full layers' parameters read as a single-base config.json's (refusing unknown scalings by name)
    full_cfg = HFConfig({"rope_parameters": {"rope_theta": 1_000_000.0, **full},
                         "max_position_embeddings": cfg.get("max_position_embeddings")}, path, "Gemma 3")
    rope = rope_from_hf(full_cfg)
    cfg.reasons += full_cfg.reasons
    return gemma_config(cfg, cap, architecture="Gemma3ForCausalLM", rope=rope, qk_norm=True,
                        pattern=cfg.get("sliding_window_pattern", 6), rope_local_theta=float(local))


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    full = rope_to_hf(config)
    local = config.rope_local_theta if config.rope_local_theta is not None else config.rope_theta
    return {**gemma_hf(config, "Gemma3ForCausalLM", "gemma3_text"), "rope_parameters": {
        "full_attention": {"rope_type": "default", **full.get("rope_scaling", {}), "rope_theta": full["rope_theta"]},
        "sliding_attention": {"rope_type": "default", "rope_theta": local}}}


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = gemma_reasons(config, "Gemma 3", qk_norm=True, has=(
        "attn_scale", "attn_softcap", "final_softcap", "layer_types", "post_norms", "rope_local_theta"))
    if config.rope_scaling is not None and config.rope_scaling.get("rope_type") != "linear":
        reasons.append("Gemma 3 scales its full layers' rotary positions linearly or not at all")
    return reasons


ARCHITECTURE = Architecture(
    name="gemma3", title="Gemma 3", hf_class="Gemma3ForCausalLM", model_type="gemma3_text",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=gemma_tensors, ignored=(".rotary_emb.inv_freq",),
)

"""Mixtral (MixtralForCausalLM: Mixtral 8x7B, 8x22B): a Mistral (model/interop/architectures/
mistral.py: the same attention, norms and names) whose MLP is a sparse mixture of experts
(config.n_experts = num_local_experts, experts_per_token = num_experts_per_tok): a router
(block_sparse_moe.gate) scores the experts per token, the top k are kept and weighed by their
probabilities renormalised over the k, each expert a SwiGLU (w1 gate, w3 up, w2 down). The
choices are hook points (blocks.i.ffn.hook_router, hook_experts). Names (ours <- Mixtral's,
beside Llama's attention and norms)::

    blocks.i.ffn.router           <- model.layers.i.block_sparse_moe.gate
    blocks.i.ffn.experts.e.fc     <- model.layers.i.block_sparse_moe.experts.e.{w1,w3}  (rows fused)
    blocks.i.ffn.experts.e.proj   <- model.layers.i.block_sparse_moe.experts.e.w2

The per-expert layout is the one Mixtral's checkpoints (and transformers' save_pretrained) use.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from attnlens.model.config import ModelConfig
from attnlens.model.interop.architectures.base import Architecture, HFConfig, Rule, fused, same
from attnlens.model.interop.architectures.llama import (
    llama_tensors,
    rotary_decoder_config,
    rotary_decoder_hf,
    rotary_decoder_reasons,
)


def config_from_hf(data: dict[str, Any], path: Path, cap: int | None = None) -> ModelConfig:
    cfg = HFConfig(data, path, "Mixtral")
    window = cfg.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        cfg.refuse(f"sliding_window must be a positive integer or null, got {window!r}")
        window = None
    experts, k = cfg.get("num_local_experts", 8), cfg.get("num_experts_per_tok", 2)
    llama = rotary_decoder_config(cfg, cap, architecture="MixtralForCausalLM", qkv_bias=False, attn_out_bias=False,
                                  ffn_bias=False, sliding_window=window)
    try:
        return replace(llama, n_experts=experts, experts_per_token=k)
    except ValueError as e:  # ConfigError
        cfg.refuse(str(e))
        cfg.check()
        raise


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    return {**rotary_decoder_hf(config, "MixtralForCausalLM", "mixtral"), "sliding_window": config.sliding_window,
            "num_local_experts": config.n_experts, "num_experts_per_tok": config.experts_per_token,
            "router_jitter_noise": 0.0, "output_router_logits": False}


def export_reasons(config: ModelConfig) -> list[str]:
    reasons = rotary_decoder_reasons(config, "Mixtral", has=("n_experts",))
    if not config.n_experts:
        reasons.append("Mixtral's MLP is a mixture of experts (n_experts > 0)")
    if config.bias_of("qkv") or config.bias_of("attn_out") or config.bias_of("ffn"):
        reasons.append("Mixtral has no biases (qkv_bias, attn_out_bias, ffn_bias all False)")
    return reasons


def tensors(config: ModelConfig) -> list[Rule]:
    F = config.d_ff
    rules = [r for r in llama_tensors(replace(config, n_experts=0)) if ".ffn." not in r.ours]
    for i in range(config.n_layers):
        ours, moe = f"blocks.{i}.ffn.", f"model.layers.{i}.block_sparse_moe."
        rules.append(same(ours + "router.weight", moe + "gate.weight"))
        for e in range(config.n_experts):
            rules += [fused(ours + f"experts.{e}.fc.weight", [moe + f"experts.{e}.w1.weight", moe + f"experts.{e}.w3.weight"],
                            [F, F]),
                      same(ours + f"experts.{e}.proj.weight", moe + f"experts.{e}.w2.weight")]
    return rules


ARCHITECTURE = Architecture(
    name="mixtral", title="Mixtral", hf_class="MixtralForCausalLM", model_type="mixtral",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, export_reasons=export_reasons,
    tensors=tensors, ignored=(".rotary_emb.inv_freq",),
)

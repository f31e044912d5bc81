"""`attnlens info`: a human-readable summary of a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attnlens.model.checkpoint import load_checkpoint
from attnlens.model.config import ModelConfig


def summary(ckpt_dir: str | Path) -> dict:
    ckpt = load_checkpoint(ckpt_dir)
    cfg = ckpt.config
    info: dict[str, Any] = {
        "path": str(Path(ckpt_dir)),
        "config": cfg.to_dict(),
        "parameters": ckpt.model.num_parameters(),
        "parameters_without_embeddings": ckpt.model.num_parameters(exclude_embeddings=True),
        "tokenizer_vocab_size": ckpt.tokenizer.vocab_size,
    }
    if ckpt.report:
        keys = ("steps", "tokens_seen", "wall_time_s", "hardware", "final_train_loss",
                "final_val_loss", "val_bits_per_byte")
        info["report"] = {k: ckpt.report[k] for k in keys if ckpt.report.get(k) is not None}
        r = ckpt.report
        if "held_out_mlm" in r:
            info["report"]["held_out_mlm_accuracy"] = round(r["held_out_mlm"]["mlm_accuracy"], 4)
        for name in ("held_out_genre", "bow_baseline", "majority_baseline"):
            if isinstance(r.get(name), dict) and "accuracy" in r[name]:
                info["report"][f"{name}_balanced_accuracy"] = round(r[name]["balanced_accuracy"], 4)
    return info


def kv_heads(cfg: dict) -> str:
    """" (2 key/value)" for grouped- or multi-query attention, else nothing."""
    n = cfg.get("n_kv_heads")
    return f" ({n} key/value)" if n is not None and n != cfg["n_heads"] else ""


def positions(cfg: dict) -> str:
    if cfg["positional"] != "rotary":
        return f"{cfg['positional']} positions"
    pct = cfg.get("rotary_pct", 1.0)
    scaling = cfg.get("rope_scaling")
    return (f"rotary positions ({'' if pct == 1.0 else f'{pct:g} of each head, '}theta {cfg.get('rope_theta', 1e4):g}"
            + (f", {scaling.get('rope_type', scaling.get('type'))} scaling" if scaling else "") + ")")


KV_BUDGET_DEFAULT = 1 << 30  # app/server/settings.py's KV_CACHE_BYTES default


def kv_cache_line(cfg: dict) -> str:
    """What the KV cache takes a token (float32, keys and values of every layer; the translator's
    decoder holds its cross-attention keys and values as much again), and how many tokens in
    flight the server's default budget holds."""
    kv = cfg.get("n_kv_heads") or cfg["n_heads"]
    d_head = cfg.get("head_dim") or cfg["d_model"] // cfg["n_heads"]
    per_token = 2 * cfg["n_layers"] * kv * d_head * 4 * (2 if cfg.get("family") == "encoder-decoder" else 1)
    return (f"KV cache     {per_token / 1024:,.1f} KB a token in float32; the server's budget "
            f"(ATTNLENS_KV_CACHE_BYTES, default {KV_BUDGET_DEFAULT / 2**30:.0f} GiB) holds "
            f"{KV_BUDGET_DEFAULT // per_token:,} tokens in flight, a full context is "
            f"{per_token * cfg['context_length'] / 2**20:,.0f} MB")


def describe(ckpt_dir: str | Path) -> str:
    info = summary(ckpt_dir)
    cfg = info["config"]
    lines = [
        f"checkpoint   {info['path']}",
        f"family       {cfg.get('family', 'decoder')}"
        + (f", labels {', '.join(cfg['labels'])} ({cfg['pooling']} pooling)" if cfg.get("labels") else ""),
        f"parameters   {info['parameters']:,} ({info['parameters_without_embeddings']:,} without embeddings)",
        f"layers       {cfg['n_layers']} x {cfg['n_heads']} heads{kv_heads(cfg)}, d_model {cfg['d_model']}, "
        f"d_ff {cfg['d_ff']}",
        f"context      {cfg['context_length']} tokens, vocab {cfg['vocab_size']} "
        f"(tokenizer {info['tokenizer_vocab_size']})",
        f"variant      {positions(cfg)}, {cfg['norm']}-{'RMSNorm' if cfg.get('norm_type') == 'rmsnorm' else 'LN'}, "
        f"{'gated ' if cfg.get('ffn') == 'gated' else ''}{cfg['activation']}, "
        f"bias={cfg['bias']}, tied={cfg['tie_embeddings']}, scaled emb={cfg['scale_embeddings']}"
        + (", parallel residual" if cfg.get("parallel_residual") else "")
        + (f", sliding window {cfg['sliding_window']}" if cfg.get("sliding_window") else "")
        + (", q/k norm" if cfg.get("qk_norm") else ""),
    ]
    special = ModelConfig.from_dict(cfg).special_parts() if cfg.get("family", "decoder") == "decoder" else {}
    if special:  # Gemma's, Mixtral's, ...: as the export refusals name them
        lines.append("also         " + "; ".join(special.values()))
    if cfg.get("architecture"):
        lines.insert(2, f"imported     from a transformers {cfg['architecture']}")
    if cfg.get("family", "decoder") != "encoder":
        lines.append(kv_cache_line(cfg))
    rep = info.get("report")
    if rep:
        lines.append("training     " + ", ".join(f"{k}={v}" for k, v in rep.items()))
    else:
        lines.append("training     (no train_report.json)")
    return "\n".join(lines)

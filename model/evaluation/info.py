"""`attnlens info`: a human-readable summary of a checkpoint."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint import load_checkpoint


def summary(ckpt_dir: str | Path) -> dict:
    ckpt = load_checkpoint(ckpt_dir)
    cfg = ckpt.config
    info = {
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


def describe(ckpt_dir: str | Path) -> str:
    info = summary(ckpt_dir)
    cfg = info["config"]
    lines = [
        f"checkpoint   {info['path']}",
        f"family       {cfg.get('family', 'decoder')}"
        + (f", labels {', '.join(cfg['labels'])} ({cfg['pooling']} pooling)" if cfg.get("labels") else ""),
        f"parameters   {info['parameters']:,} ({info['parameters_without_embeddings']:,} without embeddings)",
        f"layers       {cfg['n_layers']} x {cfg['n_heads']} heads, d_model {cfg['d_model']}, d_ff {cfg['d_ff']}",
        f"context      {cfg['context_length']} tokens, vocab {cfg['vocab_size']} "
        f"(tokenizer {info['tokenizer_vocab_size']})",
        f"variant      {cfg['positional']} positions, {cfg['norm']}-LN, {cfg['activation']}, "
        f"bias={cfg['bias']}, tied={cfg['tie_embeddings']}, scaled emb={cfg['scale_embeddings']}",
    ]
    rep = info.get("report")
    if rep:
        lines.append("training     " + ", ".join(f"{k}={v}" for k, v in rep.items()))
    else:
        lines.append("training     (no train_report.json)")
    return "\n".join(lines)

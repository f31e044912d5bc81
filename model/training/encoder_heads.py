"""Heads trained here for a pretrained encoder that itself stays as it was (all-MiniLM-L6-v2).

A sentence-transformers model ships without a masked-LM head and knows nothing of the
Folio's genres. Two heads are trained on it, from the corpus the project ships, and stored in
`<out>/heads.safetensors` (tensors by our names) with `<out>/heads.json` (the config fields
they set): model/interop/packaged.py puts them on the converted model at its next start.

    genre   the classification head with its own copies of the top `--layers` blocks, fine-
            tuned on the training works' passages (model/evaluation/evaluate_encoder.py's split); the
            blocks below stay frozen, so their states are computed once and cached. Every
            other answer of the model (embeddings, attention, fill-mask) keeps the pretrained
            blocks.
    mlm     BERT's masked-LM head (dense, activation, LayerNorm, the decoder tied to the token
            embedding, a bias) on the frozen encoder: its states at masked positions of the
            training works are computed once, then the head alone is trained on them.

Each writes `<task>_report.json` (the held-out figures beside their baselines, measured in the
same run, and the command that made it), `<task>_metrics.jsonl` and `<task>_loss.png`.

    python -m attnlens.model.training.encoder_heads genre --out checkpoints/packaged/all-minilm-l6-v2
    python -m attnlens.model.training.encoder_heads mlm --out checkpoints/packaged/all-minilm-l6-v2
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlens.model.checkpoint import Checkpoint, load_checkpoint, readable_by_all
from attnlens.model.config import ModelConfig
from attnlens.model.data.genres import GENRES
from attnlens.model.data.mlm import IGNORE, mask_tokens
from attnlens.model.data.passages import fixed_passages, frame, load_works, tokenize_works
from attnlens.model.evaluation.evaluate_encoder import (
    FILL_MASK_GOAL,
    bow_baseline,
    build_split,
    fill_mask_report,
    genre_metrics,
    majority_baseline,
    mlm_metrics,
)
from attnlens.model.families.encoder import Encoder

HEADS_FILE, HEADS_CONFIG = "heads.safetensors", "heads.json"
SAVE_DTYPE = torch.float16  # the shipped heads' precision; every figure is measured after rounding to it


def _bar(total: int, desc: str, unit: str = "step"):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)


@torch.inference_mode()
def states_after(model: Encoder, rows: torch.Tensor, n_blocks: int, *, batch: int = 64, desc: str = "") -> torch.Tensor:
    """(N, T) framed rows -> (N, T, C): the state after the first `n_blocks` blocks (no padding)."""
    model.eval()
    out = torch.empty(rows.shape[0], rows.shape[1], model.config.d_model)
    with _bar(len(rows), desc, "row") as bar:
        for i in range(0, len(rows), batch):
            x = model.embed(rows[i : i + batch], norm=model.emb_norm)
            out[i : i + batch] = model.run_blocks(x, model.blocks[:n_blocks], None)[0]
            bar.update(len(rows[i : i + batch]))
    return out


def cosine_schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def round_to(module: torch.nn.Module, dtype: torch.dtype) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(dtype).to(p.dtype))


class Log:
    """metrics.jsonl lines and the loss plot of one head's training."""

    def __init__(self, out: Path, task: str):
        self.path, self.png, self.task = out / f"{task}_metrics.jsonl", out / f"{task}_loss.png", task
        self.path.write_text("", encoding="utf-8")
        self.records: list[dict] = []

    def write(self, **record) -> None:
        self.records.append(record)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def plot(self) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        steps = [(r["step"], r["loss"]) for r in self.records if "loss" in r]
        evals = [(r["step"], r[k]) for r in self.records for k in r if k.startswith("held_out")]
        fig, ax = plt.subplots(figsize=(7, 4))
        if steps:
            ax.plot(*zip(*steps), label="training loss (mean of the last steps)")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats)")
        if evals:
            ax2 = ax.twinx()
            ax2.plot(*zip(*evals), "o-", color="tab:red", label="held-out figure (not used to choose)")
            ax2.set_ylabel(next(k for r in self.records for k in r if k.startswith("held_out")))
            ax2.legend(loc="center right")
        if steps:
            ax.legend(loc="upper right")
        ax.set_title(f"{self.task} head")
        fig.tight_layout()
        fig.savefig(self.png, dpi=100)
        plt.close(fig)


def save_heads(out: Path, model: Encoder, prefixes: tuple[str, ...], config_fields: dict) -> None:
    """Add the tensors under `prefixes` to heads.safetensors and the fields to heads.json (what
    the other head put there stays)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / HEADS_FILE)) if (out / HEADS_FILE).is_file() else {}
    tensors = {k: v for k, v in tensors.items() if not k.startswith(prefixes)}
    tensors.update({k: v.detach().to(SAVE_DTYPE).contiguous() for k, v in model.state_dict().items()
                    if k.startswith(prefixes)})
    save_file(tensors, str(out / HEADS_FILE), metadata={"format": "pt", "producer": "attnlens"})
    readable_by_all(out / HEADS_FILE)
    fields = json.loads((out / HEADS_CONFIG).read_text(encoding="utf-8")) if (out / HEADS_CONFIG).is_file() else {}
    (out / HEADS_CONFIG).write_text(json.dumps({**fields, **config_fields}, indent=2, sort_keys=True) + "\n",
                                    encoding="utf-8")


def base_checkpoint(path: str | None) -> Checkpoint:
    """The encoder to train on: `path`, else the packaged all-MiniLM-L6-v2 as it converts, without
    heads shipped here."""
    if path:
        return load_checkpoint(path)
    import tempfile

    from attnlens.model.interop.packaged import MINILM, convert_file, install_hint, locate

    found = locate(MINILM)
    if found is None:
        raise SystemExit(f"{MINILM.distribution} is not installed: {install_hint(MINILM)}")
    tmp = Path(tempfile.mkdtemp(prefix="attnlens-minilm-"))
    convert_file(found[0], tmp)
    return load_checkpoint(tmp)


# --- genre -----------------------------------------------------------------------------
def genre_model(base: Encoder, layers: int) -> Encoder:
    """The base encoder with a genre head whose top `layers` blocks start as the base's own."""
    config = ModelConfig.from_dict({**base.config.to_dict(), "labels": list(GENRES), "classifier_layers": layers})
    model = Encoder(config)
    missing = model.load_state_dict(base.state_dict(), strict=False).missing_keys
    assert all(k.startswith(("pooler.", "classifier.", "classifier_blocks.")) for k in missing), missing
    n = config.n_layers
    for i, block in enumerate(model.classifier_blocks):
        block.load_state_dict(base.blocks[n - layers + i].state_dict())
    return model


def train_genre(args, ckpt: Checkpoint, out: Path, log: Log) -> dict:
    torch.manual_seed(args.seed)
    model = genre_model(ckpt.model, args.layers)
    tok, n, k = ckpt.tokenizer, model.config.n_layers, args.layers
    split = build_split(args.data_dir, tok, args.context_length)
    split.train_rows, split.train_labels = split.train_rows[:: args.every], split.train_labels[:: args.every]
    labels = torch.tensor([GENRES.index(g) for g in split.train_labels])
    cached = states_after(model, split.train_rows, n - k, desc="frozen blocks (training passages)")
    head = [*model.classifier_blocks.parameters()]
    top = [*model.pooler.parameters(), *model.classifier.parameters()]
    opt = torch.optim.AdamW([{"params": head, "lr": args.lr}, {"params": top, "lr": args.head_lr}],
                            weight_decay=0.01)
    base_lrs = [g["lr"] for g in opt.param_groups]
    steps_per_epoch = math.ceil(len(cached) / args.batch_size)
    total = steps_per_epoch * args.epochs
    g = torch.Generator().manual_seed(args.seed)
    step, recent = 0, []
    with _bar(total, "genre head") as bar:
        for epoch in range(args.epochs):
            model.train()
            for idx in torch.randperm(len(cached), generator=g).split(args.batch_size):
                for group, lr in zip(opt.param_groups, base_lrs):
                    group["lr"] = lr * cosine_schedule(step, total, max(1, total // 20))
                x, _ = model.run_blocks(cached[idx], model.classifier_blocks, None)
                loss = F.cross_entropy(model.classify_logits(model.ln_f(x)), labels[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head + top, 1.0)
                opt.step()
                recent.append(loss.item())
                step += 1
                bar.update(1)
                if step % 25 == 0 or step == total:
                    log.write(step=step, epoch=epoch, loss=sum(recent) / len(recent), lr=opt.param_groups[0]["lr"])
                    recent = []
            if epoch == args.epochs - 1:
                round_to(model, SAVE_DTYPE)
            figures = genre_metrics(model, split)  # the whole model's forward, as /classify runs it
            log.write(step=step, epoch=epoch, held_out_balanced_accuracy=figures["balanced_accuracy"])
            print(f"epoch {epoch}: held-out balanced accuracy {figures['balanced_accuracy']:.4f}", file=sys.stderr)
    save_heads(out, model, ("pooler.", "classifier.", "classifier_blocks."),
               {"labels": list(GENRES), "classifier_layers": k})
    return {
        "held_out_genre": figures,
        "held_out_passages_per_genre": {g: split.val_labels.count(g) for g in GENRES},
        "bow_baseline": bow_baseline(split),
        "majority_baseline": majority_baseline(split),
        "training_passages": len(cached),
        "steps": step,
        "method": (f"the top {k} of {n} blocks copied and fine-tuned with a new pooler and classifier "
                   f"(AdamW, lr {args.lr} for the blocks, {args.head_lr} for the head, cosine, "
                   f"batch {args.batch_size}, {args.epochs} epochs over the training works' "
                   f"{args.context_length - 2}-token passages); blocks 0..{n - k - 1} frozen. The figures "
                   "are the last epoch's, chosen by nothing; every epoch's held-out figure is in "
                   "genre_metrics.jsonl for the curve"),
    }


# --- masked LM ---------------------------------------------------------------------------
def train_mlm(args, ckpt: Checkpoint, out: Path, log: Log) -> dict:
    torch.manual_seed(args.seed)
    model, tok = ckpt.model, ckpt.tokenizer
    model.config.mlm_head = True
    works = load_works(args.data_dir)
    train = tokenize_works(tok, [w for w in works if w.split == "train"])
    rows = frame(fixed_passages(train, args.context_length - 2)[0], tok)[:: args.every]
    g = torch.Generator().manual_seed(args.seed)
    inputs, targets = mask_tokens(rows, mask_id=tok.mask_id, special_ids=tok.special_ids, vocab_size=tok.vocab_size,
                                  generator=g, mask_prob=0.15)
    picked = targets != IGNORE
    states = states_after(model, inputs, model.config.n_layers, desc="frozen encoder (masked passages)")
    with torch.no_grad():
        states, answers = model.ln_f(states[picked]), targets[picked]  # (P, C), (P,): the head's input
    for p in model.parameters():
        p.requires_grad_(False)
    head = [model.mlm_dense.weight, model.mlm_dense.bias, model.mlm_norm.weight, model.mlm_norm.bias, model.mlm_bias]
    for p in head:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(head, lr=args.head_lr, weight_decay=0.01)
    total = math.ceil(len(states) / args.batch_size) * args.epochs
    step, recent = 0, []
    with _bar(total, "masked-LM head") as bar:
        for epoch in range(args.epochs):
            model.train()
            for idx in torch.randperm(len(states), generator=g).split(args.batch_size):
                for group in opt.param_groups:
                    group["lr"] = args.head_lr * cosine_schedule(step, total, max(1, total // 20))
                loss = F.cross_entropy(model.mlm_logits(states[idx]), answers[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                recent.append(loss.item())
                step += 1
                bar.update(1)
                if step % 25 == 0 or step == total:
                    log.write(step=step, epoch=epoch, loss=sum(recent) / len(recent))
                    recent = []
    round_to(model, SAVE_DTYPE)
    save_heads(out, model, ("mlm_dense.", "mlm_norm.", "mlm_bias"), {"mlm_head": True})
    report = mlm_figures(args, model, tok)
    log.write(step=step, held_out_fill_mask_top1=report["fill_mask_common_words"]["top1"])
    report.update(masked_positions=len(states), training_passages=len(rows), steps=step, method=(
        f"BERT's head (dense, GELU, LayerNorm, the token embedding as decoder, a bias) trained on the frozen "
        f"encoder's states at {len(states):,} masked positions (15%, 80/10/10) of the training works' passages; "
        f"AdamW lr {args.head_lr}, cosine, {args.batch_size} positions a step, {args.epochs} epochs"))
    return report


def mlm_figures(args, model: Encoder, tok) -> dict:
    """The masked-LM head's held-out figures, with the encoder `--compare` names beside it."""
    split = build_split(args.data_dir, tok, args.context_length)
    fill = fill_mask_report(model, tok, args.data_dir)
    report = {"fill_mask_common_words": fill, "held_out_mlm": mlm_metrics(model, split.val_rows, tok),
              "goal": {"fill_mask_top1_at_least": FILL_MASK_GOAL, "reached": fill["top1"] >= FILL_MASK_GOAL,
                       "note": "under the goal the page marks the head as weak (GET /models head_figures)"}}
    if args.compare:
        other = load_checkpoint(args.compare)
        report["compared_with"] = {"model": args.compare, "fill_mask_common_words":
                                   fill_mask_report(other.model, other.tokenizer, args.data_dir, with_baseline=False)}
    return report


def genre_figures(args, model: Encoder, tok) -> dict:
    split = build_split(args.data_dir, tok, args.context_length)
    return {"held_out_genre": genre_metrics(model, split), "bow_baseline": bow_baseline(split),
            "majority_baseline": majority_baseline(split)}


def evaluate_only(args, ckpt: Checkpoint, out: Path, command: str) -> dict:
    """The figures of heads already in `out`, measured again (after a change to the evaluation),
    into the task's report; what the training recorded stays."""
    import tempfile

    from attnlens.model.checkpoint import save_checkpoint
    from attnlens.model.interop.packaged import put_heads

    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, ckpt.model, ckpt.tokenizer)
        put_heads(Path(tmp), out)
        model = load_checkpoint(tmp).model
    figures = (genre_figures if args.task == "genre" else mlm_figures)(args, model, ckpt.tokenizer)
    path = out / f"{args.task}_report.json"
    report = {**json.loads(path.read_text(encoding="utf-8")), **figures, "evaluated_by": command}
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", choices=("genre", "mlm"))
    p.add_argument("--out", required=True, help="the heads folder (checkpoints/packaged/<name>)")
    p.add_argument("--model", default=None, help="the encoder checkpoint (default: the packaged all-MiniLM-L6-v2)")
    p.add_argument("--data-dir", default="data/shakespeare")
    p.add_argument("--context-length", type=int, default=128, help="passages of this many tokens with [CLS] [SEP]")
    p.add_argument("--layers", type=int, default=2, help="genre: the top blocks the head gets its own copies of")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="genre: passages a step; mlm: masked positions a step")
    p.add_argument("--lr", type=float, default=5e-5, help="genre: the copied blocks' learning rate")
    p.add_argument("--head-lr", type=float, default=1e-3)
    p.add_argument("--compare", default="checkpoints/encoder", help="mlm: an encoder measured beside it ('' for none)")
    p.add_argument("--every", type=int, default=1, help="train on every N-th training passage (a quick trial)")
    p.add_argument("--evaluate-only", action="store_true", help="measure the heads already in --out again")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = base_checkpoint(args.model)
    command = "python -m attnlens.model.training.encoder_heads " + shlex.join(argv or sys.argv[1:])
    if args.evaluate_only:
        report = evaluate_only(args, ckpt, out, command)
        print(json.dumps({k: v for k, v in report.items() if k != "method"}, indent=2)[:3000])
        return
    started = time.time()
    log = Log(out, args.task)
    report = (train_genre if args.task == "genre" else train_mlm)(args, ckpt, out, log)
    log.plot()
    report.update(command=command, wall_time_s=round(time.time() - started, 1), threads=torch.get_num_threads(),
                  torch=torch.__version__, seed=args.seed)
    (out / f"{args.task}_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in report.items() if k != "method"}, indent=2)[:3000])


if __name__ == "__main__":
    main()

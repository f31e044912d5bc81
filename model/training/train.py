"""`attnlens train`: train a Transformer on the prepared corpus.

AdamW (weight decay on matrices only), linear warm-up then cosine decay, gradient
clipping, bf16 autocast and TF32 on CUDA, optional torch.compile, DDP under torchrun.
Every batch is drawn from a generator seeded by (seed, step, rank), so a resumed run
sees exactly the batches an uninterrupted run would have seen.

Output directory:
    config.json, model.safetensors, tokenizer.json, train_report.json   (a checkpoint)
    optimizer.safetensors, train_state.json                             (for --resume)
    metrics.jsonl, loss.png
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import signal
import time
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from attnlens.model.checkpoint import load_weights, save_checkpoint
from attnlens.model.config import ModelConfig
from attnlens.model.data.names import tokenizer_texts
from attnlens.model.data.shakespeare import load_split
from attnlens.model.data.translation_pairs import train_translation_tokenizer
from attnlens.model.decoding import SamplingParams, generate_tokens
from attnlens.model.families import build_model, family_named
from attnlens.model.tokenizer import Tokenizer
from attnlens.model.training.curriculum import batch_with_repeats

LN2 = math.log(2.0)
SAMPLE_PROMPTS = ["ROMEO.\n", "To be, or not to be", "KING.\nMy lords,", "O, ", "First Citizen.\n"]


@dataclass
class TrainSettings:
    data_dir: str = "data/shakespeare"
    tokenizer: str | None = None  # path to a tokenizer.json; None = train BPE on the train split
    vocab_size: int = 4096  # for a tokenizer trained here
    # a tokenizer trained here also reads the character names' words this many times over
    # (model/data/names.py), so that they stay whole; the model never trains on those texts
    name_weight: int = 0
    batch_size: int = 32  # sequences per step per process
    grad_accum: int = 1
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    # "cosine": warm-up, then cosine decay to min_lr at max_steps. "wsd" (warm-up, stable,
    # decay): warm-up, then lr until the last decay_steps, which decay linearly to min_lr; a run
    # in its stable phase can be continued for longer (--resume, a larger max_steps) unchanged.
    schedule: str = "cosine"
    decay_steps: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_interval: int = 200
    eval_batches: int = 20  # windows of context_length per periodic evaluation (0 = all)
    log_interval: int = 10
    checkpoint_interval: int = 500
    seed: int = 1337
    compile: bool = False
    device: str = "auto"
    threads: int = 0  # CPU intra-op threads; 0 = torch's default
    save_dtype: str = "float32"  # dtype of model.safetensors in the final checkpoint
    n_samples: int = 5
    sample_tokens: int = 60
    # decoder only: this share of the training rows repeats a span of its own text later in
    # the row (model/training/curriculum.py), so that copying from context pays early
    repeat_share: float = 0.0
    repeat_min: int = 8  # span length, tokens
    repeat_max: int = 0  # 0: half the context
    # encoder only: masked-LM pretraining for max_steps, then genre fine-tuning
    mask_prob: float = 0.15
    whole_word_mask: bool = False  # pick words, not tokens, for masked-LM (model/data/mlm.py)
    # fine-tuning keeps the masked LM up: loss = genre loss + classify_mlm_weight x masked-LM
    # loss on a masked-LM batch of its own (0: the genre loss alone, and the MLM head idles)
    classify_mlm_weight: float = 0.0
    classify_steps: int = 0  # fine-tuning steps after pretraining (0: MLM only)
    classify_lr: float = 3e-4
    classify_min_lr: float = 3e-5
    classify_warmup_steps: int = 20
    classify_batch_size: int = 32
    bow_baseline: bool = True  # the final report measures bag-of-words and majority baselines
    # encoder-decoder only: held-out pairs of each kind (dates, numbers) the final report decodes
    eval_pairs: int = 2000


@dataclass
class RunConfig:
    model: ModelConfig
    train: TrainSettings = field(default_factory=TrainSettings)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "train": asdict(self.train)}


def _coerce(value: str, current: Any) -> Any:
    if isinstance(current, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(current, int):
        return int(value)
    if isinstance(current, float):
        return float(value)
    if value.lower() in ("none", "null"):
        return None
    return value


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """A TOML or JSON file with a [model] and a [train] table; `section.key=value` overrides."""
    path = Path(path)
    raw = path.read_text(encoding="utf-8")
    data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw)
    unknown = sorted(set(data) - {"model", "train"})
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {', '.join(unknown)}")
    model_d, train_d = dict(data.get("model", {})), dict(data.get("train", {}))
    train_fields = {f.name: f for f in fields(TrainSettings)}
    for item in overrides or []:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        target = {"model": model_d, "train": train_d}.get(section)
        if target is None or not name:
            raise ValueError(f"override {item!r} must look like model.KEY=VALUE or train.KEY=VALUE")
        default = (
            getattr(TrainSettings(), name, None) if section == "train"
            else getattr(ModelConfig(), name, None)
        )
        target[name] = _coerce(value, target.get(name, default))
    bad = sorted(set(train_d) - set(train_fields))
    if bad:
        raise ValueError(f"{path}: unknown train setting(s) {', '.join(bad)}")
    settings = TrainSettings(**train_d)
    if settings.schedule not in ("cosine", "wsd"):
        raise ValueError(f"{path}: train.schedule must be 'cosine' or 'wsd', got {settings.schedule!r}")
    if settings.schedule == "wsd" and not 0 < settings.decay_steps <= settings.max_steps - settings.warmup_steps:
        raise ValueError(f"{path}: a 'wsd' schedule needs 0 < decay_steps <= max_steps - warmup_steps")
    if not 0.0 <= settings.repeat_share <= 1.0:
        raise ValueError(f"{path}: train.repeat_share must be in [0, 1], got {settings.repeat_share!r}")
    return RunConfig(model=ModelConfig.from_dict(model_d), train=settings)


# --- data --------------------------------------------------------------------------------
def encode_corpus(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """One long stream: each work's tokens followed by EOS."""
    ids: list[int] = []
    for encoded in tokenizer.encode_batch(texts):
        ids.extend(encoded)
        ids.append(tokenizer.eos_id)
    return torch.tensor(ids, dtype=torch.long)


def batch_at(stream: torch.Tensor, step: int, rank: int, batch_size: int, block: int, seed: int):
    """The (x, y) batch for this step and rank: random windows, seeded by (seed, step, rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    starts = torch.randint(0, len(stream) - block - 1, (batch_size,), generator=g)
    x = torch.stack([stream[s : s + block] for s in starts])
    y = torch.stack([stream[s + 1 : s + 1 + block] for s in starts])
    return x, y


def token_byte_lengths(tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes each token stands for; EOS counts as 0 (it is not text)."""
    lengths = torch.zeros(vocab_size, dtype=torch.float64)
    for i in range(tokenizer.vocab_size):
        lengths[i] = 0 if i == tokenizer.eos_id else len(tokenizer.token_bytes(i))
    return lengths


@torch.no_grad()
def evaluate(model, stream, byte_lengths, block, device, max_windows=0, batch_size=16, autocast=None):
    """Loss in nats/token and bits per byte over consecutive windows of the validation stream.

    bits per byte = total nats / ln 2 / UTF-8 bytes of the predicted tokens, so it does not
    depend on the tokenizer.
    """
    model.eval()
    n_windows = (len(stream) - 1) // block
    if max_windows:
        n_windows = min(n_windows, max_windows)
    total_nats, total_tokens, total_bytes = 0.0, 0, 0.0
    for first in range(0, n_windows, batch_size):
        idx = range(first, min(first + batch_size, n_windows))
        x = torch.stack([stream[i * block : i * block + block] for i in idx]).to(device)
        y = torch.stack([stream[i * block + 1 : i * block + block + 1] for i in idx])
        with autocast or contextlib.nullcontext():
            logits = model(x).logits
        nats = F.cross_entropy(logits.float().flatten(0, 1).cpu(), y.flatten(), reduction="sum")
        total_nats += float(nats)
        total_tokens += y.numel()
        total_bytes += float(byte_lengths[y.flatten()].sum())
    model.train()
    return {
        "val_loss": total_nats / total_tokens,
        "val_bits_per_byte": total_nats / LN2 / total_bytes,
        "val_tokens": total_tokens,
        "val_bytes": int(total_bytes),
    }


# --- objectives: what a step trains and how a run is evaluated ----------------------------
@dataclass
class Batch:
    tensors: tuple  # already on the device
    n_tokens: int  # tokens this batch feeds the model (for tokens/s)


class Objective:
    """What every objective shares: by default one phase and the run's cosine learning rate.
    A subclass sets self.s (TrainSettings) and overrides these for more than one phase."""

    has_unused_parameters = False
    s: TrainSettings

    def phase(self, step: int) -> str | None:
        return None

    def ends_phase(self, step: int) -> bool:
        return False

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.s)


class LMObjective(Objective):
    """Next-token prediction for the decoder: random windows, bits per byte on held-out works."""

    def __init__(self, run: RunConfig, tokenizer: Tokenizer, device, autocast, texts):
        train_texts, val_texts = texts  # the works' train and val splits
        self.s, self.tokenizer, self.device, self.autocast = run.train, tokenizer, device, autocast
        self.block = run.model.context_length
        self.train_stream = encode_corpus(tokenizer, train_texts)
        self.val_stream = encode_corpus(tokenizer, val_texts)
        self.byte_lengths = token_byte_lengths(tokenizer, run.model.vocab_size)
        self.total_steps = run.train.max_steps

    def batch(self, step: int, micro: int, rank: int) -> Batch:
        s = self.s
        if s.repeat_share > 0:
            x, y = batch_with_repeats(self.train_stream, step * s.grad_accum + micro, rank, s.batch_size,
                                      self.block, s.seed, share=s.repeat_share, min_span=s.repeat_min,
                                      max_span=s.repeat_max or self.block // 2)
        else:
            x, y = batch_at(self.train_stream, step * s.grad_accum + micro, rank, s.batch_size, self.block, s.seed)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return Batch((x, y), x.numel())

    def loss(self, fwd_model, step: int, batch: Batch) -> torch.Tensor:
        x, y = batch.tensors
        logits = fwd_model(x).logits
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def round_to_save_dtype(self, model) -> None:
        pass  # the decoder's report is measured before the final cast (as it always was)

    def evaluate(self, model, step: int, full: bool) -> dict:
        return evaluate(model, self.val_stream, self.byte_lengths, self.block, self.device,
                        max_windows=0 if full else self.s.eval_batches, autocast=self.autocast)

    def describe(self, ev: dict) -> str:
        return f"val loss {ev['val_loss']:.4f}, {ev['val_bits_per_byte']:.4f} bits/byte"

    def final_report(self, model) -> dict:
        s = self.s
        return {"samples": sample_generations(model, self.tokenizer, s.n_samples, s.sample_tokens, s.seed)}


# --- optimisation ------------------------------------------------------------------------
def make_optimizer(model: torch.nn.Module, s: TrainSettings, fused: bool) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": s.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=s.lr, betas=(s.beta1, s.beta2), fused=fused)


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.schedule == "wsd":
        decay_start = s.max_steps - s.decay_steps
        if step < decay_start:
            return s.lr
        progress = min(1.0, (step + 1 - decay_start) / s.decay_steps)  # min_lr at the last step
        return s.lr + progress * (s.min_lr - s.lr)
    progress = min(1.0, (step - s.warmup_steps) / max(1, s.max_steps - s.warmup_steps))
    return s.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (s.lr - s.min_lr)


def save_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: Path) -> None:
    """Optimizer moments as safetensors (named by parameter), no pickling."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensors[f"{names[id(p)]}::{key}"] = value.detach().cpu().contiguous()
    save_file(tensors, str(path))


def load_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: Path) -> None:
    tensors = load_file(str(path))
    params = dict(model.named_parameters())
    for key, value in tensors.items():
        name, _, slot = key.partition("::")
        p = params[name]
        optimizer.state[p][slot] = value.to(p.device) if slot != "step" else value


# --- distributed -------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device_pref: str) -> tuple[Dist, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = torch.cuda.is_available() and device_pref in ("auto", "cuda")
    if world > 1:
        import torch.distributed as dist

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        info = Dist(rank=dist.get_rank(), world=world, local_rank=local_rank)
    else:
        info = Dist()
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
        device = torch.device("cuda", info.local_rank)
    else:
        device = torch.device("cpu")
    return info, device


def hardware_description(device: torch.device, world: int) -> str:
    if device.type == "cuda":
        return f"{world} x {torch.cuda.get_device_name(device)}"
    return f"{world} x CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# --- plot & report -----------------------------------------------------------------------
def plot_losses(metrics_path: Path, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text(encoding="utf-8").splitlines()]
    if any(r.get("phase") == "classify" for r in records):
        return plot_encoder_run(records, out_png, plt)
    train_pts: list[tuple[int, float]] = []
    val_pts: list[tuple[int, float]] = []
    full_pts: list[tuple[int, float]] = []
    for rec in records:
        if "train_loss" in rec:
            train_pts.append((rec["step"], rec["train_loss"]))
        if "val_loss" in rec:  # periodic: a fixed sample of windows; final: every window
            (full_pts if rec.get("full") else val_pts).append((rec["step"], rec["val_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train_pts:
        ax.plot(*zip(*train_pts), label="train", lw=1, alpha=0.8)
    if val_pts:
        ax.plot(*zip(*val_pts), "o-", label="val, sample of held-out works", lw=1.5, ms=3)
    for step, loss in full_pts:
        ax.plot([step], [loss], "D", color="C3", ms=6, label="val, all held-out works")
        ax.annotate(f"{loss:.3f}", (step, loss), textcoords="offset points", xytext=(-10, 8), ha="right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("attnlens training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def plot_encoder_run(records: list[dict], out_png: Path, plt) -> None:
    """Two panels: masked-LM loss (train, held-out) and fine-tuning (loss, held-out genre accuracy)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    mlm = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r and r.get("phase") == "mlm"]
    cls = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r and r.get("phase") == "classify"]
    val = [(r["step"], r["val_loss"], r.get("full")) for r in records if "val_loss" in r]
    acc = [(r["step"], r["val_genre_accuracy"], r["val_genre_balanced_accuracy"])
           for r in records if "val_genre_accuracy" in r]
    if mlm:
        ax1.plot(*zip(*mlm), lw=1, alpha=0.8, label="train (masked positions)")
    if val:
        ax1.plot([s for s, _, _ in val], [v for _, v, _ in val], "o-", ms=3, label="held-out works")
    ax1.set(xlabel="step", ylabel="masked-LM loss (nats / masked token)", title="masked-LM pretraining")
    ax1.grid(alpha=0.3)
    ax1.legend()
    if cls:
        ax2.plot(*zip(*cls), lw=1, alpha=0.8, label="train loss (cross-entropy)")
    ax2.set(xlabel="step", ylabel="genre loss", title="genre fine-tuning")
    ax2.grid(alpha=0.3)
    if acc:
        twin = ax2.twinx()
        twin.plot([s for s, _, _ in acc], [a for _, a, _ in acc], "s-", color="C2", ms=4, label="held-out accuracy")
        twin.plot([s for s, _, _ in acc], [b for _, _, b in acc], "^-", color="C3", ms=4,
                  label="held-out balanced accuracy")
        twin.set_ylim(0, 1)
        twin.set_ylabel("held-out genre accuracy")
        twin.legend(loc="upper right")
    ax2.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def sample_generations(model, tokenizer, n: int, n_tokens: int, seed: int) -> list[dict[str, str]]:
    samples = []
    for i, prompt in enumerate(SAMPLE_PROMPTS[:n]):
        ids = tokenizer.encode(prompt)
        params = SamplingParams(temperature=0.8, top_k=50, seed=seed + i)
        out = [t.id for t in generate_tokens(model, ids, n_tokens, params)]
        samples.append({"prompt": prompt, "completion": tokenizer.decode(out)})
    return samples


# --- the loop ----------------------------------------------------------------------------
class Interrupted(Exception):
    pass


def train(
    run: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    show_progress: bool = True,
    stop_at_step: int | None = None,
) -> dict:
    """Train; `stop_at_step` behaves like Ctrl-C at that step (save, then return)."""
    s, mcfg = run.train, run.model
    out = Path(out_dir)
    dist_info, device = setup_distributed(s.device)
    if s.threads and device.type == "cpu":
        torch.set_num_threads(s.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = (
        torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    )

    # tokenizer, data and objective: as the family declares them (Family.training)
    family = family_named(mcfg.family)
    spec = family.training
    if spec is None:
        raise ValueError(f"the {family.name} family declares no training: its models are imported, not trained")
    texts = (load_split(s.data_dir, "train"), load_split(s.data_dir, "val")) if spec.data == "corpus" else None
    if resume and (out / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(out / "tokenizer.json")
    elif s.tokenizer:
        tokenizer = Tokenizer.from_file(s.tokenizer)
    elif spec.tokenizer == "translation":
        tokenizer = train_translation_tokenizer(s.vocab_size)
    elif texts is None:  # a family's declaration: a tokenizer over the corpus, but data of its own
        raise ValueError(f"the {family.name} family trains a {spec.tokenizer!r} tokenizer over the corpus "
                         "but declares data='own' (no corpus is read)")
    else:
        tokenizer = Tokenizer.train(texts[0] + tokenizer_texts(s.name_weight), s.vocab_size,
                                    encoder_tokens=spec.tokenizer == "corpus_specials")
    if tokenizer.vocab_size > mcfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens; model.vocab_size is {mcfg.vocab_size}")
    objective = spec.objective_class()(run, tokenizer, device, autocast, texts)
    total_steps = objective.total_steps

    # model and optimiser
    torch.manual_seed(s.seed)
    model = build_model(mcfg).to(device)
    optimizer = make_optimizer(model, s, fused=device.type == "cuda")
    start_step, tokens_seen, wall_before = 0, 0, 0.0
    if resume:
        state = json.loads((out / "train_state.json").read_text(encoding="utf-8"))
        load_weights(model, out / "model.safetensors")
        load_optimizer(optimizer, model, out / "optimizer.safetensors")
        start_step, tokens_seen, wall_before = state["step"], state["tokens_seen"], state["wall_time_s"]
    fwd_model = torch.compile(model) if s.compile else model
    if dist_info.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        fwd_model = DDP(fwd_model, device_ids=[dist_info.local_rank] if device.type == "cuda" else None,
                        find_unused_parameters=objective.has_unused_parameters)

    if dist_info.main:
        out.mkdir(parents=True, exist_ok=True)
        if not resume:
            (out / "metrics.jsonl").write_text("", encoding="utf-8")
    metrics_file = (out / "metrics.jsonl").open("a", encoding="utf-8") if dist_info.main else None

    def log(record: dict) -> None:
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()

    last: dict[str, float] = {}

    def save(step: int, final: bool) -> None:
        if not dist_info.main:
            return
        wall = wall_before + (time.perf_counter() - t0)
        report = build_report(run, tokenizer, model, step, tokens_seen, wall, device, dist_info, last)
        if final:
            report.update(objective.final_report(model))
        save_checkpoint(out, model, tokenizer, report=report,
                        dtype=getattr(torch, s.save_dtype) if final else None)
        save_optimizer(optimizer, model, out / "optimizer.safetensors")
        state = {"step": step, "tokens_seen": tokens_seen, "wall_time_s": wall, "final": final}
        (out / "train_state.json").write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")

    # Ctrl-C: finish the current step, save, exit.
    stop = {"requested": False}

    def on_sigint(signum, frame):
        if stop["requested"]:
            raise KeyboardInterrupt
        stop["requested"] = True

    old_handler = signal.signal(signal.SIGINT, on_sigint) if dist_info.main else None

    bar = tqdm(total=total_steps, initial=start_step, disable=not (show_progress and dist_info.main),
               desc="train", unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    t_window, tokens_window = time.perf_counter(), 0
    model.train()
    step = start_step
    try:
        while step < total_steps:
            lr = objective.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            torch.manual_seed(s.seed + 7919 * step + dist_info.rank)  # dropout masks: resumable
            loss_sum = 0.0
            tokens_per_step = 0
            for micro in range(s.grad_accum):
                batch = objective.batch(step, micro, dist_info.rank)
                sync = contextlib.nullcontext()
                if dist_info.world > 1 and micro < s.grad_accum - 1:
                    sync = fwd_model.no_sync()
                with sync, (autocast or contextlib.nullcontext()):
                    loss = objective.loss(fwd_model, step, batch) / s.grad_accum
                loss.backward()
                loss_sum += float(loss.detach())
                tokens_per_step += batch.n_tokens * dist_info.world
            if s.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            tokens_window += tokens_per_step
            last["train_loss"] = loss_sum

            phase = objective.phase(step - 1)
            if step % s.log_interval == 0 or step == total_steps:
                elapsed = time.perf_counter() - t_window
                tps = tokens_window / max(elapsed, 1e-9)
                t_window, tokens_window = time.perf_counter(), 0
                log({"step": step, "train_loss": loss_sum, "lr": lr, "tokens_per_s": tps,
                     "tokens_seen": tokens_seen, **({"phase": phase} if phase else {})})
                bar.set_postfix(loss=f"{loss_sum:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}")
            final_eval = step == total_steps or objective.ends_phase(step)
            if dist_info.main and (step % s.eval_interval == 0 or final_eval):
                if step == total_steps:  # the report describes the weights as saved
                    objective.round_to_save_dtype(model)
                ev = objective.evaluate(model, step, full=final_eval)
                last.update(ev)
                log({"step": step, **ev, "full": final_eval, **({"phase": phase} if phase else {})})
                bar.write(f"step {step}: " + objective.describe(ev))
            bar.update(1)
            if step % s.checkpoint_interval == 0 and step < total_steps:
                save(step, final=False)
            if stop["requested"] or (stop_at_step is not None and step >= stop_at_step):
                raise Interrupted
        save(step, final=True)
    except Interrupted:
        bar.write(f"interrupted: saving a checkpoint at step {step} in {out}")
        save(step, final=False)
    finally:
        bar.close()
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
        if metrics_file:
            metrics_file.close()
        if dist_info.main and (out / "metrics.jsonl").is_file():
            plot_losses(out / "metrics.jsonl", out / "loss.png")
        if dist_info.world > 1:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
    return {"step": step, **last}


def build_report(run, tokenizer, model, step, tokens_seen, wall, device, dist_info, last) -> dict:
    return {
        "config": run.to_dict(),
        "steps": step,
        "tokens_seen": tokens_seen,
        "wall_time_s": round(wall, 1),
        "hardware": hardware_description(device, dist_info.world),
        "torch": torch.__version__,
        "parameters": model.num_parameters(),
        "final_train_loss": last.get("train_loss"),
        "final_val_loss": last.get("val_loss"),
        "val_bits_per_byte": last.get("val_bits_per_byte"),
        "val_tokens": last.get("val_tokens"),
        "tokenizer_vocab_size": tokenizer.vocab_size,
    }


def train_from_file(config_path, out_dir, *, resume: bool = False, overrides: list[str] | None = None) -> dict:
    run = load_run_config(config_path, overrides)
    return train(run, out_dir, resume=resume)

"""Training objectives of the encoder: masked-LM pretraining, then genre fine-tuning.

Steps 0 .. max_steps-1 are masked-LM on random windows of every training work; steps
max_steps .. max_steps+classify_steps-1 fine-tune the whole encoder and its classification
head on random windows of the Folio-catalogued training works, each batch drawn evenly
from the three genres. Every batch comes from a generator seeded by (seed, step, rank), so
a resumed run sees the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnlens.model.data.genres import GENRES
from attnlens.model.data.mlm import IGNORE, mask_tokens, mask_words, word_edges
from attnlens.model.data.passages import frame, load_works, random_windows, tokenize_works
from attnlens.model.evaluation.evaluate_encoder import (
    EVAL_MASK_SEED,
    build_split,
    encoder_report,
    every_nth,
    genre_metrics,
    mlm_metrics,
)
from attnlens.model.training.train import Batch, Objective, RunConfig, lr_at


def cosine_lr(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


class EncoderObjective(Objective):
    has_unused_parameters = True  # the classification head is idle during pretraining

    def __init__(self, run: RunConfig, tokenizer, device, autocast, texts=None):
        if not tokenizer.has_encoder_tokens:
            raise ValueError("an encoder needs a tokenizer with [PAD] [CLS] [SEP] [MASK]")
        self.s, self.cfg, self.tokenizer, self.device = run.train, run.model, tokenizer, device
        if self.s.classify_steps and list(self.cfg.labels) != list(GENRES):
            raise ValueError(f"genre fine-tuning needs model.labels = {list(GENRES)}, got {self.cfg.labels}")
        self.length = self.cfg.context_length - 2  # room for [CLS] and [SEP]
        works = load_works(self.s.data_dir)
        self.mlm_works = tokenize_works(tokenizer, [w for w in works if w.split == "train"])
        labelled = tokenize_works(tokenizer, [w for w in works if w.split == "train" and w.genre])
        self.by_genre = [[w for w in labelled if w.genre == g] for g in GENRES]
        self.split = build_split(self.s.data_dir, tokenizer, self.cfg.context_length)
        # periodic evaluations read every 4th held-out passage; the final one reads all
        self.quick_split = every_nth(self.split, 4)
        self.total_steps = self.s.max_steps + self.s.classify_steps
        self.edges = word_edges(tokenizer, self.cfg.vocab_size) if self.s.whole_word_mask else None

    # --- schedule ------------------------------------------------------------------
    def phase(self, step: int) -> str:
        return "mlm" if step < self.s.max_steps else "classify"

    def ends_phase(self, step: int) -> bool:
        return step == self.s.max_steps and self.s.classify_steps > 0

    def lr_at(self, step: int) -> float:
        s = self.s
        if step < s.max_steps:
            return lr_at(step, s)
        return cosine_lr(step - s.max_steps, lr=s.classify_lr, min_lr=s.classify_min_lr,
                         warmup=s.classify_warmup_steps, total=s.classify_steps)

    # --- batches -------------------------------------------------------------------
    def _generator(self, step: int, micro: int, rank: int) -> torch.Generator:
        return torch.Generator().manual_seed(
            self.s.seed * 1_000_003 + (step * self.s.grad_accum + micro) * 101 + rank)

    def mlm_rows(self, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of one masked-LM batch: random windows of every training work."""
        body, _ = random_windows(self.mlm_works, self.length, self.s.batch_size, g)
        rows = frame(body, self.tokenizer)
        tok = self.tokenizer
        common = dict(mask_id=tok.mask_id, special_ids=tok.special_ids, vocab_size=tok.vocab_size,
                      generator=g, mask_prob=self.s.mask_prob)
        if self.edges is not None:
            return mask_words(rows, edges=self.edges, **common)
        return mask_tokens(rows, **common)

    def batch(self, step: int, micro: int, rank: int) -> Batch:
        g = self._generator(step, micro, rank)
        if self.phase(step) == "mlm":
            inputs, labels = self.mlm_rows(g)
            return Batch((inputs.to(self.device), labels.to(self.device)), inputs.numel())
        n = self.s.classify_batch_size
        genres = torch.randint(0, len(GENRES), (n,), generator=g)  # genres drawn evenly
        bodies = [random_windows(self.by_genre[k], self.length, 1, g)[0] for k in genres.tolist()]
        rows = frame(torch.cat(bodies), self.tokenizer)
        tensors: tuple[torch.Tensor, ...] = (rows.to(self.device), genres.to(self.device))
        if self.s.classify_mlm_weight > 0:
            inputs, labels = self.mlm_rows(g)
            tensors += (inputs.to(self.device), labels.to(self.device))
            return Batch(tensors, rows.numel() + inputs.numel())
        return Batch(tensors, rows.numel())

    @staticmethod
    def mlm_loss(fwd_model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        picked = labels != IGNORE
        # the head runs inside the (DDP-wrapped) forward, on the scored positions only: (P, V)
        logits = fwd_model(inputs, task="mlm", positions=picked).logits
        return F.cross_entropy(logits.float(), labels[picked])

    def loss(self, fwd_model, step: int, batch: Batch) -> torch.Tensor:
        if self.phase(step) == "mlm":
            return self.mlm_loss(fwd_model, *batch.tensors)
        rows, genres = batch.tensors[:2]
        logits = fwd_model(rows, task="classify").logits  # (B, 3)
        loss = F.cross_entropy(logits.float(), genres)
        if len(batch.tensors) > 2:  # the mixed loss: the masked LM is kept up while fine-tuning
            loss = loss + self.s.classify_mlm_weight * self.mlm_loss(fwd_model, *batch.tensors[2:])
        return loss

    # --- evaluation ----------------------------------------------------------------
    def round_to_save_dtype(self, model) -> None:
        dtype = getattr(torch, self.s.save_dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).to(p.dtype))

    def evaluate(self, model, step: int, full: bool) -> dict:
        split = self.split if full else self.quick_split
        ev = mlm_metrics(model, split.val_rows, self.tokenizer)
        out = {"val_loss": ev["mlm_loss"], "val_mlm_accuracy": ev["mlm_accuracy"]}
        if self.phase(step - 1) == "classify":
            g = genre_metrics(model, split)
            out.update(val_genre_accuracy=g["accuracy"], val_genre_balanced_accuracy=g["balanced_accuracy"])
        model.train()
        return out

    def describe(self, ev: dict) -> str:
        text = f"held-out MLM loss {ev['val_loss']:.4f}, top-1 {ev['val_mlm_accuracy']:.3f}"
        if "val_genre_accuracy" in ev:
            text += (f"; genre acc {ev['val_genre_accuracy']:.3f}, "
                     f"balanced {ev['val_genre_balanced_accuracy']:.3f}")
        return text

    def final_report(self, model) -> dict:
        report = encoder_report(model, self.split, with_baselines=self.s.bow_baseline)
        report["mlm_steps"] = self.s.max_steps
        report["classify_steps"] = self.s.classify_steps
        report["eval_mask_seed"] = EVAL_MASK_SEED
        model.train()
        return report

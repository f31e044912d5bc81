"""The encoder-decoder's training objective: English -> French dates and numbers.

Each step draws `batch_size` pairs that are not held out (model/data/translation_pairs.py) from
a generator seeded by (seed, step, rank), so a resumed run sees the batches an uninterrupted
run would have seen. Teacher forcing: the decoder reads [EOS] + target and predicts
target + [EOS] (EOS both starts and ends a translation); padding is masked on both sides
and ignored by the loss.

Evaluation is greedy decoding on held-out pairs only, exact match per kind (dates,
numbers): a periodic check on a small fixed sample and, at the end, the report's larger one.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from attnlens.model.data.translation_pairs import KINDS, Pair, held_out_sample, is_held_out, sample_training_pairs
from attnlens.model.families.encoder_decoder import decoder_start_id, greedy_translate
from attnlens.model.tokenizer import Tokenizer
from attnlens.model.training.train import Batch, Objective, RunConfig

IGNORE = -100


def pad_rows(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def encode_pairs(tokenizer: Tokenizer, pairs: list[Pair]):
    """(source, source_keep, decoder_inputs, target_keep, labels): right-padded (B, S) / (B, T)."""
    pad_id, eos_id = tokenizer.pad_id, tokenizer.eos_id
    if pad_id is None:
        raise ValueError("the translator needs a tokenizer with [PAD] (encoder_tokens=True)")
    if eos_id is None:
        raise ValueError("the translator needs a tokenizer with an end-of-text token (EOS)")
    start = decoder_start_id(tokenizer)
    src = tokenizer.encode_batch([p.source for p in pairs])
    tgt = tokenizer.encode_batch([p.target for p in pairs])
    source = pad_rows(src, pad_id)
    source_keep = pad_rows([[1] * len(s) for s in src], 0).bool()
    inputs = pad_rows([[start] + t for t in tgt], pad_id)
    target_keep = pad_rows([[1] * (len(t) + 1) for t in tgt], 0).bool()
    labels = pad_rows([t + [eos_id] for t in tgt], IGNORE)
    return source, source_keep, inputs, target_keep, labels


def exact_match(model, tokenizer: Tokenizer, pairs: list[Pair]) -> dict:
    """Greedy exact-match accuracy over `pairs` and the pairs it got wrong."""
    got = greedy_translate(model, tokenizer, [p.source for p in pairs])
    mistakes = [{"source": p.source, "expected": p.target, "got": g} for p, g in zip(pairs, got) if g != p.target]
    return {"n": len(pairs), "correct": len(pairs) - len(mistakes),
            "accuracy": (len(pairs) - len(mistakes)) / len(pairs), "mistakes": mistakes}


class TranslationObjective(Objective):
    QUICK_EVAL = 100  # held-out pairs of each kind in the periodic evaluations

    def __init__(self, run: RunConfig, tokenizer: Tokenizer, device, autocast, texts=None):
        if tokenizer.pad_id is None:
            raise ValueError("the translator needs a tokenizer with [PAD] (encoder_tokens=True)")
        self.s, self.cfg, self.tokenizer, self.device, self.autocast = run.train, run.model, tokenizer, device, autocast
        self.total_steps = self.s.max_steps
        n_quick = min(self.QUICK_EVAL, self.s.eval_pairs)
        self.quick = {k: held_out_sample(k, n_quick, seed=1) for k in KINDS}

    def batch(self, step: int, micro: int, rank: int) -> Batch:
        g = torch.Generator().manual_seed(self.s.seed * 1_000_003 + (step * self.s.grad_accum + micro) * 101 + rank)
        pairs = sample_training_pairs(self.s.batch_size, g)
        tensors = tuple(t.to(self.device) for t in encode_pairs(self.tokenizer, pairs))
        n_tokens = int(tensors[1].sum() + tensors[3].sum())
        return Batch(tensors, n_tokens)

    def loss(self, fwd_model, step: int, batch: Batch) -> torch.Tensor:
        source, source_keep, inputs, target_keep, labels = batch.tensors
        logits = fwd_model(inputs, source=source, source_mask=source_keep, target_mask=target_keep).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE)

    def round_to_save_dtype(self, model) -> None:
        dtype = getattr(torch, self.s.save_dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).to(p.dtype))

    @torch.no_grad()
    def held_out_loss(self, model, pairs: list[Pair]) -> float:
        source, source_keep, inputs, target_keep, labels = (t.to(self.device) for t in encode_pairs(self.tokenizer, pairs))
        logits = model(inputs, source=source, source_mask=source_keep, target_mask=target_keep).logits
        return float(F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE))

    def evaluate(self, model, step: int, full: bool) -> dict:
        model.eval()
        out = {"val_loss": self.held_out_loss(model, self.quick["date"] + self.quick["number"])}
        for kind in KINDS:
            out[f"val_{kind}_exact_match"] = exact_match(model, self.tokenizer, self.quick[kind])["accuracy"]
        model.train()
        return out

    def describe(self, ev: dict) -> str:
        return (f"held-out loss {ev['val_loss']:.4f}, exact match dates {ev['val_date_exact_match']:.3f}, "
                f"numbers {ev['val_number_exact_match']:.3f}")

    def final_report(self, model) -> dict:
        return translation_report(model, self.tokenizer, self.s.eval_pairs)


def translation_report(model, tokenizer: Tokenizer, n_per_kind: int, seed: int = 0, n_mistakes: int = 10) -> dict:
    """Held-out greedy exact match per kind on `n_per_kind` pairs each (held_out_sample(kind, n, seed))."""
    was_training = model.training
    model.eval()
    report: dict = {"task": "English -> French dates (babel full/long/medium, 1900-2099) and numbers "
                            "(num2words, 0-999,999)",
                    "held_out_rule": "int(sha256(source).hexdigest(), 16) % 10 == 0",
                    "eval_seed": seed, "decoding": "greedy"}
    for kind in KINDS:
        pairs = held_out_sample(kind, n_per_kind, seed=seed)
        assert all(is_held_out(p.source) for p in pairs)
        r = exact_match(model, tokenizer, pairs)
        report[f"held_out_{kind}s"] = {"n": r["n"], "correct": r["correct"], "exact_match": r["accuracy"],
                                       "mistakes": r["mistakes"][:n_mistakes]}
    report["load_average_1_5_15_min"] = [round(x, 2) for x in os.getloadavg()]  # the machine was shared
    model.train(was_training)
    return report

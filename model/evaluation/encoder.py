"""The encoder's held-out figures, measured one way for the training report and the tests.

- masked-LM: the held-out works cut into consecutive [CLS] passage [SEP] rows, masked with a
  fixed seed (15%, 80/10/10); loss (nats) and top-1 accuracy over the masked positions.
- genre: the same held-out passages (every held-out work is in the Folio's Catalogue),
  accuracy, balanced accuracy (mean per-class recall) and the confusion matrix.
- baselines on the same split: a bag-of-words logistic regression trained on the training
  works' passages (their text, the same token windows) and the majority class of those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data.genres import GENRES
from ..data.mlm import IGNORE, mask_tokens
from ..data.passages import TokenizedWork, fixed_passages, frame, load_works, tokenize_works
from ..tokenizer import Tokenizer

EVAL_MASK_SEED = 20231
BATCH = 64


@dataclass
class Split:
    """Held-out and training passages of the Folio-catalogued works, plus held-out MLM rows."""

    val_rows: torch.Tensor  # (N, T) framed held-out passages (every held-out work)
    val_labels: list[str | None]
    train_rows: torch.Tensor  # (M, T) framed training passages of catalogued works
    train_labels: list[str]
    tokenizer: Tokenizer


def build_split(data_dir, tokenizer: Tokenizer, context_length: int) -> Split:
    works = load_works(data_dir)
    length = context_length - 2
    val = tokenize_works(tokenizer, [w for w in works if w.split == "val"])
    train = tokenize_works(tokenizer, [w for w in works if w.split == "train" and w.genre])
    val_ids, val_owner = fixed_passages(val, length)
    train_ids, train_owner = fixed_passages(train, length)
    return Split(frame(val_ids, tokenizer), [val[k].genre for k in val_owner],
                 frame(train_ids, tokenizer), [train[k].genre for k in train_owner], tokenizer)


def every_nth(split: Split, n: int) -> Split:
    """A deterministic sample of the held-out rows (for quick evaluations and tests)."""
    return Split(split.val_rows[::n], split.val_labels[::n], split.train_rows, split.train_labels,
                 split.tokenizer)


@torch.no_grad()
def mlm_metrics(model, rows: torch.Tensor, tokenizer: Tokenizer, mask_prob: float = 0.15) -> dict:
    model.eval()
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(EVAL_MASK_SEED)
    inputs, labels = mask_tokens(rows, mask_id=tokenizer.mask_id, special_ids=tokenizer.special_ids,
                                 vocab_size=tokenizer.vocab_size, generator=g, mask_prob=mask_prob)
    nats, correct, count = 0.0, 0, 0
    for i in range(0, len(rows), BATCH):
        x, y = inputs[i : i + BATCH].to(device), labels[i : i + BATCH].to(device)
        picked = y != IGNORE
        logits = model(x, task="mlm", positions=picked).logits.float()  # (P, V)
        nats += float(F.cross_entropy(logits, y[picked], reduction="sum"))
        correct += int((logits.argmax(-1) == y[picked]).sum())
        count += int(picked.sum())
    return {"mlm_loss": nats / count, "mlm_accuracy": correct / count, "mlm_masked_tokens": count}


def classification_figures(true: list[str], pred: list[str], labels=GENRES) -> dict:
    index = {label: i for i, label in enumerate(labels)}
    matrix = [[0] * len(labels) for _ in labels]
    for t, p in zip(true, pred):
        matrix[index[t]][index[p]] += 1
    recalls = [row[i] / sum(row) for i, row in enumerate(matrix) if sum(row)]
    return {
        "accuracy": sum(t == p for t, p in zip(true, pred)) / len(true),
        "balanced_accuracy": sum(recalls) / len(recalls),
        "confusion_matrix": {"labels": list(labels), "rows": "true label", "columns": "predicted",
                             "counts": matrix},
        "passages": len(true),
    }


@torch.no_grad()
def genre_predictions(model, rows: torch.Tensor) -> list[str]:
    model.eval()
    device = next(model.parameters()).device
    labels = model.config.labels
    out = []
    for i in range(0, len(rows), BATCH):
        logits = model(rows[i : i + BATCH].to(device), task="classify").logits
        out.extend(labels[j] for j in logits.argmax(-1).tolist())
    return out


def genre_metrics(model, split: Split) -> dict:
    keep = [i for i, label in enumerate(split.val_labels) if label]
    rows = split.val_rows[keep]
    true = [split.val_labels[i] for i in keep]
    return classification_figures(true, genre_predictions(model, rows))


def passage_texts(rows: torch.Tensor, tokenizer: Tokenizer) -> list[str]:
    """The text of framed rows without [CLS]/[SEP]."""
    return [tokenizer.decode(r[1:-1].tolist()) for r in rows]


def bow_baseline(split: Split) -> dict:
    """TF-IDF bag of words (lower-cased word unigrams) + logistic regression, class-balanced."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vectorizer = TfidfVectorizer(lowercase=True, sublinear_tf=True, min_df=2)
    x_train = vectorizer.fit_transform(passage_texts(split.train_rows, split.tokenizer))
    clf = LogisticRegression(max_iter=2000, class_weight="balanced")
    clf.fit(x_train, split.train_labels)
    keep = [i for i, label in enumerate(split.val_labels) if label]
    x_val = vectorizer.transform(passage_texts(split.val_rows[keep], split.tokenizer))
    pred = [str(p) for p in clf.predict(x_val)]
    figures = classification_figures([split.val_labels[i] for i in keep], pred)
    figures["method"] = ("sklearn TfidfVectorizer(lowercase, sublinear_tf, min_df=2) + "
                         "LogisticRegression(class_weight='balanced', C=1.0) on the training "
                         "works' passages")
    return figures


def majority_baseline(split: Split) -> dict:
    counts = {g: split.train_labels.count(g) for g in GENRES}
    majority = max(counts, key=counts.get)
    keep = [label for label in split.val_labels if label]
    figures = classification_figures(keep, [majority] * len(keep))
    figures["method"] = f"always {majority!r}, the most common label of the training passages"
    return figures


SAMPLE_EVERY = 8  # the sample a test can recompute in seconds: every 8th held-out passage


def sample_report(model, split: Split) -> dict:
    """The held-out figures on every SAMPLE_EVERY-th passage (the tests recompute these)."""
    sample = every_nth(split, SAMPLE_EVERY)
    out = {"every_nth_passage": SAMPLE_EVERY, "held_out_mlm": mlm_metrics(model, sample.val_rows, split.tokenizer)}
    if model.config.labels:
        out["held_out_genre"] = genre_metrics(model, sample)
    return out


def encoder_report(model, split: Split, *, with_baselines: bool = True) -> dict:
    report = {"held_out_mlm": mlm_metrics(model, split.val_rows, split.tokenizer)}
    if model.config.labels:
        report["held_out_genre"] = genre_metrics(model, split)
        report["held_out_passages_per_genre"] = {
            g: sum(1 for label in split.val_labels if label == g) for g in GENRES}
    report["held_out_sample"] = sample_report(model, split)
    if with_baselines:
        try:
            report["bow_baseline"] = bow_baseline(split)
        except ImportError as e:
            report["bow_baseline"] = {"error": f"scikit-learn is not installed ({e})"}
        report["majority_baseline"] = majority_baseline(split)
    return report


def merge_report(old: dict, new: dict) -> dict:
    """old updated with new, except that a figure new could not compute (an `error`, e.g. the
    bag-of-words baseline without scikit-learn) never replaces the one old recorded."""
    merged = dict(old)
    for key, value in new.items():
        failed = isinstance(value, dict) and "error" in value
        if not (failed and isinstance(old.get(key), dict) and "error" not in old[key]):
            merged[key] = value
    return merged


def refresh_report(ckpt_dir, data_dir="data/shakespeare") -> dict:
    """Recompute a trained encoder checkpoint's held-out figures into its train_report.json."""
    import json
    from pathlib import Path

    from ..checkpoint import REPORT_FILE, load_checkpoint

    ckpt = load_checkpoint(ckpt_dir)
    split = build_split(data_dir, ckpt.tokenizer, ckpt.config.context_length)
    report = merge_report(ckpt.report or {}, encoder_report(ckpt.model, split))
    path = Path(ckpt_dir) / REPORT_FILE
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report

"""The encoder's held-out figures, measured one way for the training report and the tests.

- masked-LM: the held-out works cut into consecutive [CLS] passage [SEP] rows, masked with a
  fixed seed (15%, 80/10/10); loss (nats) and top-1 accuracy over the masked positions.
- genre: the same held-out passages (every held-out work is in the Folio's Catalogue),
  accuracy, balanced accuracy (mean per-class recall) and the confusion matrix.
- fill-mask on common words: every FILL_MASK_STRIDE-th occurrence, in the held-out works, of
  a word among the COMMON_WORDS most frequent there, masked alone with CONTEXT_WORDS words of
  its own work on each side (`common_word_examples`); top-1 = the model's best ordinary token
  is the word's own token. The baseline of the same examples always answers the word most
  often masked in the same way in the training works.
- baselines on the same split: a bag-of-words logistic regression trained on the training
  works' passages (their text, the same token windows) and the majority class of those.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attnlens.model.data.genres import GENRES
from attnlens.model.data.mlm import IGNORE, mask_tokens, word_edges
from attnlens.model.data.passages import fixed_passages, frame, load_works, pad_rows, special_id, tokenize_works
from attnlens.model.tokenizer import Tokenizer

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
    data_dir: object = None  # where the works are (the fill-mask examples are cut from them)


def build_split(data_dir, tokenizer: Tokenizer, context_length: int) -> Split:
    works = load_works(data_dir)
    length = context_length - 2
    val = tokenize_works(tokenizer, [w for w in works if w.split == "val"])
    train = tokenize_works(tokenizer, [w for w in works if w.split == "train" and w.genre])
    val_ids, val_owner = fixed_passages(val, length)
    train_ids, train_owner = fixed_passages(train, length)
    train_labels = []
    for k in train_owner:
        genre = train[k].genre
        assert genre is not None  # `train` holds only the catalogued works (w.genre above)
        train_labels.append(genre)
    return Split(frame(val_ids, tokenizer), [val[k].genre for k in val_owner],
                 frame(train_ids, tokenizer), train_labels, tokenizer, data_dir)


def every_nth(split: Split, n: int) -> Split:
    """A deterministic sample of the held-out rows (for quick evaluations and tests)."""
    return Split(split.val_rows[::n], split.val_labels[::n], split.train_rows, split.train_labels,
                 split.tokenizer, split.data_dir)


@torch.no_grad()
def mlm_metrics(model, rows: torch.Tensor, tokenizer: Tokenizer, mask_prob: float = 0.15) -> dict:
    model.eval()
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(EVAL_MASK_SEED)
    mask_id = special_id(tokenizer.mask_id, "[MASK]")
    inputs, labels = mask_tokens(rows, mask_id=mask_id, special_ids=tokenizer.special_ids,
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
    out: list[str] = []
    for i in range(0, len(rows), BATCH):
        logits = model(rows[i : i + BATCH].to(device), task="classify").logits
        out.extend(labels[j] for j in logits.argmax(-1).tolist())
    return out


def genre_metrics(model, split: Split) -> dict:
    keep = [i for i, label in enumerate(split.val_labels) if label]
    rows = split.val_rows[keep]
    true = [label for label in split.val_labels if label]  # the labels of `keep`, in order
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
    figures = classification_figures([label for label in split.val_labels if label], pred)  # those of `keep`
    figures["method"] = ("sklearn TfidfVectorizer(lowercase, sublinear_tf, min_df=2) + "
                         "LogisticRegression(class_weight='balanced', C=1.0) on the training "
                         "works' passages")
    return figures


def majority_baseline(split: Split) -> dict:
    counts = {g: split.train_labels.count(g) for g in GENRES}
    majority = max(counts, key=counts.__getitem__)
    keep = [label for label in split.val_labels if label]
    figures = classification_figures(keep, [majority] * len(keep))
    figures["method"] = f"always {majority!r}, the most common label of the training passages"
    return figures


# --- fill-mask on common words ---------------------------------------------------------------
COMMON_WORDS = 200
CONTEXT_WORDS = 25
FILL_MASK_STRIDE = 16  # every 16th occurrence of a common word: about 3,600 examples
_WORD = re.compile(r"[A-Za-z]+")


def common_words(texts: list[str], n: int = COMMON_WORDS) -> list[str]:
    """The n most frequent words (runs of letters, lower-cased) of the texts."""
    counts = Counter(w.lower() for text in texts for w in _WORD.findall(text))
    return [w for w, _ in counts.most_common(n)]


@dataclass
class FillMaskExamples:
    rows: list[list[int]]  # [CLS] context [MASK] context [SEP], token ids
    mask_at: list[int]  # position of [MASK] in each row
    answers: list[int]  # the token the mask hides
    words: list[str]  # that token's word, lower-cased


def common_word_examples(tokenizer: Tokenizer, texts: list[str], words: list[str], *,
                         stride: int = FILL_MASK_STRIDE, context_words: int = CONTEXT_WORDS,
                         max_tokens: int = 128) -> FillMaskExamples:
    """Every `stride`-th occurrence of one of `words` in `texts`, masked alone in context.

    An occurrence is a token that is a whole word: letters only after an optional leading
    space, and neither continuing the token before it nor continued by the one after
    (model/data/mlm.py's word_edges). [MASK] replaces the token with its space, as the text
    "... art thou [MASK]?" does. Context: the tokens from the start of the `context_words`-th
    word before to the end of the `context_words`-th word after, within the same work, cut
    evenly on both sides if the row would exceed `max_tokens`.
    """
    wanted = set(words)
    cls_id, mask_id, sep_id = (special_id(tokenizer.cls_id, "[CLS]"), special_id(tokenizer.mask_id, "[MASK]"),
                               special_id(tokenizer.sep_id, "[SEP]"))
    starts_letter, ends_letter = word_edges(tokenizer, tokenizer.vocab_size)
    begins = torch.tensor([i not in tokenizer.special_ids and tokenizer.token_bytes(i).lstrip(b" ")[:1].isalpha()
                           for i in range(tokenizer.vocab_size)])  # a letter after optional spaces
    out = FillMaskExamples([], [], [], [])
    seen = 0
    for ids in tokenizer.encode_batch(texts):
        t = torch.tensor(ids)
        n = len(ids)
        cont = torch.zeros(n, dtype=torch.bool)  # token i continues the word of token i-1
        cont[1:] = starts_letter[t[1:]] & ends_letter[t[:-1]]
        word_start = begins[t] & ~cont  # the first token of each word
        start_positions = word_start.nonzero().flatten().tolist()
        index_of = {p: k for k, p in enumerate(start_positions)}
        for p in start_positions:
            if p + 1 < n and cont[p + 1]:
                continue  # the word goes on in the next token: not a whole-word token
            text = tokenizer.token_bytes(ids[p]).decode("utf-8", errors="replace")
            word = text.strip().lower()
            if not (word.isalpha() and word.isascii() and text.lstrip(" ") == text.strip()) or word not in wanted:
                continue
            seen += 1
            if (seen - 1) % stride:
                continue
            k = index_of[p]
            left = start_positions[max(0, k - context_words)]
            right_word = k + context_words + 1  # the word after the last context word
            right = start_positions[right_word] if right_word < len(start_positions) else n
            before, after = ids[left:p], ids[p + 1 : right]
            room = max_tokens - 3  # [CLS], [MASK], [SEP]
            while len(before) + len(after) > room:
                if len(before) >= len(after):
                    before = before[1:]
                else:
                    after = after[:-1]
            out.rows.append([cls_id, *before, mask_id, *after, sep_id])
            out.mask_at.append(1 + len(before))
            out.answers.append(ids[p])
            out.words.append(word)
    return out


@torch.no_grad()
def fill_mask_top1(model, tokenizer: Tokenizer, examples: FillMaskExamples) -> dict:
    """Top-1 accuracy of the masked LM on the examples (special tokens are never an answer)."""
    model.eval()
    device = next(model.parameters()).device
    special = sorted(tokenizer.special_ids)
    pad_id = special_id(tokenizer.pad_id, "[PAD]")
    correct, in_top5, per_word = 0, 0, Counter[str]()
    for i in range(0, len(examples.rows), BATCH):
        rows = examples.rows[i : i + BATCH]
        ids, mask = pad_rows(rows, pad_id)
        hidden = model(ids.to(device), attention_mask=mask.to(device), task="hidden").logits
        at = torch.tensor(examples.mask_at[i : i + BATCH], device=device)
        logits = model.mlm_logits(hidden[torch.arange(len(rows), device=device), at]).float()  # (b, V)
        logits = logits[:, : tokenizer.vocab_size]
        logits[:, special] = float("-inf")
        five = logits.topk(5, dim=-1).indices.cpu().tolist()
        for top, answer, word in zip(five, examples.answers[i : i + BATCH], examples.words[i : i + BATCH]):
            correct += top[0] == answer
            in_top5 += answer in top
            per_word[word] += top[0] == answer
    return {"top1": correct / max(1, len(examples.rows)), "top5": in_top5 / max(1, len(examples.rows)),
            "examples": len(examples.rows),
            "most_often_right": [w for w, k in per_word.most_common(10) if k]}


def most_frequent_answer_top1(train_examples: FillMaskExamples, examples: FillMaskExamples) -> dict:
    """The baseline: always the token most often masked in the training works' examples."""
    answer = Counter(train_examples.answers).most_common(1)[0][0]
    hits = sum(a == answer for a in examples.answers)
    return {"top1": hits / max(1, len(examples.answers)), "examples": len(examples.answers), "answer_id": answer,
            "method": "always the token most often masked among the training works' examples of the same kind"}


def fill_mask_split(data_dir, tokenizer: Tokenizer, max_tokens: int, every: int = 1, *, with_train: bool = True):
    """(held-out examples (every `every`-th), training-works examples or None, the common words)."""
    works = load_works(data_dir)
    val = [w.text for w in works if w.split == "val"]
    words = common_words(val)
    held_out = common_word_examples(tokenizer, val, words, max_tokens=max_tokens)
    if every > 1:
        held_out = FillMaskExamples(held_out.rows[::every], held_out.mask_at[::every],
                                    held_out.answers[::every], held_out.words[::every])
    train = common_word_examples(tokenizer, [w.text for w in works if w.split == "train"], words,
                                 stride=FILL_MASK_STRIDE * 4, max_tokens=max_tokens) if with_train else None
    return held_out, train, words


def fill_mask_report(model, tokenizer: Tokenizer, data_dir, *, every: int = 1, with_baseline: bool = True) -> dict:
    held_out, train, words = fill_mask_split(data_dir, tokenizer, model.config.context_length, every,
                                             with_train=with_baseline)
    figures = fill_mask_top1(model, tokenizer, held_out)
    figures.update(common_words=len(words), context_words=CONTEXT_WORDS, every_nth_occurrence=FILL_MASK_STRIDE * every)
    if with_baseline:
        figures["baseline"] = most_frequent_answer_top1(train, held_out)
    return figures


SAMPLE_EVERY = 8  # the sample a test can recompute in seconds: every 8th held-out passage


def sample_report(model, split: Split) -> dict:
    """The held-out figures on every SAMPLE_EVERY-th passage (the tests recompute these)."""
    sample = every_nth(split, SAMPLE_EVERY)
    out = {"every_nth_passage": SAMPLE_EVERY, "held_out_mlm": mlm_metrics(model, sample.val_rows, split.tokenizer)}
    if split.data_dir is not None:
        out["fill_mask_common_words"] = fill_mask_report(model, split.tokenizer, split.data_dir, every=SAMPLE_EVERY,
                                                        with_baseline=False)
    if model.config.labels:
        out["held_out_genre"] = genre_metrics(model, sample)
    return out


def encoder_report(model, split: Split, *, with_baselines: bool = True) -> dict:
    report = {"held_out_mlm": mlm_metrics(model, split.val_rows, split.tokenizer)}
    if split.data_dir is not None:
        report["fill_mask_common_words"] = fill_mask_report(model, split.tokenizer, split.data_dir)
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

    from attnlens.model.checkpoint import REPORT_FILE, load_checkpoint

    ckpt = load_checkpoint(ckpt_dir)
    split = build_split(data_dir, ckpt.tokenizer, ckpt.config.context_length)
    report = merge_report(ckpt.report or {}, encoder_report(ckpt.model, split))
    path = Path(ckpt_dir) / REPORT_FILE
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


# --- what an encoder's heads scored, from its reports ----------------------------------------
FILL_MASK_GOAL = 0.30  # held-out top-1 on common words under which the page calls the head weak


def head_figures(ckpt_dir) -> dict[str, dict]:
    """Each head's held-out figure from the reports beside the weights (`mlm_report.json` and
    `genre_report.json` of heads trained by model/training/encoder_heads.py, else the training's
    `train_report.json`): {"fill-mask": {...}, "classify": {...}}, each with `figure`, `value`,
    `baseline` (or None) and `weak` (fill-mask: top-1 under FILL_MASK_GOAL; classify: not above
    the bag-of-words baseline on the same passages). A head without a report is left out."""
    import json
    from pathlib import Path

    def read(name: str) -> dict:
        try:
            return json.loads((Path(ckpt_dir) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    trained = read("train_report.json")
    mlm, genre = read("mlm_report.json") or trained, read("genre_report.json") or trained
    out = {}
    if "top1" in (fill := mlm.get("fill_mask_common_words") or {}):
        out["fill-mask"] = {"figure": "held-out top-1 on common words", "value": fill["top1"], "baseline": None,
                            "weak": fill["top1"] < FILL_MASK_GOAL}
    if "balanced_accuracy" in (held := genre.get("held_out_genre") or {}):
        bow = (genre.get("bow_baseline") or {}).get("balanced_accuracy")
        out["classify"] = {"figure": "held-out balanced accuracy",
                           "value": held["balanced_accuracy"], "baseline": bow,
                           "weak": bow is not None and held["balanced_accuracy"] <= bow}
    return out

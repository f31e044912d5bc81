"""The decoder's held-out figures, measured one way for the training report and the tests.

- **bits per byte** on the held-out works: the works' token stream (each work followed by
  EOS) cut into consecutive, non-overlapping windows of the model's context, every token
  scored (the same windows as `train.evaluate`); nats / ln 2 / UTF-8 bytes of the scored
  tokens, so the figure does not depend on the tokenizer. The sample a test recomputes is
  every SAMPLE_EVERY-th window.
- **induction heads**, by TransformerLens's definitions (`head_detector.py`: `detect_head`
  with `error_measure="mul"`, `exclude_bos=False`, `exclude_current_token=False`): on a
  sequence of BOS (our `<|endoftext|>`) followed by 50 random tokens repeated twice, a head's
  score is the share of its attention, summed over every query row, that falls on the
  detection pattern. The induction pattern marks, for each query, the key right after each
  earlier occurrence of the query's token; the previous-token pattern the key just before;
  the duplicate-token pattern every earlier occurrence. A row sums to 1 and only the 50
  second-copy rows (of 101) can score, so a perfect induction head scores about 0.5. Scores
  are averaged over N_SEQUENCES sequences (detect_head with a list of prompts averages so).
- **in-context copying** on the same sequences: the mean loss (nats) on the 50 tokens of the
  first copy and on the 50 of the second.
- **names whole**: tokens per form of each name of model/data/names.py.
- **baselines**, measured by the same functions: a unigram model of the training tokens
  (add-one smoothed) for bits per byte; for induction, the score of a head that attends
  uniformly to every position it can see; for copying, the unigram model's loss on the two
  copies (it cannot copy); and, when given, another checkpoint's figures (the report holds
  the previous bundled model's).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlens.model.analysis.head_scores import PATTERNS, induction_pattern, mul_score
from attnlens.model.analysis.head_scores import repeated_random_tokens as _repeated_random_tokens
from attnlens.model.data.names import name_forms, names
from attnlens.model.data.shakespeare import load_split

LN2 = math.log(2.0)
SAMPLE_EVERY = 8  # the windows a test recomputes: every 8th held-out window
INDUCTION_SEED = 20230
N_SEQUENCES = 20
REPEAT_TOKENS = 50
BATCH = 16


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Each work's tokens followed by EOS, as one (N,) stream (train.encode_corpus's layout)."""
    ids: list[int] = []
    for encoded in tokenizer.encode_batch(texts):
        ids.extend(encoded)
        ids.append(tokenizer.eos_id)
    return torch.tensor(ids, dtype=torch.long)


def byte_lengths(tokenizer, size: int) -> torch.Tensor:
    """(size,) UTF-8 bytes of each token id; EOS and ids past the tokenizer count 0."""
    lengths = torch.zeros(size, dtype=torch.float64)
    for i in range(tokenizer.vocab_size):
        lengths[i] = 0 if i == tokenizer.eos_id else len(tokenizer.token_bytes(i))
    return lengths


def windows(stream: torch.Tensor, block: int, every: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) of the consecutive windows 0, every, 2*every, ... of `block` tokens."""
    n = (len(stream) - 1) // block
    return [(stream[i * block : (i + 1) * block], stream[i * block + 1 : (i + 1) * block + 1])
            for i in range(0, n, every)]


@torch.no_grad()
def bits_per_byte(model, tokenizer, stream: torch.Tensor, *, every: int = 1) -> dict:
    """Held-out loss (nats / token) and bits per byte over the windows of the model's context."""
    model.eval()
    device = next(model.parameters()).device
    lengths = byte_lengths(tokenizer, model.config.vocab_size)
    pairs = windows(stream, model.config.context_length, every)
    nats, tokens, n_bytes = 0.0, 0, 0.0
    for i in range(0, len(pairs), BATCH):
        x = torch.stack([p[0] for p in pairs[i : i + BATCH]]).to(device)
        y = torch.stack([p[1] for p in pairs[i : i + BATCH]])
        logits = model(x).logits.float().flatten(0, 1).cpu()
        nats += float(F.cross_entropy(logits, y.flatten(), reduction="sum"))
        tokens += y.numel()
        n_bytes += float(lengths[y.flatten()].sum())
    return {"loss": nats / tokens, "bits_per_byte": nats / LN2 / n_bytes, "tokens": tokens,
            "bytes": int(n_bytes), "windows": len(pairs), "every_nth_window": every}


def unigram_bits_per_byte(tokenizer, train_stream: torch.Tensor, stream: torch.Tensor) -> dict:
    """The same figure for add-one-smoothed token frequencies of the training stream."""
    size = tokenizer.vocab_size
    counts = torch.bincount(train_stream, minlength=size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    targets = stream[1:]  # every token after the first
    lengths = byte_lengths(tokenizer, size)
    nats = float(-logp[targets].sum())
    return {"loss": nats / len(targets), "bits_per_byte": nats / LN2 / float(lengths[targets].sum()),
            "method": "add-one-smoothed token frequencies of the training works, no context"}


# --- induction: TransformerLens's head_detector definitions (model/analysis/head_scores.py) -----------
def repeated_random_tokens(tokenizer, n: int = N_SEQUENCES, length: int = REPEAT_TOKENS,
                           seed: int = INDUCTION_SEED) -> torch.Tensor:
    """(n, 1 + 2*length): BOS, then `length` random ordinary tokens, then the same again."""
    return _repeated_random_tokens(tokenizer, n, length, seed)


@torch.no_grad()
def head_scores_and_copying(model, sequences: torch.Tensor) -> dict:
    """Per-head scores ([layer][head], averaged over sequences) for each pattern, and the
    copying losses on the sequences' first and second copies."""
    model.eval()
    device = next(model.parameters()).device
    out = model(sequences.to(device), return_attention=True)
    attn = torch.stack([a.float().cpu() for a in out.attentions], dim=1)  # (N, L, H, T, T)
    scores = {}
    for name, make in PATTERNS.items():
        per_seq = torch.stack([mul_score(attn[i], make(sequences[i])) for i in range(len(sequences))])
        scores[name] = per_seq.mean(0)  # (L, H)
    n = (sequences.shape[1] - 1) // 2
    nll = F.cross_entropy(out.logits.float().cpu()[:, :-1].flatten(0, 1), sequences[:, 1:].flatten(),
                          reduction="none").view(len(sequences), -1)  # (N, T-1): target t+1
    return {"scores": scores, "first_copy_loss": float(nll[:, :n].mean()),
            "second_copy_loss": float(nll[:, n:].mean())}


def uniform_attention_score(sequences: torch.Tensor) -> float:
    """The induction score of a head that spreads each query evenly over every key it sees."""
    T = sequences.shape[1]
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    return float(torch.stack([mul_score(uniform, induction_pattern(s)) for s in sequences]).mean())


def induction_report(model, tokenizer, *, n: int = N_SEQUENCES, seed: int = INDUCTION_SEED) -> dict:
    sequences = repeated_random_tokens(tokenizer, n, REPEAT_TOKENS, seed)
    found = head_scores_and_copying(model, sequences)
    scores = found["scores"]
    best = {}
    for name, s in scores.items():
        flat = int(s.flatten().argmax())
        best[name] = {"layer": flat // s.shape[1], "head": flat % s.shape[1], "score": float(s.flatten()[flat])}
    first, second = found["first_copy_loss"], found["second_copy_loss"]
    return {
        "sequences": n, "seed": seed, "random_tokens": REPEAT_TOKENS,
        "definition": "TransformerLens head_detector.detect_head, error_measure='mul', BOS + 50 random "
                      "tokens repeated twice, scores averaged over the sequences",
        "best": best,
        "scores": {name: [[round(float(v), 4) for v in row] for row in s] for name, s in scores.items()},
        "first_copy_loss": first, "second_copy_loss": second, "second_over_first": second / first,
        "uniform_attention_induction_score": uniform_attention_score(sequences),
    }


def names_report(tokenizer) -> dict:
    counts = {form: len(tokenizer.encode(form)) for name in names() for form in name_forms(name)}
    return {"names": len(names()), "forms": len(counts), "max_tokens": max(counts.values()),
            "over_2_tokens": sorted(f for f, c in counts.items() if c > 2),
            "examples": {f: counts[f] for f in ("JULIET", "ROMEO", "SIR TOBY", " Juliet", "Coriolanus")}}


# --- the report ----------------------------------------------------------------------------
def decoder_figures(model, tokenizer, data_dir="data/shakespeare", *, every: int = 1) -> dict:
    """Every figure the report gives for one model (held-out bits per byte over every
    `every`-th window, induction and copying, names)."""
    val = token_stream(tokenizer, load_split(data_dir, "val"))
    return {"held_out": bits_per_byte(model, tokenizer, val, every=every),
            "induction": induction_report(model, tokenizer),
            "names_whole": names_report(tokenizer)}


def decoder_report(model, tokenizer, data_dir="data/shakespeare") -> dict:
    """The figures on every held-out window and on the sample the tests recompute, and the
    baselines of the same functions."""
    val = token_stream(tokenizer, load_split(data_dir, "val"))
    train = token_stream(tokenizer, load_split(data_dir, "train"))
    figures = decoder_figures(model, tokenizer, data_dir)
    sample = bits_per_byte(model, tokenizer, val, every=SAMPLE_EVERY)
    unigram = unigram_bits_per_byte(tokenizer, train, val)
    sequences = repeated_random_tokens(tokenizer)
    counts = torch.bincount(train, minlength=tokenizer.vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    n = REPEAT_TOKENS
    return {
        **figures,
        "held_out_sample": sample,
        "baselines": {
            "unigram": {**unigram,
                        "first_copy_loss": float(-logp[sequences[:, 1 : n + 1]].mean()),
                        "second_copy_loss": float(-logp[sequences[:, n + 1 :]].mean())},
            "uniform_attention_induction_score": figures["induction"]["uniform_attention_induction_score"],
        },
    }


def refresh_report(ckpt_dir, data_dir="data/shakespeare", *, previous: str | None = None) -> dict:
    """Recompute a decoder checkpoint's figures into its train_report.json; with `previous`
    (another decoder checkpoint), that model's figures by the same functions as a baseline."""
    from attnlens.model.checkpoint import REPORT_FILE, load_checkpoint

    ckpt = load_checkpoint(ckpt_dir)
    saved = ckpt.report or {}
    report = dict(saved)
    figures = decoder_report(ckpt.model, ckpt.tokenizer, data_dir)
    report.update(figures)
    report["val_bits_per_byte"] = figures["held_out"]["bits_per_byte"]
    report["final_val_loss"] = figures["held_out"]["loss"]
    report["val_tokens"] = figures["held_out"]["tokens"]
    if previous:
        old = load_checkpoint(previous)
        report["baselines"]["previous_default"] = {
            "checkpoint": str(previous), **decoder_figures(old.model, old.tokenizer, data_dir)}
    elif "previous_default" in saved.get("baselines", {}):
        report["baselines"]["previous_default"] = saved["baselines"]["previous_default"]
    path = Path(ckpt_dir) / REPORT_FILE
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Recompute a decoder checkpoint's held-out figures.")
    parser.add_argument("checkpoint")
    parser.add_argument("--data", default="data/shakespeare")
    parser.add_argument("--previous", help="another decoder checkpoint to measure as a baseline")
    args = parser.parse_args()
    rep = refresh_report(args.checkpoint, args.data, previous=args.previous)
    print(json.dumps({k: rep[k] for k in ("held_out", "held_out_sample", "names_whole")}, indent=2))
    print(json.dumps({k: v for k, v in rep["induction"].items() if k != "scores"}, indent=2))
    print(json.dumps(rep["baselines"], indent=2)[:3000])

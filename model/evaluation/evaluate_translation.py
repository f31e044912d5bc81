"""`python -m attnlens.model.evaluation.evaluate_translation CHECKPOINT`: greedy exact match of a translator on EVERY
held-out pair (not a sample), written into its train_report.json as "held_out_all".

Slow (it formats all 219,147 dates and 1,000,000 numbers to find the held-out ones, then
decodes about 122,000 pairs): minutes on one CPU thread. The training report's own figures
come from a fixed sample (model/training/train_translation.py) that the tests recompute.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attnlens.model.checkpoint import REPORT_FILE, load_checkpoint
from attnlens.model.data.translation_pairs import KINDS, all_held_out
from attnlens.model.families.encoder_decoder import greedy_translate


def evaluate_all(ckpt_dir: str | Path, batch_size: int = 512, n_mistakes: int = 25) -> dict:
    ckpt = load_checkpoint(ckpt_dir)
    result = {}
    for kind in KINDS:
        t0 = time.perf_counter()
        pairs = all_held_out(kind)
        got: list[str] = []
        for first in tqdm(range(0, len(pairs), batch_size), desc=f"held-out {kind}s", unit="batch"):
            chunk = pairs[first:first + batch_size]
            got.extend(greedy_translate(ckpt.model, ckpt.tokenizer, [p.source for p in chunk], batch_size))
        mistakes = [{"source": p.source, "expected": p.target, "got": g} for p, g in zip(pairs, got) if g != p.target]
        result[f"{kind}s"] = {"n": len(pairs), "correct": len(pairs) - len(mistakes),
                              "exact_match": (len(pairs) - len(mistakes)) / len(pairs),
                              "mistakes": mistakes[:n_mistakes], "seconds": round(time.perf_counter() - t0, 1)}
    return result


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    path = Path(args[0])
    result = evaluate_all(path)
    report_path = path / REPORT_FILE
    report = json.loads(report_path.read_text(encoding="utf-8"))
    report["held_out_all"] = result
    report_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: {x: v[x] for x in ("n", "correct", "exact_match")} for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

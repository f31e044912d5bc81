"""Write the two small held-out Shakespeare tasks for lm-evaluation-harness (deterministic).

    python examples/lm_eval/make_data.py        # from the repo root; rewrites the .jsonl files

next_line.jsonl: a speech's opening verse line, and which of four lines of the same held-out
play follows it (multiple choice: loglikelihood requests). passages.jsonl: passages of the
held-out plays for bits per byte (loglikelihood_rolling requests).
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def held_out_texts() -> dict[str, str]:
    data = ROOT / "data" / "shakespeare"
    manifest = json.loads((data / "manifest.json").read_text())
    return {w["name"]: gzip.open(data / w["file"], "rt", encoding="utf-8").read()
            for w in manifest["works"] if w["split"] == "val"}


def verse_pairs(text: str) -> list[tuple[str, str]]:
    """(line, next line) inside speeches: both long enough, neither a speaker or a stage direction."""
    lines = text.split("\n")
    ok = lambda s: len(s) > 25 and not s.isupper() and not s.startswith("[")  # noqa: E731
    return [(a, b) for a, b in zip(lines, lines[1:]) if ok(a) and ok(b)]


def main() -> None:
    rng = random.Random(11)
    texts = held_out_texts()
    items = []
    for name, text in texts.items():
        pairs = verse_pairs(text)
        for a, b in rng.sample(pairs, 10):
            others = rng.sample([p[1] for p in pairs if p[1] != b], 3)
            gold = rng.randrange(4)
            choices = others[:gold] + [b] + others[gold:]
            items.append({"play": name, "context": a, "choices": choices, "gold": gold})
    with open(HERE / "next_line.jsonl", "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    with open(HERE / "passages.jsonl", "w", encoding="utf-8") as f:
        for name, text in texts.items():
            start = len(text) // 2
            start = text.index("\n\n", start) + 2
            f.write(json.dumps({"play": name, "text": text[start:start + 3000]}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

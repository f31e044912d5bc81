"""A stream decoding beside a long analysis, on the real server (issue 50): the longest wait between
its tokens while an 8k overview, a lens over every position or a patching run of every head goes on,
and what the stream costs the analysis.

    .venv/bin/python bench/bench_stream_gaps.py                   # the packaged SmolLM2, 2 threads
    .venv/bin/python bench/bench_stream_gaps.py --tokens 2048 --lens-tokens 256

Starts `attnlens serve` (tests/live_server.py) on the packaged SmolLM2 with OMP_NUM_THREADS=--threads.
Per analysis, in turns: the analysis alone (wall time of the whole request), then again with one
sampled stream of `/generate` beside it, started first and still decoding when the analysis ends;
the stream's gaps are those between its token events while the analysis runs. Goals: no gap over
0.25 s, and the analysis beside the stream within 1.2x its time alone.

    overview   POST /attention, --tokens ids, every layer and head pooled to 64 x 64 (u8)
    lens       POST /lens, --lens-tokens ids, every position
    patching   POST /patch, an IOI pair, component heads (every head of every layer)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))

from live_server import live_server  # noqa: E402

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


def analyses(tokens: int, lens_tokens: int, vocab: int) -> dict[str, tuple[str, dict]]:
    """name -> (route, body) of each analysis."""
    ids = [(i * 7919) % (vocab - 200) + 100 for i in range(tokens)]  # ordinary tokens, no specials
    return {
        "overview": ("/attention", {"ids": ids, "pool": 64, "format": "u8"}),
        "lens": ("/lens", {"ids": ids[:lens_tokens], "top_k": 1}),
        "patching": ("/patch", {"clean": CLEAN, "corrupted": CORRUPTED, "answer": " Mary", "foil": " John",
                                "component": "heads"}),
    }


def timed_request(base: str, route: str, body: dict) -> float:
    t0 = time.perf_counter()
    r = httpx.post(base + route, json=body, timeout=1800)
    r.raise_for_status()
    return time.perf_counter() - t0


class Stream(threading.Thread):
    """One sampled /generate stream; `arrivals` the monotonic time of each token event."""

    def __init__(self, base: str, new_tokens: int):
        super().__init__(daemon=True)
        self.base, self.new_tokens = base, new_tokens
        self.arrivals: list[float] = []
        self.error: str | None = None

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_new_tokens": self.new_tokens, "stream": True,
                "temperature": 1.0, "seed": 1}
        try:
            with httpx.stream("POST", self.base + "/generate", json=body, timeout=1800) as r:
                for line in r.iter_lines():
                    if line.startswith("event: token"):
                        self.arrivals.append(time.perf_counter())
        except httpx.HTTPError as e:
            self.error = repr(e)


def beside_stream(base: str, route: str, body: dict, new_tokens: int) -> tuple[float, list[float], bool]:
    """The analysis's wall time with a stream decoding beside it, the stream's gaps (s) during it, and
    whether the stream outlived it."""
    stream = Stream(base, new_tokens)
    stream.start()
    while len(stream.arrivals) < 5:  # decoding, past its prefill
        if not stream.is_alive():
            raise RuntimeError(f"the stream ended early: {stream.error}")
        time.sleep(0.01)
    t0 = time.perf_counter()
    seconds = timed_request(base, route, body)
    t1 = t0 + seconds
    stream.join()
    during = [t for t in stream.arrivals if t0 <= t <= t1]
    before = [t for t in stream.arrivals if t < t0][-1:]
    after = [t for t in stream.arrivals if t > t1][:1]
    marks = before + during + after  # the gaps that overlap the analysis
    return seconds, [b - a for a, b in zip(marks, marks[1:])], bool(after)  # a token came after it: outlived


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="the overview's prompt length")
    p.add_argument("--lens-tokens", type=int, default=512, help="the lens's prompt length (every position)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=2000, help="the stream's length (must outlive each analysis)")
    p.add_argument("--only", nargs="*", help="analyses to run (default: all)")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args()

    from attnlens.model.interop.packaged import SMOLLM2, ensure_checkpoint

    model_dir = ensure_checkpoint(SMOLLM2, progress=False)
    env = {"OMP_NUM_THREADS": str(args.threads), "ATTNLENS_MAX_NEW_TOKENS": str(args.new_tokens),
           "ATTNLENS_MAX_ANSWER_BYTES": str(1 << 30)}
    print(f"load before: {os.getloadavg()[0]:.2f}")
    rows = []
    with tempfile.TemporaryDirectory() as logs, live_server(model_dir, Path(logs), env=env, timeout=300) as server:
        base = server.base_url
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        for name, (route, body) in analyses(args.tokens, args.lens_tokens, vocab).items():
            if args.only and name not in args.only:
                continue
            timed_request(base, route, body)  # warm-up
            alone = timed_request(base, route, body)
            beside, gaps, outlived = beside_stream(base, route, body, args.new_tokens)
            gaps_ms = sorted(g * 1000 for g in gaps)
            row = {"analysis": name, "alone_s": round(alone, 2), "beside_s": round(beside, 2),
                   "ratio": round(beside / alone, 2), "tokens_during": len(gaps) - 1,
                   "gap_median_ms": round(statistics.median(gaps_ms), 1),
                   "gap_p99_ms": round(gaps_ms[min(len(gaps_ms) - 1, int(0.99 * len(gaps_ms)))], 1),
                   "gap_max_ms": round(gaps_ms[-1], 1), "stream_outlived": outlived}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(f"\n{'analysis':<10}{'alone s':>9}{'beside s':>10}{'ratio':>7}{'tokens':>8}{'gap p50':>9}{'p99':>7}"
          f"{'max ms':>8}")
    for r in rows:
        print(f"{r['analysis']:<10}{r['alone_s']:>9}{r['beside_s']:>10}{r['ratio']:>7}{r['tokens_during']:>8}"
              f"{r['gap_median_ms']:>9}{r['gap_p99_ms']:>7}{r['gap_max_ms']:>8}")
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, "tokens": args.tokens,
                                        "lens_tokens": args.lens_tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

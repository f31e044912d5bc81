"""POST /heads on T tokens (default 256) beside one forward with attention maps, in the same run (CPU).

    .venv/bin/python bench/bench_heads.py                    # checkpoints/default, else a random default-sized model
    .venv/bin/python bench/bench_heads.py --model DIR --threads 1 --reps 9

Cases, taking turns in every repetition (bench_model.paired_ms):

* the peer: one forward with every attention map, `model.analyse(ids)` (what /attention computes);
* /heads' model side: `score_heads` (that forward, then every score of every head, as numpy);
* /heads' work without HTTP: `score_heads` then `atlas_answer` (roles, tokens, definitions);
* POST /heads end to end through the app in this process (TestClient; the model on a worker
  thread, no engine process), beside POST /attention for the same ids, format=f16.

The goal (issue 18): /heads costs at most 2x one forward with attention maps.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import DEFAULT_MODEL, in_process_client, paired_ms, random_checkpoint  # noqa: E402

from attnlens.app.serving.head_atlas import atlas_answer  # noqa: E402
from attnlens.model import family_of, load_checkpoint  # noqa: E402
from attnlens.model.analysis.head_atlas_scores import score_heads  # noqa: E402
from attnlens.model.analysis.head_scores import ordinary_ids  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="attnlens checkpoint (default: checkpoints/default if present)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: CPUs are shared)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-http", action="store_true", help="skip the end-to-end case")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    src = Path(args.model) if args.model else (
        DEFAULT_MODEL if (DEFAULT_MODEL / "model.safetensors").is_file() else random_checkpoint(Path(tmp.name) / "random"))
    ck = load_checkpoint(src)
    model, tok, cfg = ck.model.eval(), ck.tokenizer, ck.config
    family = family_of(model)
    T = min(args.seq_len, cfg.context_length)
    ordinary = ordinary_ids(tok)
    g = torch.Generator().manual_seed(0)
    ids = [tok.eos_id, *ordinary[torch.randint(0, len(ordinary), (T - 1,), generator=g)].tolist()]

    print(f"model     {src}: {family.name}, {cfg.n_layers} layers x {cfg.n_heads} heads, d_model {cfg.d_model}, "
          f"context {cfg.context_length}")
    print(f"runtime   torch {torch.__version__}, {args.threads} thread(s), T={T}, median of {args.reps} after "
          f"{args.warmup} warm-up(s)")
    cases = {
        "forward + attention maps (peer)": lambda: model.analyse(ids),
        "/heads model side (score_heads)": lambda: score_heads(model, ids),
        "/heads work (scores + answer)": lambda: atlas_answer(family, score_heads(model, ids), tok, "m", None),
    }
    if not args.no_http:
        client = in_process_client(src).__enter__()

        def post(path, body):
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text

        cases["POST /heads (in-process app)"] = lambda: post("/heads", {"ids": ids})
        cases["POST /attention f16 (in-process app)"] = lambda: post("/attention", {"ids": ids, "format": "f16"})
    timed = paired_ms(list(cases.values()), warmup=args.warmup, reps=args.reps)
    peer_wall, peer_cpu = timed[0]
    print(f"\n{'case':40s} {'wall ms':>9s} {'cpu ms':>9s} {'x peer (wall)':>14s} {'x peer (cpu)':>13s}")
    for (name, _), (wall, cpu) in zip(cases.items(), timed):
        print(f"{name:40s} {wall:9.1f} {cpu:9.1f} {wall / peer_wall:13.2f}x {cpu / peer_cpu:12.2f}x")
    print("\n(the end-to-end cases' CPU time also counts the app's threads; goal: /heads <= 2x the peer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

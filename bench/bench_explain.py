"""What the explain routes cost beside one forward with attention maps, and what the hooks cost unused.

    .venv/bin/python bench/bench_explain.py                    # checkpoints/default, 256 tokens, 1 thread
    .venv/bin/python bench/bench_explain.py --reps 9 --main-ref main
    .venv/bin/python bench/bench_explain.py --model smollm2 --tokens 40 --part routes   # the packaged SmolLM2

Part 1, on the model's side (what each route's model call runs, model/analysis/explain.py), over T tokens
(default 256, the default model's whole context), beside its peer measured in turns in the same
run: one forward with every layer's and head's attention maps (`model.analyse`, what /attention
runs). The goal (issue 18): each route at most 2x the peer.

    logits           /logits: one forward, top-k and the next token's log-probability at every position
    logits + ablate  /logits with one mean-ablated head: the clean forward, then the ablated one from
                     the first ablated block on (the blocks before it are the clean run's), KL per
                     position; at layer 2 (of 4) and at layer 0 (the whole second forward)
    lens             /lens: one forward keeping every block's residual stream, each through ln_f + the LM head
                     (every position; and the page's request: a window of 16 positions with ranks)
Each is also given as a multiple of a plain prefill (one forward, no maps): the lens's goal on
SmolLM2 (issue 30) is the page's request at most 3x a prefill.
    explain          /attention/explain: one forward keeping one head's q, k, v, pattern and z

Part 2, end to end (--part http): the routes through the app in this process (TestClient; the
model on a worker thread, no engine process), each answer built and serialised, beside POST
/attention for the same ids with every map (format=f16, the page's; u8; and format=json), and the
bare forward with every map in this process (the goal of issue 31: /attention u8 at most 1.7x it).

Part 3, hooks unused: greedy decoding (model.generate_tokens, N new tokens after a 16-token prompt)
and a plain forward over T tokens with this branch's model code against the same code of another
git ref (default `main`, extracted with `git archive` into a temporary folder and imported as a
package of its own, same weights), in turns in the same process.

Medians of process CPU time and wall time (1 thread by default: CPU time is the steady figure on a
shared machine).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import in_process_client, paired_ms  # noqa: E402

from attnlens.model import load_checkpoint  # noqa: E402
from attnlens.model.analysis import explain, vocab_rows  # noqa: E402
from attnlens.model.decoding import SamplingParams, generate_tokens  # noqa: E402
from attnlens.model.families import family_of  # noqa: E402
from attnlens.model.hooks import HeadAblation, ablation_targets, active  # noqa: E402


def turns(cases: dict, warmup: int, reps: int) -> dict[str, tuple[float, float]]:
    """Every case once per repetition, in turns; (median wall ms, median cpu ms) of each."""
    return dict(zip(cases, paired_ms(list(cases.values()), warmup=warmup, reps=reps)))


def main_model_package(ref: str, into: Path):
    """The model/ package of git `ref`, imported as `ref_model` (model/ uses relative imports only)."""
    data = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", ref, "model"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    spec = importlib.util.spec_from_file_location("ref_model", into / "model" / "__init__.py",
                                                  submodule_search_locations=[str(into / "model")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["ref_model"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO_ROOT / "checkpoints" / "default"),
                    help="a checkpoint directory, or a packaged model's name (smollm2)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--main-ref", default="main", help="the git ref whose model code is the decode peer")
    ap.add_argument("--part", choices=["all", "routes", "http", "unused"], default="all")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    args.model = packaged_or_path(args.model)
    ck = load_checkpoint(args.model)
    model = ck.model.eval()
    cfg = model.config
    T = min(args.tokens, cfg.context_length)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (T,), generator=g).tolist()
    edits = ablation_targets(family_of(model), cfg, [HeadAblation(min(2, cfg.n_layers - 1), 2 % cfg.n_heads, "mean")])
    first = ablation_targets(family_of(model), cfg, [HeadAblation(0, 2 % cfg.n_heads, "mean")])
    print(f"model     {args.model.name}: {cfg.n_layers} layers x {cfg.n_heads} heads, d_model {cfg.d_model}, "
          f"vocab {cfg.vocab_size}, context {cfg.context_length}")
    print(f"runtime   torch {torch.__version__}, {args.threads} thread(s), median of {args.reps} after "
          f"{args.warmup} warm-up(s), {T} tokens")

    if args.part in ("all", "routes"):
        routes(model, ids, edits, first, args)
    if args.part in ("all", "http"):
        http(model, ids, args)
    if args.part in ("all", "unused"):
        unused(model, ids, args)


def packaged_or_path(name: str) -> Path:
    from attnlens.model.interop.packaged import PACKAGED, ensure_checkpoint

    packaged = {m.name.lower(): m for m in PACKAGED} | {m.name.lower().split("-")[0]: m for m in PACKAGED}
    if name.lower() in packaged:
        found = ensure_checkpoint(packaged[name.lower()])
        if found is None:
            raise SystemExit(f"{name}: its package is not installed")
        return found
    return Path(name)


def routes(model, ids, edits, first, args) -> None:
    T = len(ids)
    window = list(range(max(0, T - 16), T))

    @torch.inference_mode()
    def prefill():
        model(torch.tensor([ids]))

    cases = {
        "peer: forward + attention maps": lambda: model.analyse(ids),
        "prefill (a forward, no maps)": prefill,
        "logits (top 5, all positions)": lambda: explain.logits_report(model, ids, None, (), 5, False),
        f"logits + 1 mean ablation, layer {edits[0].module.split('.')[1]}":
            lambda: explain.logits_report(model, ids, None, edits, 5, False),
        "logits + 1 mean ablation, layer 0": lambda: explain.logits_report(model, ids, None, first, 5, False),
        "lens (top 5, every position)": lambda: explain.lens_report(model, ids, None, (), 5),
        "lens, torch's statistics (no C kernel)": lambda: lens_by_torch(model, ids),
        f"lens, the page's {len(window)} positions + rank": lambda: explain.lens_report(model, ids, None, (), 5,
                                                                                      window, True),
        "explain (1 head, 1 query)": lambda: explain.explain_head(model, ids, None, family_of(model).primary.name,
                                                                  1, 1, T - 1, ()),
    }
    got = turns(cases, args.warmup, args.reps)
    peer, plain = got["peer: forward + attention maps"], got["prefill (a forward, no maps)"]
    print(f"\n{'case':40s} {'wall ms':>9s} {'cpu ms':>9s} {'x peer (cpu)':>13s} {'x prefill (cpu)':>16s}")
    for name, (w, c) in got.items():
        print(f"{name:40s} {w:9.1f} {c:9.1f} {c / peer[1]:12.2f}x {c / plain[1]:15.2f}x")


def lens_by_torch(model, ids):
    """The lens with its statistics by torch's operations (what runs where the C kernels are not built)."""
    with mock.patch.object(vocab_rows, "native_stats", lambda *a, **k: None):
        return explain.lens_report(model, ids, None, (), 5)


def http(model, ids, args) -> None:
    with in_process_client(args.model) as client:
        def post(path, body):
            def run():
                r = client.post(path, json={"ids": ids, **body})
                assert r.status_code == 200, r.text
            return run

        mean = [{"layer": 2, "head": 2, "how": "mean"}]
        got = turns({"peer: POST /attention f16": post("/attention", {"format": "f16"}),
                     "bare: forward + every map": lambda: model.analyse(ids),
                     "POST /attention u8": post("/attention", {"format": "u8"}),
                     "POST /attention json": post("/attention", {"format": "json"}),
                     "POST /logits": post("/logits", {}),
                     "POST /logits + 1 mean ablation": post("/logits", {"ablate": mean}),
                     "POST /lens": post("/lens", {}),
                     "POST /attention/explain": post("/attention/explain", {"layer": 1, "head": 1,
                                                                             "query": len(ids) - 1})},
                    args.warmup, args.reps)
    peer, bare = got["peer: POST /attention f16"], got["bare: forward + every map"]
    print("\nend to end, in-process app (CPU time counts the app's threads too); `bare` is the model's own")
    print("forward with every map (model.analyse) in this process, what the goal for /attention u8 compares to")
    print(f"{'case':34s} {'wall ms':>9s} {'cpu ms':>9s} {'x peer (wall)':>14s} {'x bare (wall)':>14s}")
    for name, (w, c) in got.items():
        print(f"{name:34s} {w:9.1f} {c:9.1f} {w / peer[0]:13.2f}x {w / bare[0]:13.2f}x")


def unused(model, ids, args) -> None:
    cfg = model.config
    with tempfile.TemporaryDirectory() as tmp:
        ref = main_model_package(args.main_ref, Path(tmp))
        # both built the same way (fresh modules, then the same state dict): same memory layout
        theirs = ref.families.decoder.Transformer(ref.config.ModelConfig(**cfg.__dict__)).eval()
        theirs.load_state_dict(model.state_dict())
        model = type(model)(type(cfg)(**cfg.__dict__)).eval()
        model.load_state_dict(theirs.state_dict())
        prompt = ids[:16]
        greedy = SamplingParams(temperature=0.0)

        def decode(m, gen):
            return lambda: [t.id for t in gen(m, prompt, args.new_tokens, ref_params(gen))]

        def ref_params(gen):
            return greedy if gen is generate_tokens else ref.decoding.SamplingParams(temperature=0.0)

        same = decode(model, generate_tokens)() == decode(theirs, ref.decoding.generate_tokens)()
        inputs = torch.tensor([ids])

        def forward(m):
            def run():
                with torch.inference_mode():
                    m(inputs)
            return run

        # each pair in turns of its own (a forward timed right after a decode runs on colder caches)
        got = turns({"decode, hooks unused (this branch)": decode(model, generate_tokens),
                     f"decode, {args.main_ref} (peer)": decode(theirs, ref.decoding.generate_tokens)},
                    args.warmup, args.reps)
        got |= turns({"forward, hooks unused (this branch)": forward(model),
                      f"forward, {args.main_ref} (peer)": forward(theirs)}, args.warmup, args.reps)
    print(f"\nhooks unused against {args.main_ref}'s model code (same weights; greedy tokens identical: {same})")
    print(f"{'case':38s} {'wall ms':>9s} {'cpu ms':>9s} {'tok/s (cpu)':>12s}")
    for name, (w, c) in got.items():
        rate = f"{args.new_tokens / c * 1e3:12.0f}" if name.startswith("decode") else f"{'':12s}"
        print(f"{name:38s} {w:9.1f} {c:9.1f} {rate}")
    # what the unused hooks add, counted: one context-variable read and a None check per block and
    # per attention module of every forward
    n = 1_000_000
    c0 = time.process_time()
    for _ in range(n):
        if active() is not None:
            pass
    per_check = (time.process_time() - c0) / n
    checks = 2 * cfg.n_layers
    print(f"the unused check: {per_check * 1e9:.0f} ns x {checks} per forward = {per_check * checks * 1e6:.2f} us "
          f"per decode step ({per_check * checks * args.new_tokens * 1e3:.3f} ms over {args.new_tokens} tokens)")


if __name__ == "__main__":
    main()

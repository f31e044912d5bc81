"""What activation patching costs against one forward of the prompt pair and against a loop of hooked
forwards (TransformerLens's way: one whole forward per cell), on the packaged SmolLM2 and the IOI pair.

    .venv/bin/python bench/bench_patching.py                 # 2 threads, 3 rounds
    .venv/bin/python bench/bench_patching.py --threads 1 --rounds 5 --loop-rounds 1
    .venv/bin/python bench/bench_patching.py --packed    # the served default's Q4_1 weights

In turns, each round (model/analysis/patching.py, attribution_patching.py):

    forward            model(pair): the clean and corrupted prompts as one batch of 2, every
                       position's logits (what one forward of the pair costs)
    heads              exact patching of every head's z at every position (270 cells)
    heads_by_position  exact patching of every head's z at each position (3,780 cells)
    residual, layers   resid_pre, attention and MLP outputs at each position
    paths              path patching from L23H3 to every later head's q, k, v
    attribution        attribution patching of every head (one forward of the pair, one backward)
    logit_attribution  direct logit attribution of every head, MLP and the embedding (the clean prompt)
    loop               the heads component as a loop of 270 hooked whole forwards of the corrupted
                       prompt (its z patched through a pre-hook on the output projection)

Medians of wall time and of process CPU time (CPU time is the steadier figure on a shared machine),
each as a multiple of the forward's. The goals (issue 46): heads at most 25x the forward and at
least 10x faster than the loop; heads_by_position at most 150x the forward; attribution and logit attribution at most 3x.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def hooked_loop(model, clean: list[int], corrupted: list[int], answer: int, foil: int) -> list[list[float]]:
    """Every head's z patched by a whole forward of the corrupted prompt each."""
    from attnlens.model.hooks import Hooks, hooked

    c = model.config
    L, H, D = c.n_layers, c.n_heads, c.d_head
    hooks = Hooks(record=lambda name: name.endswith("attn.hook_z"))
    with hooked(model, hooks):
        model(torch.tensor([clean]))
    ids = torch.tensor([corrupted])
    out = []
    for layer in range(L):
        z = hooks.captured[f"blocks.{layer}.attn.hook_z"][0]  # [T, H, D]
        row = []
        for head in range(H):
            def pre(module, args, head=head, z=z):
                x = args[0].clone()
                x[0, :, head * D:(head + 1) * D] = z[:, head]
                return (x,)
            handle = model.blocks[layer].attn.proj.register_forward_pre_hook(pre)
            try:
                logits = model(ids).logits[0, -1]
            finally:
                handle.remove()
            row.append(float(logits[answer] - logits[foil]))
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--packed", action="store_true", help="the served default's packed Q4_1 weights (else float32)")
    parser.add_argument("--loop-rounds", type=int, default=1, help="rounds of the (long) hooked loop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from attnlens.model import load_checkpoint
    from attnlens.model.analysis.attribution_patching import attribution_patch
    from attnlens.model.analysis.logit_attribution import logit_attribution
    from attnlens.model.analysis.patching import patch
    from attnlens.model.interop import packaged
    from attnlens.model.interop.packaged import SMOLLM2

    ck = load_checkpoint(packaged.ensure_checkpoint(SMOLLM2, progress=False), packed=args.packed)
    model, tok = ck.model, ck.tokenizer
    clean, corrupted = tok.encode(CLEAN), tok.encode(CORRUPTED)
    answer, foil = tok.encode(" Mary")[0], tok.encode(" John")[0]
    pair = torch.tensor([clean, corrupted])
    runs = {
        "forward": lambda: model(pair),
        "heads": lambda: patch(model, clean, corrupted, answer, foil, component="heads"),
        "heads_by_position": lambda: patch(model, clean, corrupted, answer, foil, component="heads_by_position"),
        "residual": lambda: patch(model, clean, corrupted, answer, foil, component="residual"),
        "layers": lambda: patch(model, clean, corrupted, answer, foil, component="layers"),
        "paths": lambda: patch(model, clean, corrupted, answer, foil, component="paths", sender=(23, 3)),
        "attribution": lambda: attribution_patch(model, clean, corrupted, answer, foil, component="heads"),
        "logit_attribution": lambda: logit_attribution(model, clean, answer, foil),
        "loop": lambda: hooked_loop(model, clean, corrupted, answer, foil),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    with torch.inference_mode():
        for fn in runs.values():  # warm-up
            if fn is not runs["loop"]:
                fn()
        for r in range(args.rounds):
            for name, fn in runs.items():
                if name == "loop" and r >= args.loop_rounds:
                    continue
                times[name].append(timed(fn))
    base_wall = statistics.median(t[0] for t in times["forward"])
    base_cpu = statistics.median(t[1] for t in times["forward"])
    weights = "packed" if args.packed else "float32"
    print(f"SmolLM2 ({weights}), IOI pair ({len(clean)} tokens), {args.threads} threads, medians of {args.rounds} rounds")
    print(f"{'':18} {'wall ms':>10} {'x fwd':>7} {'cpu ms':>10} {'x fwd':>7}")
    for name, ts in times.items():
        wall, cpu = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
        print(f"{name:18} {wall * 1e3:10.1f} {wall / base_wall:7.1f} {cpu * 1e3:10.1f} {cpu / base_cpu:7.1f}")
    loop_wall = statistics.median(t[0] for t in times["loop"])
    heads_wall = statistics.median(t[0] for t in times["heads"])
    print(f"loop / heads (wall): {loop_wall / heads_wall:.1f}x")


if __name__ == "__main__":
    main()

"""/attention's model call at real length, beside a prefill of the same prompt, in one process,
taking turns (the packaged SmolLM2, or --model):

    .venv/bin/python bench/bench_attention_heads.py                  # 2,048 tokens, 2 threads
    .venv/bin/python bench/bench_attention_heads.py --tokens 8192 --skip-full --reps 1
    .venv/bin/python bench/bench_attention_heads.py --tokens 8192 --skip-full --only pool  # the overview alone

Cases, each the call /attention makes (model/analysis/attention_maps.py): a prefill (the peer: one
forward, the last position's logits); one head's full map (u8, as the page asks); one layer's
every head; every head pooled to --pool bins (the model view's overview); every head's top-8
keys; and, unless --skip-full, the explicit forward that makes every head's map and then picks
one (what /attention ran before the blocks). Each map case runs twice: "fused", the maps reduced
by the forward's own attention kernel (attention_maps.FUSED, the default), and "recomputed",
the forward keeping the asked layers' queries and keys, then the maps recomputed a block of query
rows at a time and reduced (FUSED off: the path before, and the one other devices take). Each
prints wall ms and its ratio to the prefill, the process's CPU seconds and their ratio to the
prefill's (steadier than wall time when other work shares the machine), and the process's peak
RSS growth over the run (Linux: the peak is reset before each case through /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-full", action="store_true", help="skip the every-head explicit forward (8k: 72 GB)")
    p.add_argument("--model", help="a checkpoint directory (default: the packaged SmolLM2)")
    p.add_argument("--pool", type=int, default=64, help="the overview's bins (default 64)")
    p.add_argument("--only", help="run only the cases whose name holds this text (and the prefill)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from attnlens.model import load_checkpoint
    from attnlens.model.analysis import attention_maps
    from attnlens.model.analysis.attention_maps import MapRequest, analyse_attention
    from attnlens.model.interop.packaged import SMOLLM2, ensure_checkpoint

    model = load_checkpoint(args.model or ensure_checkpoint(SMOLLM2, progress=False)).model
    c = model.config
    torch.manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (min(args.tokens, c.context_length),)).tolist()
    layer, head = c.n_layers * 2 // 3, 0
    every_layer, every_head = list(range(c.n_layers)), list(range(c.n_heads))

    def call(layers, heads, want=MapRequest(), fused=True):
        attention_maps.FUSED = fused
        try:
            return analyse_attention(model, ids, layers, heads, want=want, fmt="u8")
        finally:
            attention_maps.FUSED = True

    maps = {
        f"one head's map (L{layer}H{head}, u8)": ([layer], [head], MapRequest()),
        f"layer {layer}'s {c.n_heads} heads (u8)": ([layer], every_head, MapRequest()),
        f"all {c.n_layers * c.n_heads} heads, pool {args.pool}": (every_layer, every_head, MapRequest(pool=args.pool)),
        f"all {c.n_layers * c.n_heads} heads, top_k 8": (every_layer, every_head, MapRequest(top_k=8)),
    }
    cases = {"prefill (the peer)": lambda: model(torch.tensor([ids]), last_only=True)}
    for name, asked in maps.items():
        cases[f"{name}, fused"] = lambda asked=asked: call(*asked)
        cases[f"{name}, recomputed"] = lambda asked=asked: call(*asked, fused=False)
    if not args.skip_full:
        cases["every head made, one picked (before)"] = lambda: model.analyse(ids).maps["self"][layer, head].clone()
    if args.only:
        cases = {name: run for name, run in cases.items() if args.only in name or name == "prefill (the peer)"}
    print(f"model     {c.n_layers} layers x {c.n_heads} heads ({c.kv_heads} KV), {len(ids)} tokens")
    print(f"runtime   torch {torch.__version__}, {args.threads} thread(s), median of {args.reps} after a warm-up")
    print(f"load      {os.getloadavg()[0]:.2f} (1-minute average, at the start)\n")
    print(f"{'case':<52}{'wall ms':>10}{'x prefill':>11}{'cpu s':>8}{'x prefill':>11}{'peak RSS +MB':>14}")
    times: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    peaks: dict[str, float] = {name: 0.0 for name in cases}
    with torch.inference_mode():
        for name, run in cases.items():
            run()  # warm-up
        for _ in range(args.reps):
            for name, run in cases.items():
                base = rss_mb("VmRSS")
                reset_peak()
                t0, c0 = time.perf_counter(), time.process_time()
                out = run()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                peaks[name] = max(peaks[name], rss_mb("VmHWM") - base)
                del out
    prefill, prefill_cpu = statistics.median(times["prefill (the peer)"]), statistics.median(cpu["prefill (the peer)"])
    for name in cases:
        t, c = statistics.median(times[name]), statistics.median(cpu[name])
        print(f"{name:<52}{t * 1000:>10.0f}{t / prefill:>10.2f}x{c:>8.1f}{c / prefill_cpu:>10.2f}x{peaks[name]:>14.0f}")
    print(f"\nload      {os.getloadavg()[0]:.2f} (1-minute average, at the end)")


if __name__ == "__main__":
    main()

"""Where a batch-1 float32 decode step of SmolLM2-135M-Instruct spends its time on the CPU (issue 34).

    .venv/bin/python bench/profile_decode.py                  # 1 thread, 32 greedy tokens
    .venv/bin/python bench/profile_decode.py --threads 2 --new-tokens 64

Decodes greedily with `generate_tokens` (the engine's decode step), first without a profiler
(process CPU time and wall clock per token), then under torch.profiler, and prints per token:

* the weight products (aten::mm / addmm), split by the weight's shape (q|k|v, attention output,
  gate|up, down, the LM head), with the bytes they read and the rate;
* attention over the KV cache (bmm / baddbmm / softmax parts);
* every other operator: how many calls a token makes and their own CPU time;
* what is left of the unprofiled CPU time: Python, module calls and the dispatcher.

Profiled times carry the profiler's own cost per call (a few µs), so the small operators read
high; the split is for comparing within one run, at one thread count.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

WEIGHT_PRODUCTS = {"aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::mv"}
ATTENTION = {"aten::bmm", "aten::baddbmm", "aten::exp_", "aten::exp", "aten::amax", "aten::_softmax",
             "aten::_scaled_dot_product_flash_attention_for_cpu"}


def replayed_products_ms(net: torch.nn.Module, reps: int) -> float:
    """CPU ms of one token's weight products alone: every Linear of the model once, in order, on one
    row, through the same product the model's forward takes (Linear.forward), nothing around them."""
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(1, 1, m.in_features) for m in linears]
    with torch.inference_mode():
        for m, x in zip(linears, xs):
            m(x)
        c0 = time.process_time()
        for _ in range(reps):
            for m, x in zip(linears, xs):
                m(x)
    return (time.process_time() - c0) * 1000 / reps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from attnlens.model import SamplingParams, generate_tokens, load_checkpoint
    from attnlens.model.interop.packaged import SMOLLM2, ensure_checkpoint

    torch.set_num_threads(args.threads)
    model = load_checkpoint(ensure_checkpoint(SMOLLM2, progress=False))
    net, tok = model.model, model.tokenizer
    prompt = tok.encode("The capital of France is Paris. The capital of Germany is")
    n = args.new_tokens

    def run() -> None:
        for _ in generate_tokens(net, prompt, n, SamplingParams(temperature=0.0)):
            pass

    run()  # warm-up
    c0, w0 = time.process_time(), time.perf_counter()
    run()
    cpu_ms, wall_ms = (time.process_time() - c0) * 1000 / n, (time.perf_counter() - w0) * 1000 / n
    products_ms = replayed_products_ms(net, reps=5)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    top_level = sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))

    shapes = {}  # (out, in) of each weight -> its name
    for name, w in net.named_parameters():
        if w.dim() == 2:
            shapes.setdefault(tuple(w.shape), name.split(".", 2)[-1] if name.startswith("blocks.") else name)
    by_weight: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
    attention = other = 0.0
    other_calls = 0
    for e in prof.key_averages(group_by_input_shape=True):
        us = e.self_cpu_time_total
        if e.key in WEIGHT_PRODUCTS:
            dims = [tuple(s) for s in e.input_shapes if len(s) == 2]
            weight = next((s for s in dims if s in shapes), None)
            label = shapes.get(weight, "other products") if weight else "other products"
            entry = by_weight[label]
            entry[0] += us
            entry[1] += e.count
            entry[2] = weight[0] * weight[1] * 4 if weight else 0
        elif e.key in ATTENTION:
            attention += us
        else:
            other += us
            other_calls += e.count
    products = sum(v[0] for v in by_weight.values())
    profiled = (products + attention + other) / 1000 / n

    print(f"SmolLM2-135M-Instruct float32, batch 1, {args.threads} thread(s), {n} greedy tokens")
    print(f"unprofiled: {cpu_ms:.1f} ms CPU, {wall_ms:.1f} ms wall per token ({1000 / cpu_ms:.1f} tok/s of CPU time)\n")
    weights = sum(m.weight.numel() * 4 for m in net.modules() if isinstance(m, torch.nn.Linear))
    print(f"weight products alone, replayed: {products_ms:.1f} ms CPU per token ({weights / 1e6:.0f} MB read: "
          f"{weights / products_ms / 1e6:.1f} GB/s)")
    print(f"everything else (attention, small operators, Python): {cpu_ms - products_ms:.1f} ms per token; "
          f"{top_level / n:.0f} top-level aten calls per token\n")
    print(f"{'per token (profiled)':34s} {'ms':>7s} {'calls':>6s} {'GB/s':>6s}")
    for label, (us, count, nbytes) in sorted(by_weight.items(), key=lambda kv: -kv[1][0]):
        ms = us / 1000 / n
        rate = f"{nbytes * count / n / (ms / 1000) / 1e9:6.1f}" if nbytes else ""
        print(f"{'  ' + label:34s} {ms:7.2f} {count / n:6.0f} {rate:>6s}")
    print(f"{'weight products':34s} {products / 1000 / n:7.2f}")
    print(f"{'attention over the cache':34s} {attention / 1000 / n:7.2f}")
    print(f"{'other operators':34s} {other / 1000 / n:7.2f} {other_calls / n:6.0f}")
    print(f"{'all operators (profiled)':34s} {profiled:7.2f}")
    print(f"{'unprofiled CPU - profiled ops':34s} {cpu_ms - profiled:7.2f}   (negative: the profiler's own cost)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

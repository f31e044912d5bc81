"""Where a batch-1 decode step of SmolLM2-135M-Instruct spends its time on the CPU (issue 34).

    .venv/bin/python bench/profile_decode.py                  # float32, 1 thread, 32 greedy tokens
    .venv/bin/python bench/profile_decode.py --threads 2 --new-tokens 64 --packed

Decodes greedily with `generate_tokens` (the engine's decode step), first without a profiler
(process CPU time and wall clock per token), the fused step (model/fused_decode.py, every block
in one C call: what serving runs) and the modular one (model/parts/block.py, what hooks run) in
turns; then the modular step under torch.profiler (the fused one is a single opaque call), and
prints per token:

* the weight products alone, replayed by kind (q|k|v, attention output, gate|up, down, the LM
  head) through their own forward: the wall ms, the bytes they read and the rate (wall, not CPU:
  OpenMP's threads spin between calls, which CPU time counts as work);
* what each step spends beyond its products (attention, norms, rotary, sampling, Python);
* the modular step's aten operators: their own CPU time and calls a token (our C kernels are
  cffi calls, invisible to the profiler).

Profiled times carry the profiler's own cost per call (a few µs), so the small operators read
high; the split is for comparing within one run, at one thread count.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch


def products(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's weight products, float32 (Linear) or packed (PackedLinear), in order."""
    from attnlens.model.packed.modules import PackedLinear

    return [m for m in net.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]


def weight_bytes(m: torch.nn.Module) -> int:
    blocks = getattr(m, "blocks", None)
    return blocks.numel() if blocks is not None else m.weight.numel() * 4


def replayed_products_ms(net: torch.nn.Module, reps: int) -> list[tuple[str, float, int]]:
    """Wall ms of one token's weight products alone, by kind ((label, ms, bytes read)): every product
    of the model once, in order, on one row, through its own forward, nothing around them."""
    kinds: dict[str, list[torch.nn.Module]] = collections.defaultdict(list)
    for name, m in net.named_modules():
        if m in products(net):
            kinds[name.split(".", 2)[-1] if name.startswith("blocks.") else name].append(m)
    rows = []
    with torch.inference_mode():
        for label, ms in kinds.items():
            xs = [torch.randn(1, 1, m.in_features) for m in ms]
            for m, x in zip(ms, xs):
                m(x)
            w0 = time.perf_counter()
            for _ in range(reps):
                for m, x in zip(ms, xs):
                    m(x)
            rows.append((f"{label} x{len(ms)}", (time.perf_counter() - w0) * 1000 / reps,
                         sum(weight_bytes(m) for m in ms)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--packed", action="store_true", help="the file's own Q4_1 / Q8_0 blocks (model/packed/)")
    args = p.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from attnlens.model import SamplingParams, generate_tokens, load_checkpoint
    from attnlens.model.fused_decode import modular_decode
    from attnlens.model.interop.packaged import SMOLLM2, ensure_checkpoint
    from attnlens.model.packed.loading import describe

    torch.set_num_threads(args.threads)
    model = load_checkpoint(ensure_checkpoint(SMOLLM2, progress=False), packed=args.packed)
    net, tok = model.model, model.tokenizer
    prompt = tok.encode("The capital of France is Paris. The capital of Germany is")
    n = args.new_tokens

    def run() -> None:
        for _ in generate_tokens(net, prompt, n, SamplingParams(temperature=0.0)):
            pass

    def timed() -> tuple[float, float]:
        c0, w0 = time.process_time(), time.perf_counter()
        run()
        return (time.process_time() - c0) * 1000 / n, (time.perf_counter() - w0) * 1000 / n

    run()  # warm-up
    fused_runs, modular_runs = [], []
    for _ in range(3):  # in turns: the machine's drift falls on both
        fused_runs.append(timed())
        with modular_decode():
            modular_runs.append(timed())
    fused_cpu, fused_wall = min(fused_runs)
    cpu_ms, wall_ms = min(modular_runs)
    products_ms = replayed_products_ms(net, reps=10)
    with modular_decode(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    top_level = sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    profiled = sum(e.self_cpu_time_total for e in ops) / 1000 / n

    kind = "packed (" + ", ".join(f"{k} x{v}" for k, v in describe(net).items()) + ")" if args.packed else "float32"
    print(f"SmolLM2-135M-Instruct {kind}, batch 1, {args.threads} thread(s), {n} greedy tokens, best of 3")
    print(f"fused step (unprofiled):   {fused_cpu:.1f} ms CPU, {fused_wall:.1f} ms wall per token "
          f"({1000 / fused_wall:.1f} tok/s)")
    print(f"modular step (unprofiled): {cpu_ms:.1f} ms CPU, {wall_ms:.1f} ms wall per token "
          f"({1000 / wall_ms:.1f} tok/s)\n")
    print(f"{'weight products alone, replayed':34s} {'ms':>7s} {'MB':>6s} {'GB/s':>6s}")
    for label, ms, nbytes in products_ms:
        print(f"{'  ' + label:34s} {ms:7.2f} {nbytes / 1e6:6.1f} {nbytes / ms / 1e6:6.1f}")
    total_ms, total_bytes = sum(r[1] for r in products_ms), sum(r[2] for r in products_ms)
    print(f"{'  all':34s} {total_ms:7.2f} {total_bytes / 1e6:6.1f} {total_bytes / total_ms / 1e6:6.1f}")
    print(f"\nthe fused step beyond its products: {fused_wall - total_ms:.1f} ms wall per token "
          f"(attention, norms, rotary, the head's input, sampling, Python)")
    print(f"the modular step beyond its products: {wall_ms - total_ms:.1f} ms wall per token; "
          f"{top_level / n:.0f} top-level aten calls per token (our C kernels are not among them)\n")
    print(f"{'modular step, aten operators (profiled)':42s} {'ms':>7s} {'calls':>6s}")
    for e in ops[:14]:
        print(f"{'  ' + e.key:42s} {e.self_cpu_time_total / 1000 / n:7.2f} {e.count / n:6.0f}")
    print(f"{'  all aten operators':42s} {profiled:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

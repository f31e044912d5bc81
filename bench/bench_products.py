"""The products of a batched decode step on the CPU: SmolLM2's matrices times M rows, by our
kernels (model/native/: float_matmul_few for float32, packed_matmul for the file's Q4_1 / Q8_0
blocks) beside oneDNN's matmul (what torch's CPU build runs for a prefill) on the same float32
weights (for packed ones, dequantized), in turns, medians of --reps.

    .venv/bin/python bench/bench_products.py                       # 1 thread, CPU time: steady on a shared machine
    .venv/bin/python bench/bench_products.py --threads 2 --rows 1 16 64

Rows: the 120 matrices of SmolLM2's 30 blocks (q|k|v, o, gate|up, down) and its head (tied to
the embedding: 49,152 x 576, Q8_0 in the file). With one thread the figure is the thread's CPU
time (other tenants of the machine change it little); with more, wall time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, reps: int, clock) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    from attnlens.model import load_checkpoint
    from attnlens.model.interop.packaged import SMOLLM2, ensure_checkpoint
    from attnlens.model.native import library as native
    from attnlens.model.packed import kernel
    from attnlens.model.packed.modules import PackedLinear
    from attnlens.model.parts.linear import onednn_linear

    lib = native.load()
    packed_model = load_checkpoint(ensure_checkpoint(SMOLLM2, progress=False), packed=True).model
    packed = [m.packed for m in packed_model.modules() if isinstance(m, PackedLinear)]
    head = max(packed, key=lambda m: m.rows)
    groups = {"blocks": [m for m in packed if m is not head], "head": [head]}
    dense = {name: [m.dequantize() for m in ms] for name, ms in groups.items()}

    def ours_float(ws: list[torch.Tensor], xs: dict[int, torch.Tensor]):
        def run():
            for w in ws:
                x = xs[w.shape[1]]
                y = torch.empty(x.shape[0], w.shape[0])
                lib.float_matmul_few(x.data_ptr(), x.shape[0], w.shape[1], w.data_ptr(), w.shape[0], 0, y.data_ptr())
        return run

    def ours_packed(ms, xs: dict[int, torch.Tensor]):
        return lambda: [kernel.matmul(xs[m.cols], m.data, m.fmt, m.cols) for m in ms]

    def onednn(ws: list[torch.Tensor], xs: dict[int, torch.Tensor]):
        return lambda: [onednn_linear(xs[w.shape[1]], w) for w in ws]

    print(f"SmolLM2's products, {args.threads} thread(s) ({'CPU' if args.threads == 1 else 'wall'} time), "
          f"GMAC/s (median of {args.reps}); torch {torch.__version__}")
    print(f"{'rows':>5s} {'matrices':8s} {'float32 ours':>13s} {'packed ours':>12s} {'oneDNN float32':>15s}")
    for M in args.rows:
        for name, ms in groups.items():
            xs = {k: torch.randn(M, k) for k in {m.cols for m in ms}}
            macs = M * sum(m.rows * m.cols for m in ms)
            rates = [macs / timed(fn, args.reps, clock) / 1e9 for fn in
                     (ours_float(dense[name], xs), ours_packed(ms, xs), onednn(dense[name], xs))]
            print(f"{M:5d} {name:8s} {rates[0]:13.1f} {rates[1]:12.1f} {rates[2]:15.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

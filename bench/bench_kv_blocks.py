"""A decode step on the KV cache in blocks (model/paged_kv_cache.py, what the engine uses on the CPU)
beside the same step on whole rows (model/kv_cache.py: one (rows, K, context, D) tensor a layer,
each row's keys in one run), in one process, taking turns, on the packaged SmolLM2 (or --model):

    .venv/bin/python bench/bench_kv_blocks.py               # 2 threads
    .venv/bin/python bench/bench_kv_blocks.py --threads 1 --steps 10
    .venv/bin/python bench/bench_kv_blocks.py --attention   # one layer's attention alone: C kernel, torch

Cases (rows x the positions each holds before the step):
  * 1 x 64, 1 x 2,048, 1 x 8,000: one stream (a row that is one run of blocks);
  * 16 x 512: rows of equal length;
  * 1 x 4,096 + 15 x 64: one long prompt beside short chats. Whole rows attend over the longest row
    for every row (with a mask), blocks over each row's own.
Prints milliseconds a step (the median of --reps) and the memory each cache holds for those rows.

--attention: one layer's decode-step attention over the blocks alone (BlockAttention, SmolLM2's
shapes: 9 query heads, 3 key/value heads, d_head 64), random keys and values, one row of 512,
2,048 and 8,192 positions and 16 rows of 512: our C kernel (model/native/block_attention.c)
beside torch's batched products (the path without a C compiler), taking turns.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

CASES = [("1 x 64", [64]), ("1 x 2,048", [2048]), ("1 x 8,000", [8000]), ("16 x 512", [512] * 16),
         ("1 x 4,096 + 15 x 64", [4096] + [64] * 15)]


def load(model_dir: str | None):
    from attnlens.model import load_checkpoint
    from attnlens.model.interop.packaged import SMOLLM2, ensure_checkpoint

    return load_checkpoint(model_dir or ensure_checkpoint(SMOLLM2, progress=False)).model


def fill(model, cache, lengths: list[int]) -> None:
    """Prefill row i with lengths[i] random tokens (one row at a time)."""
    V = model.config.vocab_size
    for row, n in enumerate(lengths):
        model(torch.randint(0, V, (1, n)), kv_cache=cache, rows=slice(row, row + 1), last_only=True)


def step_ms(model, cache, B: int, steps: int) -> float:
    """Median ms of a one-token step over rows 0 .. B-1 (the lengths put back after each)."""
    ids = torch.randint(0, model.config.vocab_size, (B, 1))
    before = cache.lengths[:B].clone()
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        model(ids, kv_cache=cache, rows=slice(0, B), last_only=True)
        times.append(time.perf_counter() - t0)
        cache.lengths[:B] = before  # the same step again (a block it took stays in the row's table)
    return statistics.median(times[2:]) * 1000


def attention_only(args) -> None:
    from attnlens.model import paged_kv_cache

    K, G, D = 3, 3, 64
    print(f"one layer's decode-step attention, {K * G} query / {K} KV heads, d_head {D}, {args.threads} thread(s), "
          f"best of {args.reps} rounds of {args.steps} calls taking turns\n")
    print(f"{'rows x positions':<18}{'C kernel ms':>12}{'torch ms':>10}{'ratio':>8}{'C GB/s':>9}")
    for name, lengths in [("1 x 512", [512]), ("1 x 2,048", [2048]), ("1 x 8,192", [8192]), ("16 x 512", [512] * 16)]:
        B = len(lengths)
        cache = paged_kv_cache.PagedKVCache(1, B, K, max(lengths), D, dtype=torch.float32)
        for row, n in enumerate(lengths):
            cache.reserve(row, n)
            cache.lengths[row] = n - 1
        write = cache.begin(slice(0, B), B, 1)
        cache.keys[0].normal_()
        cache.values[0].normal_()
        q = torch.randn(B, K * G, 1, D)
        native = paged_kv_cache.native_attention

        def run(c_kernel: bool) -> float:
            paged_kv_cache.native_attention = native if c_kernel else (lambda q, keys: False)
            try:
                write.blocks(q, cache.keys[0], cache.values[0], D ** -0.5, False)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    write.blocks(q, cache.keys[0], cache.values[0], D ** -0.5, False)
                return (time.perf_counter() - t0) * 1000 / args.steps
            finally:
                paged_kv_cache.native_attention = native

        rounds = [(run(True), run(False)) for _ in range(args.reps)]
        c_ms, t_ms = min(r[0] for r in rounds), min(r[1] for r in rounds)
        read = 2 * sum(lengths) * K * D * 4  # keys and values
        print(f"{name:<18}{c_ms:>12.3f}{t_ms:>10.3f}{t_ms / c_ms:>7.2f}x{read / c_ms / 1e6:>9.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", help="a checkpoint directory (default: the packaged SmolLM2)")
    p.add_argument("--attention", action="store_true", help="one layer's attention alone: C kernel and torch")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.attention:
        with torch.inference_mode():
            attention_only(args)
        return
    model = load(args.model)
    c = model.config
    print(f"model     {c.n_layers} layers, {c.n_heads} query / {c.kv_heads} KV heads, d_head {c.d_head}, "
          f"context {c.context_length}")
    print(f"runtime   torch {torch.__version__}, {args.threads} thread(s), median of {args.steps} steps, "
          f"best of {args.reps} rounds taking turns\n")
    print(f"{'rows x positions':<22}{'blocks ms':>10}{'whole ms':>10}{'ratio':>8}{'blocks MB':>11}{'whole MB':>10}")
    with torch.inference_mode():
        for name, lengths in CASES:
            if max(lengths) + 1 > c.context_length:
                continue
            B = len(lengths)
            paged = model.new_kv_cache(B, paged=True, pool_bytes=1 << 30)
            whole = model.new_kv_cache(B)
            fill(model, paged, lengths)
            fill(model, whole, lengths)
            best = {"blocks": [], "whole": []}
            for _ in range(args.reps):
                best["blocks"].append(step_ms(model, paged, B, args.steps))
                best["whole"].append(step_ms(model, whole, B, args.steps))
            b, w = min(best["blocks"]), min(best["whole"])
            held_whole = sum(t.numel() * t.element_size() for t in whole.keys + whole.values)
            print(f"{name:<22}{b:>10.1f}{w:>10.1f}{w / b:>7.2f}x{paged.bytes_held / 1e6:>11.0f}{held_whole / 1e6:>10.0f}",
                  flush=True)
            del paged, whole
    print("\nratio: whole rows' ms over blocks' (above 1: blocks faster). MB: what each cache holds for these rows "
          "(whole rows: every row's whole context, allocated up front)")


if __name__ == "__main__":
    main()

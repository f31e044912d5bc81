"""GPU benchmark (CUDA): attnlens against transformers' GPT-2 on identical weights, and the
engine's batch scaling, in-process and over HTTP.

    python bench/bench_gpu.py                          # GPT-2-shaped 6L/6H/384d, random weights
    python bench/bench_gpu.py --model checkpoints/default --dtype float32

The default model is the shape of the issue's anchors (6 layers, 6 heads, d_model 384,
d_ff 1536, context 1024) with random weights and the bundled tokenizer. Every figure below is
measured in this one run, on one device, in the dtype given (bf16 by default, the service's
default on CUDA):

1. batch-1 greedy decoding of N new tokens (default 128) after a short prompt:
   transformers `generate()` (sdpa; in the same dtype, and in fp32); our `generate_tokens`
   (eager); our decode loop replaying the captured CUDA graph (`GraphedDecoder`); and the
   engine with one stream, in-process (scheduler + model thread + output stage, no HTTP);
2. the model alone: one batched decode step over B cache rows, eager and replayed, B = 1..32;
3. the engine in-process and the real server over HTTP (`bench_service.run_level`) with
   1, 4, 16 and 32 concurrent greedy streams: aggregate tok/s and its ratio to one stream.

Times are wall clock around work that ends in a device synchronisation (every decode step
reads its token ids back to the host), medians over --reps runs after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from bench_model import random_checkpoint  # noqa: E402

from attnlens.model.checkpoint import load_checkpoint  # noqa: E402
from attnlens.model.cuda_graphs import GraphedDecoder  # noqa: E402
from attnlens.model.decoding import RowSampler, SamplingParams, decode_step, generate_tokens  # noqa: E402
from attnlens.model.interop.hf import export_hf  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ANCHOR_SHAPE = dict(n_layers=6, n_heads=6, d_model=384, d_ff=1536, context_length=1024)
PROMPT = "ROMEO.\nBut soft, what light"
SAMPLED = dict(temperature=0.8, top_k=50)  # the sampled-traffic rows: each request its own seed
DEVICE = "cuda"  # --device cpu: a slow dry run of this script where there is no GPU


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def anchor_checkpoint(out: Path, seed: int = 0) -> Path:
    """The anchors' GPT-2 shape with random weights and the bundled tokenizer."""
    tok = load_checkpoint(REPO_ROOT / "checkpoints" / "default").tokenizer
    return random_checkpoint(out, seed, shape=dict(vocab_size=tok.vocab_size, **ANCHOR_SHAPE), tokenizer=tok)


def timed(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of fn() (which synchronises the device itself) over reps runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def batch_one(model_dir: Path, dtype: torch.dtype, n: int, reps: int) -> dict[str, float]:
    """tok/s of batch-1 greedy decoding: HF generate() (dtype and fp32), ours eager and graphed."""
    import transformers
    from transformers import GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    ckpt = load_checkpoint(model_dir, device=DEVICE, dtype=dtype)
    model, ids = ckpt.model, ckpt.tokenizer.encode(PROMPT)
    prompt = torch.tensor([ids], device=DEVICE)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = export_hf(model_dir, Path(tmp) / "hf")
        for name, hf_dtype in (("hf_generate", dtype), ("hf_generate_fp32", torch.float32)):
            hf = GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="sdpa", dtype=hf_dtype).to(DEVICE).eval()

            def hf_generate(hf=hf):  # bound now: the loop deletes its name after each model
                with torch.inference_mode():
                    hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
                                min_new_tokens=n, pad_token_id=ckpt.tokenizer.eos_id)

            out[name] = n / timed(hf_generate, reps)
            del hf

    def eager():
        for _ in generate_tokens(model, ids, n, SamplingParams(temperature=0)):
            pass

    out["ours_eager"] = n / timed(eager, reps)

    cache = model.new_kv_cache(1)
    t0 = time.perf_counter()
    graphs = GraphedDecoder(model, cache, buckets=(1,))
    out["capture_ms"] = (time.perf_counter() - t0) * 1000
    sampler = [RowSampler(SamplingParams(temperature=0))]

    @torch.inference_mode()
    def graphed():
        cache.reset()
        token = decode_step(model, cache, prompt, sampler).tokens[0]  # prefill (eager)
        for _ in range(n - 1):
            nxt = torch.tensor([[token.id]])  # on the host: the graph copies it in
            token = decode_step(model, cache, nxt, sampler, graphs=graphs).tokens[0]

    out["ours_graphed"] = n / timed(graphed, reps)
    return out


def step_scaling(model_dir: Path, dtype: torch.dtype, sizes: list[int], steps: int = 50) -> list[tuple]:
    """The model alone: (B, eager ms/step, graphed ms/step) for one decode step over B rows."""
    model = load_checkpoint(model_dir, device=DEVICE, dtype=dtype).model
    rows = []
    with torch.inference_mode():
        for B in sizes:
            result = [B]
            for use_graphs in (False, True):
                cache = model.new_kv_cache(B)
                graphs = GraphedDecoder(model, cache, buckets=(B,)) if use_graphs else None
                samplers = [RowSampler(SamplingParams(temperature=0)) for _ in range(B)]
                for r in range(B):  # prompts of 8..39 tokens: rows of different lengths
                    p = torch.randint(0, model.config.vocab_size, (1, 8 + r % 32), device=DEVICE)
                    decode_step(model, cache, p, [samplers[r]], rows=slice(r, r + 1))
                x = torch.randint(0, model.config.vocab_size, (B, 1))  # host ids, as the engine passes them

                def run():
                    for _ in range(steps):
                        decode_step(model, cache, x, samplers, graphs=graphs)
                    cache.lengths[:B] -= steps  # the same positions again next time

                result.append(timed(run, 3, warmup=1) / steps * 1000)
            rows.append(tuple(result))
    return rows


def engine_levels(model_dir: Path, dtype: torch.dtype, levels: list[int], n: int, reps: int,
                  sampling: dict | None = None) -> list[tuple]:
    """The engine in-process (no HTTP): (clients, tokens, aggregate tok/s) per level, median of
    reps; greedy, or every request sampled with `sampling` (its own seed each)."""
    from bench_service import PROMPTS

    from attnlens.app.engine import Engine, GenerationParams
    from attnlens.app.engine.outputs import TokenEvent
    from attnlens.app.server.settings import default_switch_interval_ms

    sys.setswitchinterval(default_switch_interval_ms(DEVICE) / 1000)  # as the server does
    ckpt = load_checkpoint(model_dir, device=DEVICE, dtype=dtype)
    engine = Engine(ckpt, max_concurrent=max(levels), max_queue=max(levels))
    tok = ckpt.tokenizer

    async def level(k: int, n: int = n) -> tuple[int, float]:
        rules = [dict(temperature=0) if sampling is None else dict(sampling, seed=i) for i in range(k)]
        params = [GenerationParams(tok.encode(PROMPTS[i % len(PROMPTS)]), n, SamplingParams(**rules[i]))
                  for i in range(k)]
        t0 = time.perf_counter()
        gens = engine.submit_all(params)

        async def count(g):
            return sum([isinstance(e, TokenEvent) async for e in g.events()])

        tokens = sum(await asyncio.gather(*(count(g) for g in gens)))
        return tokens, tokens / (time.perf_counter() - t0)

    out = []
    try:
        for k in levels:
            asyncio.run(level(k, 8))  # warm-up: this level's prefill shapes load their kernels once
            runs = sorted((asyncio.run(level(k)) for _ in range(reps)), key=lambda r: r[1])
            out.append((k, *runs[len(runs) // 2]))
    finally:
        engine.close()
    return out


def http_levels(model_dir: Path, dtype_name: str, levels: list[int], n: int, reps: int,
                switch_ms: float | None = None) -> list[dict]:
    import os

    from bench_service import free_port, run_level, start_server

    if switch_ms is not None:
        os.environ["ATTNLENS_SWITCH_INTERVAL_MS"] = str(switch_ms)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(model_dir, port, max(levels), Path(tmp) / "server.log", device=DEVICE, dtype=dtype_name)
        try:
            rows = []
            for k in levels:
                run_level(port, k, 8)  # warm-up: this level's prefill shapes load their kernels once
                runs = sorted((run_level(port, k, n) for _ in range(reps)), key=lambda r: r["aggregate"])
                rows.append(runs[len(runs) // 2])
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an attnlens decoder checkpoint (default: the anchors' shape, random weights)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--switch-intervals", type=float, nargs="+", default=[0.2],
                   help="the server's ATTNLENS_SWITCH_INTERVAL_MS: one HTTP table per value (0.2 = its default "
                        "on CUDA, 5 = Python's)")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a dry run
    args = p.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA device")
    dtype, n = DTYPES[args.dtype], args.new_tokens
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    print(f"device: {name}, torch {torch.__version__}, dtype {args.dtype}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else anchor_checkpoint(Path(tmp) / "anchor")
        cfg = load_checkpoint(model_dir).config
        print(f"model: {cfg.n_layers}L/{cfg.n_heads}H/{cfg.d_model}d, vocab {cfg.vocab_size}, "
              f"context {cfg.context_length}", flush=True)
        # the HTTP levels first, while this process (the clients) has no CUDA work or threads of its own
        http, http_by_interval = [], {}
        for switch_ms in ([] if args.skip_http else args.switch_intervals):
            try:
                http_by_interval[switch_ms] = http_levels(model_dir, args.dtype, args.levels, n, args.reps, switch_ms)
            except (SystemExit, Exception) as e:  # keep the in-process figures
                print(f"the HTTP levels failed: {e}", flush=True)
        if http_by_interval:
            http = next(iter(http_by_interval.values()))  # the first interval given (the default setting)
        print("HTTP levels done", flush=True)
        one = batch_one(model_dir, dtype, n, args.reps)
        print("batch 1 done", flush=True)
        scaling = step_scaling(model_dir, dtype, args.batch_sizes) if args.batch_sizes else []
        print("step scaling done", flush=True)
        engine = engine_levels(model_dir, dtype, args.levels, n, args.reps)
        sampled = engine_levels(model_dir, dtype, [1, max(args.levels)], n, args.reps, SAMPLED)
        print("engine levels done", flush=True)

    hf = one["hf_generate"]
    print()
    print(f"batch-1 greedy decode, {n} new tokens ({args.dtype}; HF generate() in the same dtype is the peer):")
    for key, label in (("hf_generate", f"HF generate() {args.dtype}"), ("hf_generate_fp32", "HF generate() float32"),
                       ("ours_eager", "attnlens generate_tokens (eager)"),
                       ("ours_graphed", "attnlens decode loop, CUDA graph")):
        print(f"  {label:<36} {one[key]:>8.0f} tok/s  {one[key] / hf:>6.2f}x")
    if engine and engine[0][0] == 1:
        print(f"  {'attnlens engine, 1 stream in-process':<36} {engine[0][2]:>8.0f} tok/s  {engine[0][2] / hf:>6.2f}x")
    if http and http[0]["clients"] == 1:
        r = http[0]["aggregate"]
        print(f"  {'attnlens server, 1 stream over HTTP':<36} {r:>8.0f} tok/s  {r / hf:>6.2f}x")
    print(f"  (capturing the batch-1 graph took {one['capture_ms']:.0f} ms)")
    if scaling:
        print()
        print("the model alone, one batched decode step (ms):")
        print(f"{'batch':>5} | {'eager':>7} | {'graphed':>7} | {'graphed tok/s':>13} | {'x batch 1':>9}")
        for B, eager, graphed in scaling:
            print(f"{B:>5} | {eager:>7.3f} | {graphed:>7.3f} | {B / graphed * 1000:>13.0f} | "
                  f"{(B / graphed) / (1 / scaling[0][2]):>8.2f}x")
    print()
    print("concurrent greedy streams: aggregate tok/s (x one stream)")
    print(f"{'clients':>7} | {'engine in-process':>17} | {'x 1':>6} | {'server over HTTP':>16} | {'x 1':>6} | "
          f"{'TTFT p50 ms':>11} | {'server TTFT':>11} | {'ITL p50 ms':>10} | {'ITL p99 ms':>10}")
    for i, (k, _, rate) in enumerate(engine):
        h = http[i] if i < len(http) else None
        hs = (f"{h['aggregate']:>16.0f} | {h['aggregate'] / http[0]['aggregate']:>5.2f}x | {h['ttft_p50']:>11.1f} | "
              f"{h['server_ttft_p50']:>11.1f} | {h['itl_p50']:>10.2f} | {h['itl_p99']:>10.2f}") if h else f"{'-':>16} | {'-':>6} |"
        print(f"{k:>7} | {rate:>17.0f} | {rate / engine[0][2]:>5.2f}x | {hs}")
    print(f"sampled streams ({SAMPLED}), engine in-process: " + ", ".join(
        f"{k} streams {rate:.0f} tok/s ({rate / sampled[0][2]:.2f}x)" for k, _, rate in sampled))
    for switch_ms, rows in list(http_by_interval.items())[1:]:
        print(f"server over HTTP with a GIL switch interval of {switch_ms} ms:")
        for h in rows:
            print(f"{h['clients']:>7} | {h['aggregate']:>8.0f} tok/s | {h['aggregate'] / rows[0]['aggregate']:>5.2f}x | "
                  f"TTFT p50 {h['ttft_p50']:>6.1f} ms (server {h['server_ttft_p50']:>6.1f}) | ITL p50 {h['itl_p50']:>5.2f} ms | ITL p99 {h['itl_p99']:>5.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

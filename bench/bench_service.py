"""Service benchmark: the real server over HTTP, 1 / 4 / 16 / 32 concurrent streaming clients.

Starts `python -m attnlens.app.cli serve` on a free loopback port (one torch thread, the default
model unless --model), then for each concurrency level sends that many streaming greedy
`POST /generate` requests at once (`max_new_tokens` 128 by default, different prompts) and
prints, per level: aggregate tok/s (all tokens / wall time of the level), per-stream tok/s
(median over streams of tokens / (last token - request sent)), p50 / p99 time to first token
(and the server's own p50, admission to first token, from the `done` event's timings) and
p50 / p99 inter-token latency, and tokens per CPU-second of the server process (a figure
that other processes' load on a shared machine does not dilute). Tokens are counted from the `event: token` lines as they
arrive; the client is a small asyncio socket reader, so it costs the machine little.

In the same run, on the same weights, one thread each: Hugging Face `generate()` (greedy,
exactly N new tokens) and our own decode loop in-process (`model.generate_tokens`), taking
turns with the one-stream level's repetitions (HF, ours in-process, one stream over HTTP, and
again), so the ratios are measured side by side under the same load. The load average is printed before and after.

    .venv/bin/python bench/bench_service.py
    .venv/bin/python bench/bench_service.py --levels 1 16 --new-tokens 64 --model DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

# The allocator the server runs with (app/cli/commands.py: large CPU tensors on 2 MB pages), for the
# in-process peers too; torch is imported later, so it reads this.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

DEFAULT_MODEL = REPO_ROOT / "checkpoints" / "default"
PROMPTS = ["ROMEO.\n", "JULIET.\nO Romeo", "First Citizen.\n", "KING HENRY.\nNow", "HAMLET.\nTo be, or",
           "The quality of mercy", "Friends, Romans,", "Now is the winter of"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def start_server(model: Path, port: int, max_concurrent: int, log_path: Path, *, device: str = "cpu",
                 dtype: str = "float32") -> subprocess.Popen:
    env = {**os.environ, "ATTNLENS_DEVICE": device, "ATTNLENS_DTYPE": dtype, "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "ATTNLENS_MAX_CONCURRENT": str(max_concurrent),
           "ATTNLENS_MAX_QUEUE": str(max_concurrent), "ATTNLENS_LOG_LEVEL": "warning",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "attnlens.app.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
                             "--port", str(port)], cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log_path.read_text(errors='replace')}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /readyz HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
                if b" 200 " in s.recv(100):
                    return proc
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not become ready in 120 s")


async def one_stream(port: int, body: dict) -> dict:
    """Send one streaming /generate; return send time, token arrival times, the final event."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t_send = time.perf_counter()
    writer.write(b"POST /generate HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    arrivals: list[float] = []
    finish, server_ttft = None, None
    buf = b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        now = time.perf_counter()
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"event: token"):
                arrivals.append(now)
            elif line.startswith(b"event: done"):
                finish = "done"
            elif finish == "done" and line.startswith(b"data: ") and server_ttft is None:
                # the server's own clock: admission to first token (queue + prefill)
                server_ttft = json.loads(line[6:])["timings"]["time_to_first_token_ms"]
            elif line.startswith(b"event: error"):
                finish = "error"
    writer.close()
    return {"t_send": t_send, "arrivals": arrivals, "finish": finish, "server_ttft": server_ttft}


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process and of its child processes (the engine's), from Linux /proc;
    None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [c for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except (OSError, IndexError, ValueError):
        return None
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(filter(None, (process_cpu_seconds(int(c)) for c in children)))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def run_level(port: int, n: int, new_tokens: int, server_pid: int | None = None) -> dict:
    bodies = [{"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": new_tokens, "temperature": 0,
               "stream": True} for i in range(n)]

    async def main():
        return await asyncio.gather(*(one_stream(port, b) for b in bodies))

    cpu0 = process_cpu_seconds(server_pid) if server_pid else None
    t0 = time.perf_counter()
    streams = asyncio.run(main())
    wall = time.perf_counter() - t0
    cpu1 = process_cpu_seconds(server_pid) if server_pid else None
    if any(s["finish"] != "done" for s in streams):
        raise SystemExit(f"a stream did not finish: {[s['finish'] for s in streams]}")
    tokens = sum(len(s["arrivals"]) for s in streams)
    ttft = [(s["arrivals"][0] - s["t_send"]) * 1000 for s in streams if s["arrivals"]]
    gaps = [(b - a) * 1000 for s in streams for a, b in zip(s["arrivals"], s["arrivals"][1:])]
    per_stream = [len(s["arrivals"]) / (s["arrivals"][-1] - s["t_send"]) for s in streams if s["arrivals"]]
    server_cpu = (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else None
    return {"clients": n, "tokens": tokens, "aggregate": tokens / wall, "per_stream": statistics.median(per_stream),
            "per_server_cpu_s": tokens / server_cpu if server_cpu else float("nan"),
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "server_ttft_p50": percentile([s["server_ttft"] for s in streams if s["server_ttft"] is not None], 50),
            "itl_p50": percentile(gaps, 50), "itl_p99": percentile(gaps, 99)}


def in_process_peers(model_dir: Path, new_tokens: int) -> dict[str, Callable[[], None]]:
    """Runners for HF generate() and our generate_tokens on the same weights, one thread each:
    name -> a function that generates `new_tokens` greedy tokens after PROMPTS[0] (warmed up)."""
    import torch
    import transformers
    from transformers import GPT2LMHeadModel

    from attnlens.model import SamplingParams, generate_tokens, load_checkpoint
    from attnlens.model.interop.hf import export_hf

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    ckpt = load_checkpoint(model_dir)
    ids = ckpt.tokenizer.encode(PROMPTS[0])
    with tempfile.TemporaryDirectory() as tmp:
        hf = GPT2LMHeadModel.from_pretrained(export_hf(model_dir, Path(tmp) / "hf"), attn_implementation="sdpa").eval()
    prompt = torch.tensor([ids])

    def hf_generate():
        with torch.inference_mode():
            hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens, pad_token_id=ckpt.tokenizer.eos_id)

    def ours():
        for _ in generate_tokens(ckpt.model, ids, new_tokens, SamplingParams(temperature=0)):
            pass

    runners = {"hf_generate": hf_generate, "ours_in_process": ours}
    for fn in runners.values():
        fn()  # warm-up
    return runners


def tokens_per_second(fn: Callable[[], None], new_tokens: int) -> float:
    t0 = time.perf_counter()
    fn()
    return new_tokens / (time.perf_counter() - t0)


def batch_scaling(model_dir: Path, sizes: list[int], steps: int = 40) -> list[tuple[int, float, float]]:
    """The model alone: one batched decode step (model.decoding.decode_step) over B cache rows of
    different lengths, one thread; (B, ms per step, tokens per CPU-second). Sizes MAX_CONCURRENT."""
    import torch

    from attnlens.model import SamplingParams, load_checkpoint
    from attnlens.model.decoding import RowSampler, decode_step

    torch.set_num_threads(1)
    model = load_checkpoint(model_dir).model
    out = []
    with torch.inference_mode():
        for B in sizes:
            cache = model.new_kv_cache(B)
            samplers = [RowSampler(SamplingParams(temperature=0)) for _ in range(B)]
            for r in range(B):  # prompts of 8..39 tokens
                prompt = torch.randint(0, model.config.vocab_size, (1, 8 + r % 32))
                decode_step(model, cache, prompt, [samplers[r]], rows=slice(r, r + 1))
            x = torch.randint(0, model.config.vocab_size, (B, 1))
            decode_step(model, cache, x, samplers)
            c0 = time.process_time()
            for _ in range(steps):
                decode_step(model, cache, x, samplers)
            cpu = (time.process_time() - c0) / steps
            out.append((B, cpu * 1000, B / cpu))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-concurrent", type=int, default=32, help="ATTNLENS_MAX_CONCURRENT of the server")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each level (the median is shown)")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 4, 8, 16, 32, 48, 64],
                   help="batch sizes for the model-alone decode step table (empty: skip it)")
    args = p.parse_args(argv)
    model = Path(args.model)

    print(f"load average before: {load_average()}  ({os.cpu_count()} CPUs)", flush=True)
    runners = in_process_peers(model, args.new_tokens)
    scaling = batch_scaling(model, args.batch_sizes) if args.batch_sizes else []
    port = free_port()
    peer_rates: dict[str, list[float]] = {name: [] for name in runners}
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(model, port, args.max_concurrent, Path(tmp) / "server.log")
        try:
            run_level(port, 1, 8)  # warm the server's paths
            rows = []
            for n in args.levels:
                runs = []
                for _ in range(args.reps):
                    if n == 1:  # the peers take turns with the one-stream level: a burst of load hits all alike
                        for name, fn in runners.items():
                            peer_rates[name].append(tokens_per_second(fn, args.new_tokens))
                    runs.append(run_level(port, n, args.new_tokens, proc.pid))
                runs.sort(key=lambda r: r["aggregate"])
                rows.append(runs[len(runs) // 2])
                print(f"  {n} clients done", flush=True)
            if not peer_rates["hf_generate"]:  # no one-stream level: measure the peers on their own
                for _ in range(args.reps):
                    for name, fn in runners.items():
                        peer_rates[name].append(tokens_per_second(fn, args.new_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    peers = {name: statistics.median(rates) for name, rates in peer_rates.items()}
    single = rows[0]["aggregate"] if rows and rows[0]["clients"] == 1 else None

    print()
    single_cpu = rows[0]["per_server_cpu_s"] if single else None
    print(f"{'clients':>7} | {'tokens':>6} | {'aggregate tok/s':>15} | {'x 1 stream':>10} | {'per-stream tok/s':>16} | "
          f"{'TTFT p50 ms':>11} | {'TTFT p99 ms':>11} | {'server TTFT':>11} | {'ITL p50 ms':>10} | {'ITL p99 ms':>10} | "
          f"{'tok/server-CPU-s':>16} | {'x 1 stream':>10}")
    for r in rows:
        ratio = f"{r['aggregate'] / single:.2f}x" if single else "-"
        cpu_ratio = f"{r['per_server_cpu_s'] / single_cpu:.2f}x" if single_cpu else "-"
        print(f"{r['clients']:>7} | {r['tokens']:>6} | {r['aggregate']:>15.0f} | {ratio:>10} | {r['per_stream']:>16.0f} | "
              f"{r['ttft_p50']:>11.1f} | {r['ttft_p99']:>11.1f} | {r['server_ttft_p50']:>11.1f} | {r['itl_p50']:>10.2f} | {r['itl_p99']:>10.2f} | "
              f"{r['per_server_cpu_s']:>16.0f} | {cpu_ratio:>10}")
    print()
    hf = peers["hf_generate"]
    print(f"HF generate() in-process, 1 thread, greedy {args.new_tokens} tokens: {hf:.0f} tok/s")
    print(f"attnlens generate_tokens in-process, 1 thread:                {peers['ours_in_process']:.0f} tok/s "
          f"({peers['ours_in_process'] / hf:.2f}x HF)")
    if single:
        print(f"attnlens one stream over HTTP (server: 1 torch thread):      {single:.0f} tok/s ({single / hf:.2f}x HF)")
    if scaling:
        print()
        print("the model alone, one batched decode step (CPU time, 1 thread):")
        print(f"{'batch':>5} | {'ms/step':>7} | {'tok/s':>6} | {'x batch 1':>9}")
        for B, ms, tok_s in scaling:
            print(f"{B:>5} | {ms:>7.2f} | {tok_s:>6.0f} | {tok_s / scaling[0][2]:>8.2f}x")
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

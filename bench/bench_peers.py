"""SmolLM2-135M-Instruct on the CPU beside its peers, in one run (issue 34): transformers, attnlens and
llama.cpp's llama-server, the same threads each.

    .venv/bin/python bench/bench_peers.py                           # 2 threads, 128 tokens, 3 reps
    .venv/bin/python bench/bench_peers.py --new-tokens 16 --reps 1  # a quick check

Rows, each with --threads threads, measured in turns (never two at once): every server is started
first and waits idle while the others are measured; then each row decodes in turn, then each
prefills in turn, --reps times after one warm-up, so a shared machine's drift falls on every row
alike:

* transformers `generate()`, float32 (its own GGUF loader on the packaged file, dequantized),
  in this process;
* attnlens in this process (`generate_tokens`, a prefill into a paged KV cache row), float32 and
  packed (the file's own Q4_1 / Q8_0 blocks, model/packed/);
* attnlens over HTTP, float32 and packed (ATTNLENS_DTYPE=packed): the real server (`python -m
  attnlens.app.cli serve`, the converted checkpoint, OMP_NUM_THREADS=threads), streaming
  `POST /generate` with token ids;
* llama.cpp `llama-server` on the packaged GGUF as shipped (Q4_1 blocks, a Q8_0 token embedding)
  and on the same file requantized to F32 (`llama-quantize --allow-requantize in out F32`),
  streaming `POST /completion` with the same token ids. llama.cpp is built once into a cache
  (bench/llama_cpp_build.py); when it cannot be built its rows are skipped with the reason.

Per row: decode tok/s of N greedy tokens after a short prompt (the tokens after the first over
the time from the first to the last: prefill excluded), the time to prefill a 512- and a 2,048-token prompt
(and return one token: over HTTP the request's wall time), and the server's RSS after both (its
engine process included; in-process rows share this process and print "-"). Medians. Then every
row's ratio to each llama.cpp row, and each prefill against transformers' forward.

The attnlens servers also answer --streams (16) sampled generations of N tokens at once, seeded
(the same work each time): the tokens of them all over the wall time, prefills included. llama.cpp's
servers here have one slot (`-np 1`), so they are not asked.

Memory: this process sets glibc's malloc thresholds as the server sets them in its processes
(ATTNLENS_MALLOC_RETAIN_BYTES, app/engine/allocator.py), for the in-process rows of transformers
and attnlens alike; --malloc-defaults keeps glibc's defaults (there a forward's time depends on
what the forward before it left on the heap: page faults, the same for every row in this process).

Greedy: llama.cpp gets `ignore_eos`, transformers `min_new_tokens`; attnlens over HTTP has no such
switch, so the prompt is one that SmolLM2 continues past N tokens (the count is printed).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "bench"))

from bench_service import free_port  # noqa: E402
from llama_cpp_build import ensure_llama_cpp, f32_gguf  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea. Once upon a time,"
LONG_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
             "movable metal type, oil-based ink and a wooden press adapted from those used for wine. ")


@dataclass
class Row:
    name: str
    weights: str
    decode_tok_s: float | None = None
    prefill_s: dict[int, float] = field(default_factory=dict)  # prompt tokens -> seconds
    rss_gb: float | None = None
    streams_tok_s: float | None = None  # --streams generations at once, tokens/s of them all
    note: str = ""


# --- processes -----------------------------------------------------------------
def tree_rss_bytes(pid: int) -> int:
    """VmRSS of a process and of its descendants (attnlens' engine process), from Linux /proc."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
        children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except (OSError, ValueError):
        return total
    return total + sum(tree_rss_bytes(c) for c in children)


def wait_ready(proc: subprocess.Popen, port: int, path: str, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def post_stream(port: int, path: str, body: dict, is_token: Callable[[bytes], bool]) -> list[float]:
    """POST a streaming request; the arrival time of every token event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status} {resp.read()[:500]!r}")
    arrivals = []
    while line := resp.readline():
        if is_token(line):
            arrivals.append(time.perf_counter())
    conn.close()
    return arrivals


def post_wall_s(port: int, path: str, body: dict) -> float:
    """Wall seconds of one non-streaming POST, to its whole answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    wall = time.perf_counter() - t0
    if resp.status != 200:
        raise RuntimeError(f"{path}: HTTP {resp.status} {data[:500]!r}")
    conn.close()
    return wall


def is_llama_token(line: bytes) -> bool:
    """A streamed /completion event with a token (the last one, `"stop": true`, carries the timings)."""
    if not line.startswith(b"data: "):
        return False
    try:
        event = json.loads(line[6:])
    except ValueError:
        return False
    return isinstance(event, dict) and not event.get("stop", False) and "content" in event


def decode_rate(arrivals: list[float]) -> float:
    """Tokens after the first over the time from the first to the last: decoding alone."""
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


# --- the peers -------------------------------------------------------------------
@dataclass
class Contestant:
    """One row of the table: how to decode (-> tok/s) and prefill (ids -> seconds) with it, and its
    server process when it has one (its RSS is read at the end, then it is stopped)."""

    row: Row
    decode: Callable[[], float]
    prefill: Callable[[list[int]], float]
    proc: subprocess.Popen | None = None
    counts: list[int] = field(default_factory=list)  # tokens each decode streamed (attnlens: EOS ends one)
    streams: Callable[[], float] | None = None  # --streams at once -> tokens/s (attnlens over HTTP)


class Measure:
    def __init__(self, args, prompt_ids: list[int], long_ids: dict[int, list[int]]):
        self.args, self.prompt_ids, self.long_ids = args, prompt_ids, long_ids

    def rounds(self, contestants: list[Contestant]) -> None:
        """Every contestant's decode, then every prefill length for each, in turn, --reps times after one
        warm-up of each: a machine's drift (other tenants, clocks) falls on every row alike. Medians."""
        live = [c for c in contestants if not c.row.note]
        rates: dict[int, list[float]] = {id(c): [] for c in live}
        together: dict[int, list[float]] = {id(c): [] for c in live if c.streams is not None}
        prefills: dict[tuple[int, int], list[float]] = {(id(c), n): [] for c in live for n in self.long_ids}
        for c in live:
            c.decode()
            for ids in self.long_ids.values():
                c.prefill(ids)
            if c.streams is not None:
                c.streams()
        for _ in range(self.args.reps):
            for c in live:
                rates[id(c)].append(c.decode())
            for c in live:
                if c.streams is not None:
                    together[id(c)].append(c.streams())
            for n, ids in self.long_ids.items():
                for c in live:
                    prefills[(id(c), n)].append(c.prefill(ids))
        for c in live:
            c.row.decode_tok_s = statistics.median(rates[id(c)])
            c.row.prefill_s = {n: statistics.median(prefills[(id(c), n)]) for n in self.long_ids}
            if together.get(id(c)):
                c.row.streams_tok_s = statistics.median(together[id(c)])
            if c.proc is not None:
                c.row.rss_gb = tree_rss_bytes(c.proc.pid) / 1e9
            if c.counts and min(c.counts) < self.args.new_tokens:
                c.row.note = f"stopped at EOS after {min(c.counts)} tokens"

    def server(self, row: Row, cmd: list[str], env: dict, ready_path: str, decode, prefill) -> Contestant:
        """A server started and ready (a row with a note instead when it is not)."""
        port = free_port()
        with tempfile.NamedTemporaryFile(suffix=".log", delete=False) as f:
            log = Path(f.name)
        with open(log, "wb") as out:
            proc = subprocess.Popen([*cmd, "--port", str(port)], cwd=REPO_ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)
        try:
            wait_ready(proc, port, ready_path, log)
        except RuntimeError as e:
            row.note = str(e).splitlines()[0][:120]
            stop(proc)
        return Contestant(row, lambda: decode(port), lambda ids: prefill(port, ids), proc)

    def attnlens_http(self, ckpt_dir: Path, dtype: str, weights: str) -> Contestant:
        a, n = self.args, self.args.new_tokens
        env = {**os.environ, "ATTNLENS_DEVICE": "cpu", "ATTNLENS_DTYPE": dtype, "OMP_NUM_THREADS": str(a.threads),
               **({"ATTNLENS_MALLOC_RETAIN_BYTES": "0"} if a.malloc_defaults else {}),
               "MKL_NUM_THREADS": str(a.threads), "ATTNLENS_LOG_LEVEL": "warning",
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        counts: list[int] = []

        def decode(port: int) -> float:
            arrivals = post_stream(port, "/generate", {"ids": self.prompt_ids, "max_new_tokens": n, "temperature": 0,
                                                       "stream": True}, lambda line: line.startswith(b"event: token"))
            counts.append(len(arrivals))
            return decode_rate(arrivals)

        def prefill(port: int, ids: list[int]) -> float:
            return post_wall_s(port, "/generate", {"ids": ids, "max_new_tokens": 1, "temperature": 0})

        c = self.server(Row("attnlens (over HTTP)", weights),
                        [sys.executable, "-m", "attnlens.app.cli", "serve", "--model", str(ckpt_dir), "--host",
                         "127.0.0.1"], env, "/readyz", decode, prefill)
        c.counts = counts
        port = int(c.proc.args[-1]) if c.proc is not None else 0  # the --port it was started with

        def streams() -> float:
            """--streams sampled generations of --new-tokens at once (seeded: the same work each time)."""
            from concurrent.futures import ThreadPoolExecutor

            def one(i: int) -> int:
                body = {"ids": self.prompt_ids, "max_new_tokens": n, "temperature": 0.8, "seed": i}
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
                answer = json.loads(conn.getresponse().read())
                conn.close()
                return len(answer["tokens"])

            t0 = time.perf_counter()
            with ThreadPoolExecutor(a.streams) as pool:
                tokens = sum(pool.map(one, range(a.streams)))
            return tokens / (time.perf_counter() - t0)

        if a.streams:
            c.streams = streams
        return c

    def llama_server(self, server: Path, env: dict[str, str], gguf: Path, weights: str) -> Contestant:
        a, n = self.args, self.args.new_tokens
        context = max(4096, len(self.prompt_ids) + n + 64)
        cmd = [str(server), "-m", str(gguf), "-t", str(a.threads), "-tb", str(a.threads), "-c", str(context), "-np", "1",
               "--host", "127.0.0.1"]

        def decode(port: int) -> float:
            body = {"prompt": self.prompt_ids, "n_predict": n, "temperature": 0, "ignore_eos": True,
                    "cache_prompt": False, "stream": True}
            return decode_rate(post_stream(port, "/completion", body, is_llama_token))

        def prefill(port: int, ids: list[int]) -> float:
            return post_wall_s(port, "/completion", {"prompt": ids, "n_predict": 1, "temperature": 0,
                                                     "cache_prompt": False})

        return self.server(Row("llama.cpp llama-server", weights), cmd, env, "/health", decode, prefill)

    def in_process(self, model, packed, hf) -> list[Contestant]:
        import torch
        from transformers.generation.streamers import BaseStreamer

        from attnlens.model import SamplingParams, generate_tokens

        n = self.args.new_tokens

        class Arrivals(BaseStreamer):
            def __init__(self):
                self.times: list[float] = []

            def put(self, value):  # the prompt first, then one call per new token
                self.times.append(time.perf_counter())

            def end(self):
                pass

        def hf_decode() -> float:
            x = torch.tensor([self.prompt_ids])
            streamer = Arrivals()
            with torch.inference_mode():
                hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                            pad_token_id=0, streamer=streamer)
            return decode_rate(streamer.times[1:])

        def hf_prefill(ids: list[int]) -> float:
            t0 = time.perf_counter()
            with torch.inference_mode():
                hf(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t0

        def ours_decode(net) -> Callable[[], float]:
            def decode() -> float:
                times = [time.perf_counter() for _ in generate_tokens(net, self.prompt_ids, n,
                                                                      SamplingParams(temperature=0.0))]
                return decode_rate(times)
            return decode

        def ours_prefill(net) -> Callable[[list[int]], float]:
            cache = net.new_kv_cache(1, paged=True)

            def prefill(ids: list[int]) -> float:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    cache.reset()
                    logits = net(torch.tensor([ids]), kv_cache=cache, rows=slice(0, 1), last_only=True).logits
                    logits.argmax(-1).item()
                return time.perf_counter() - t0
            return prefill

        return [Contestant(Row("transformers generate()", "float32"), hf_decode, hf_prefill),
                Contestant(Row("attnlens (in-process)", "float32"), ours_decode(model), ours_prefill(model)),
                Contestant(Row("attnlens (in-process)", "packed"), ours_decode(packed), ours_prefill(packed))]


def print_table(rows: list[Row], peers: list[Row], sizes: list[int]) -> None:
    def fmt(x: float | None, spec: str) -> str:
        return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)

    heads = "".join(f"{f'prefill {n} s':>15s}" for n in sizes)
    print(f"{'server':28s} {'weights':10s} {'decode tok/s':>13s}{heads} {'RSS GB':>8s} {'streams tok/s':>14s}")
    for r in rows:
        cells = "".join(f"{fmt(r.prefill_s.get(n), '15.2f')}" for n in sizes)
        print(f"{r.name:28s} {r.weights:10s} {fmt(r.decode_tok_s, '13.1f')}{cells} {fmt(r.rss_gb, '8.2f')} "
              f"{fmt(r.streams_tok_s, '14.1f')}  {r.note}")
    hf = next((r for r in rows if r.name.startswith("transformers")), None)
    for peer in peers:
        if peer.decode_tok_s is None:
            continue
        print(f"\nratios to llama.cpp {peer.weights} (decode: ours / theirs, higher is better; prefill: theirs / ours, "
              f"higher is better; RSS: ours / theirs)")
        for r in rows:
            if r is peer or r.decode_tok_s is None:
                continue
            rss = f"{r.rss_gb / peer.rss_gb:6.2f}x" if r.rss_gb and peer.rss_gb else "     -"
            pre = "  ".join(f"{n}: {peer.prefill_s[n] / r.prefill_s[n]:5.2f}x" for n in sizes
                            if n in peer.prefill_s and n in r.prefill_s)
            print(f"  {r.name + ' ' + r.weights:40s} decode {r.decode_tok_s / peer.decode_tok_s:5.2f}x   "
                  f"prefill {pre}   RSS {rss}")
    if hf is not None and hf.prefill_s:
        print("\nprefill against transformers' forward (theirs / ours: 1.00x or more is no slower)")
        for r in rows:
            if r is not hf and r.prefill_s and not r.name.startswith("llama.cpp"):
                pre = "  ".join(f"{n}: {hf.prefill_s[n] / r.prefill_s[n]:5.2f}x" for n in sizes if n in r.prefill_s)
                print(f"  {r.name + ' ' + r.weights:40s} {pre}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="threads on every side (default 2)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill", type=int, nargs="+", default=[512, 2048], help="prompt lengths of the prefill cases")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--streams", type=int, default=16, help="generations at once for attnlens over HTTP (0: none)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (no build)")
    p.add_argument("--malloc-defaults", action="store_true",
                   help="glibc's malloc thresholds in this process (in-process rows) and the servers")
    p.add_argument("--decode-after", type=int, default=0,
                   help="decode after a prompt of this many tokens (the long text) instead of the short prompt")
    args = p.parse_args(argv)

    import torch
    import transformers

    from attnlens.model import load_checkpoint
    from attnlens.model.interop.packaged import SMOLLM2, ensure_checkpoint, locate

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    from attnlens.app.engine.allocator import retain_freed_memory
    from attnlens.app.server.settings import Settings

    retain = 0 if args.malloc_defaults else Settings.model_fields["malloc_retain_bytes"].default
    retained = retain_freed_memory(retain)
    found = locate(SMOLLM2)
    if found is None:
        raise SystemExit(f"{SMOLLM2.distribution} is not installed: make install-dev installs it")
    gguf, dist_version = found
    ckpt_dir = ensure_checkpoint(SMOLLM2, progress=False)
    ours = load_checkpoint(ckpt_dir)
    tok = ours.tokenizer
    prompt_ids = tok.encode(PROMPT)
    piece = tok.encode(LONG_TEXT)
    long_ids = {n: (piece * (n // len(piece) + 1))[:n] for n in args.prefill}
    if args.decode_after:  # decode at a long context: every row reads this many keys a step
        prompt_ids = (piece * (args.decode_after // len(piece) + 1))[:args.decode_after]

    llama, why = (None, "--no-llama-cpp") if args.no_llama_cpp else ensure_llama_cpp()
    print(f"model     SmolLM2-135M-Instruct ({SMOLLM2.distribution} {dist_version}: {gguf.name})")
    print(f"runtime   torch {torch.__version__}, transformers {transformers.__version__}, "
          f"llama.cpp {'b' + llama.version.split('.')[0] if llama else 'skipped: ' + why}")
    print(f"setting   {args.threads} thread(s) each, {args.new_tokens} greedy tokens after a {len(prompt_ids)}-token "
          f"prompt, prefills of {' and '.join(map(str, long_ids))} tokens, median of {args.reps} after 1 warm-up; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"malloc    {'thresholds set: ' + str(retain >> 20) + ' MiB kept (as the server)' if retained else 'glibc defaults'}"
          f" in this process; the attnlens servers {'likewise' if retained else 'with MALLOC_RETAIN_BYTES=0'}\n")

    measure = Measure(args, prompt_ids, long_ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    packed = load_checkpoint(ckpt_dir, packed=True).model
    contestants = measure.in_process(ours.model, packed, hf)
    contestants.append(measure.attnlens_http(ckpt_dir, "float32", "float32"))
    contestants.append(measure.attnlens_http(ckpt_dir, "packed", "packed"))
    if llama is not None:
        for path, weights in ((f32_gguf(llama, gguf), "F32"), (gguf, "Q4_1")):
            contestants.append(measure.llama_server(llama.server, llama.env(), path, weights))
    try:
        measure.rounds(contestants)
    finally:
        for c in contestants:
            if c.proc is not None:
                stop(c.proc)
    rows = [c.row for c in contestants]
    peers = [r for r in rows if r.name.startswith("llama.cpp")]
    print_table(rows, peers, args.prefill)
    if llama is None:
        print(f"\nllama.cpp skipped: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""SmolLM2-135M-Instruct on the CPU beside llama.cpp, measured as a user sees it (issues 34 and 50):
whole requests over HTTP to the default `attnlens serve` and to llama.cpp's `llama-server`, the
same threads each, one stream and many at once.

    .venv/bin/python bench/bench_peers.py                                   # 2 threads, 128 tokens, 1/16/64 streams, 3 reps
    .venv/bin/python bench/bench_peers.py --new-tokens 32 --reps 1 --streams 1 16   # a quick check
    .venv/bin/python bench/bench_peers.py --prefill 512 2048 --in-process   # the issue-34 diagnostics too

Servers, each with --threads threads, started first and idle while the others are measured:

* attnlens, the real server (`python -m attnlens.app.cli serve`, the converted checkpoint,
  OMP_NUM_THREADS=threads, every other setting its default), float32 (ATTNLENS_DTYPE=float32)
  and packed (the default: the file's own Q4_1 / Q8_0 blocks); one server each serves every level;
* llama.cpp `llama-server` on the packaged GGUF as shipped (Q4_1 blocks, a Q8_0 token embedding)
  and on the same file requantized to F32 (`llama-quantize --allow-requantize in out F32`), one
  server per level with `-np` = the streams of that level (continuous batching, its default) and a
  context of `-np` x (the longest prompt + the tokens + 64) so every slot holds its request.
  llama.cpp is built once into a cache (bench/llama_cpp_build.py); when it cannot be built its rows
  are skipped with the reason.

The pairs are attnlens float32 / llama.cpp F32 and attnlens packed / llama.cpp Q4_1. At each level
(--streams: 1, 16, 64 at once) both sides get the same requests: streamed `POST /generate` with the
prompt's token ids against streamed `POST /completion` with the same ids, greedy (temperature 0),
`cache_prompt: false` (attnlens keeps no prompt cache either); the streams of a level have
different prompts (a story's subject and place). The figure is the user's: the tokens of every
answer (as each server counts them) over the wall time from sending the first request to the
end of the last answer: prefill, first token, hand-over, SSE and HTTP included. --no-stream sends
whole non-streamed requests instead.

Token counts match: attnlens over HTTP stops at an EOS, llama.cpp is told `ignore_eos` and, per
prompt, `n_predict` = the tokens attnlens generated for that prompt in the warm-up (greedy: the
same every time; the prompts run past --new-tokens, so both generate N, and the table says when not).

Diagnostics (not the goal's figures): at one stream the decode-only rate (the tokens after the
first over the time from the first to the last, prefill excluded; what this benchmark reported
before issue 50) and the time to the first token; at many, the median time to the first token.
--prefill N...: the wall time of a request with an N-token prompt and one new token (llama.cpp's
one-slot server). --in-process: transformers `generate()` and attnlens `generate_tokens` in this
process, decode-only rates. The servers' RSS (attnlens: its engine process included) is read at the end.

Rows take turns (never two at once): after one warm-up of everything, each repetition runs every
level, and at each level every pair, attnlens and llama.cpp alternating which goes first, so a
shared machine's drift falls on both sides alike. Medians of --reps. The load average is printed
before and after.

Memory: this process sets glibc's malloc thresholds as the server sets them in its processes
(ATTNLENS_MALLOC_RETAIN_BYTES, app/engine/allocator.py) for the in-process rows; --malloc-defaults
keeps glibc's defaults here and in the attnlens servers.
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
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
from peer_client import Answer, run_all  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea. Once upon a time,"
WHO = ["a lighthouse keeper", "a young baker", "an old sailor", "a clockmaker", "a street musician", "a shepherd",
       "a night-train driver", "a beekeeper"]
WHERE = ["and the sea", "in a mountain village", "in a city of canals", "on a frozen lake", "in the desert",
         "on a small island", "in a forest of oaks", "by a great river"]
LONG_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
             "movable metal type, oil-based ink and a wooden press adapted from those used for wine. ")
MODES = (("float32", "F32"), ("packed", "Q4_1"))  # attnlens' weights and llama.cpp's beside them


def story_prompts(n: int) -> list[str]:
    """n different prompts that SmolLM2 continues for a long while (the first is PROMPT)."""
    texts = [f"Write a long story about {who} {where}. Once upon a time," for where in WHERE for who in WHO]
    texts.remove(PROMPT)
    return [PROMPT, *texts][:n] if n <= len(texts) + 1 else [PROMPT, *texts] * (n // len(texts) + 1)


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


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and of its descendants (attnlens' engine process), from Linux /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        children = [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except (OSError, ValueError, IndexError):
        return 0.0
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(tree_cpu_seconds(c) for c in children)


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


@dataclass
class Server:
    """One server process: attnlens (every level) or llama-server (`slots` = its -np)."""

    side: str  # "attnlens" | "llama.cpp"
    mode: str  # "float32" | "packed": the pair it belongs to
    weights: str
    slots: int = 0  # llama-server's -np (0: attnlens)
    proc: subprocess.Popen | None = None
    port: int = 0
    note: str = ""
    rss_gb: float | None = None

    @property
    def path(self) -> str:
        return "/completion" if self.side == "llama.cpp" else "/generate"

    def start(self, cmd: list[str], env: dict[str, str], ready: str) -> None:
        self.port = free_port()
        with tempfile.NamedTemporaryFile(suffix=".log", delete=False) as f:
            log = Path(f.name)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], cwd=REPO_ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT)
        try:
            wait_ready(self.proc, self.port, ready, log)
        except RuntimeError as e:
            self.note = str(e).splitlines()[0][:120]
            stop(self.proc)
            self.proc = None

    def body(self, ids: list[int], n: int, stream: bool) -> dict:
        if self.side == "llama.cpp":
            return {"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                    "stream": stream}
        return {"ids": ids, "max_new_tokens": n, "temperature": 0, "stream": stream}


def attnlens_server(args, ckpt_dir: Path, mode: str) -> Server:
    env = {**os.environ, "ATTNLENS_DEVICE": "cpu", "ATTNLENS_DTYPE": mode, "OMP_NUM_THREADS": str(args.threads),
           **({"ATTNLENS_MALLOC_RETAIN_BYTES": "0"} if args.malloc_defaults else {}),
           "MKL_NUM_THREADS": str(args.threads), "ATTNLENS_LOG_LEVEL": "warning",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    s = Server("attnlens", mode, mode)
    s.start([sys.executable, "-m", "attnlens.app.cli", "serve", "--model", str(ckpt_dir), "--host", "127.0.0.1"],
            env, "/readyz")
    return s


def llama_server(args, llama, gguf: Path, mode: str, weights: str, slots: int, per_slot: int) -> Server:
    context = slots * (-(-per_slot // 256) * 256)  # every slot holds its request (whole 256-token steps)
    s = Server("llama.cpp", mode, weights, slots)
    s.start([str(llama.server), "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads), "-c",
             str(context), "-np", str(slots), "--host", "127.0.0.1"], llama.env(), "/health")
    return s


# --- the measurements ----------------------------------------------------------
@dataclass
class Figures:
    """One server at one level: each repetition's figures (medians are printed)."""

    tok_s: list[float] = field(default_factory=list)  # every answer's tokens / the level's wall time
    decode_tok_s: list[float] = field(default_factory=list)  # one stream: decode-only (diagnostic)
    first_token_ms: list[float] = field(default_factory=list)  # median over the level's streams
    cpu_tok_s: list[float] = field(default_factory=list)  # tokens per CPU-second of the server's processes
    tokens: int = 0  # of one round, as the server counted them

    def add(self, answers: list[Answer], wall: float, cpu: float) -> None:
        self.tokens = sum(a.tokens for a in answers)
        if cpu > 0:
            self.cpu_tok_s.append(self.tokens / cpu)
        self.tok_s.append(self.tokens / wall)
        firsts = [a.first_token_s for a in answers if a.first_token_s is not None]
        if firsts:
            self.first_token_ms.append(1000 * statistics.median(firsts))
        if len(answers) == 1 and len(answers[0].arrivals) > 1:
            times = answers[0].arrivals
            self.decode_tok_s.append((len(times) - 1) / (times[-1] - times[0]))


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


class Bench:
    def __init__(self, args, prompts: list[list[int]]):
        self.args, self.prompts = args, prompts
        self.counts: dict[str, dict[int, int]] = {}  # mode -> prompt -> the tokens attnlens generated for it
        self.figures: dict[tuple[int, str, str], Figures] = {}  # (level, mode, side)
        self.prefills: dict[tuple[int, str, str], list[float]] = {}  # (prompt tokens, mode, side) -> seconds

    def bodies(self, s: Server, level: int) -> list[dict]:
        n, stream = self.args.new_tokens, not self.args.no_stream
        if s.side == "llama.cpp":  # attnlens' own count for each prompt (module docstring)
            counts = self.counts[s.mode]
            return [s.body(ids, counts.get(i, n), stream) for i, ids in enumerate(self.prompts[:level])]
        return [s.body(ids, n, stream) for ids in self.prompts[:level]]

    def run(self, s: Server, level: int, record: bool = True) -> None:
        pid = s.proc.pid if s.proc is not None else 0
        cpu0 = tree_cpu_seconds(pid)
        answers, wall = run_all(s.port, s.path, self.bodies(s, level))
        cpu = tree_cpu_seconds(pid) - cpu0
        failed = [a.error for a in answers if a.error]
        if failed:
            raise RuntimeError(f"{s.side} {s.weights}, {level} streams: {failed[0]}")
        if s.side == "attnlens":
            self.counts.setdefault(s.mode, {}).update(enumerate(a.tokens for a in answers))
        tokens = sum(a.tokens for a in answers)
        print(f"  {'' if record else '(warm-up) '}{level:3d} streams  {s.side:9s} {s.weights:8s} {tokens:6d} tokens in "
              f"{wall:6.2f} s = {tokens / wall:7.1f} tok/s, {cpu:6.1f} CPU-s   load {os.getloadavg()[0]:.2f}", flush=True)
        if record:
            self.figures.setdefault((level, s.mode, s.side), Figures()).add(answers, wall, cpu)

    def prefill(self, s: Server, ids: list[int]) -> float:
        body = s.body(ids, 1, False)
        answers, wall = run_all(s.port, s.path, [body])
        if answers[0].error:
            raise RuntimeError(f"{s.side} {s.weights}, prefill of {len(ids)}: {answers[0].error}")
        return wall

    def rounds(self, pairs: dict[tuple[int, str], list[Server]], long_ids: dict[int, list[int]],
               one_slot: dict[str, list[Server]]) -> None:
        """One warm-up of everything (attnlens first: its token counts), then --reps rounds: every level,
        every pair, the two sides alternating which goes first; then the prefills in turn."""
        levels = sorted({level for level, _ in pairs})
        for side in ("attnlens", "llama.cpp"):
            for (level, _), servers in pairs.items():
                for s in servers:
                    if s.side == side:
                        self.run(s, level, record=False)
        for rep in range(self.args.reps):
            for level in levels:
                for mode, _ in MODES:
                    servers = pairs.get((level, mode), [])
                    for s in servers if rep % 2 == 0 else servers[::-1]:
                        self.run(s, level)
            for n, ids in long_ids.items():
                for mode, servers in one_slot.items():
                    for s in servers:
                        if rep == 0:
                            self.prefill(s, ids)  # its warm-up
                        self.prefills.setdefault((n, mode, s.side), []).append(self.prefill(s, ids))


# --- in this process (diagnostics) ------------------------------------------------
def in_process_rates(args, prompt_ids: list[int], ckpt_dir: Path, gguf: Path) -> dict[str, float]:
    """Decode-only tok/s of transformers generate() (float32) and attnlens generate_tokens (float32,
    packed) in this process, in turns, medians of --reps after one warm-up."""
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    from attnlens.model import SamplingParams, generate_tokens, load_checkpoint

    n = args.new_tokens

    class Arrivals(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):  # the prompt first, then one call per new token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def rate(times: list[float]) -> float:
        return (len(times) - 1) / (times[-1] - times[0])

    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()

    def hf_decode() -> float:
        x = torch.tensor([prompt_ids])
        streamer = Arrivals()
        with torch.inference_mode():
            hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                        pad_token_id=0, streamer=streamer)
        return rate(streamer.times[1:])

    def ours(net) -> Callable[[], float]:
        return lambda: rate([time.perf_counter() for _ in generate_tokens(net, prompt_ids, n,
                                                                           SamplingParams(temperature=0.0))])

    rows = {"transformers generate() float32": hf_decode,
            "attnlens generate_tokens float32": ours(load_checkpoint(ckpt_dir).model),
            "attnlens generate_tokens packed": ours(load_checkpoint(ckpt_dir, packed=True).model)}
    rates: dict[str, list[float]] = {name: [] for name in rows}
    for name, fn in rows.items():
        fn()
    for _ in range(args.reps):
        for name, fn in rows.items():
            rates[name].append(fn())
    return {name: statistics.median(r) for name, r in rates.items()}


# --- the table -------------------------------------------------------------------
def fmt(x: float | None, spec: str) -> str:
    return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)


def pair(ours: list[float], theirs: list[float], spec: str = "6.1f") -> str:
    """"ours/theirs = ratio" of two medians (the ratio of the medians)."""
    a, b = median(ours), median(theirs)
    text = f"{fmt(a, spec)}/{fmt(b, spec)}"
    return text + (f" = {a / b:4.2f}x" if a and b else "        ")


def print_table(bench: Bench, levels: list[int], servers: list[Server]) -> None:
    stream = "streamed" if not bench.args.no_stream else "whole (non-streamed)"
    print(f"\nwhole requests over HTTP, {stream}: every answer's tokens / the wall time of the level (medians; "
          f"each repetition's ratio, the two sides measured back to back, in brackets)")
    print(f"{'streams':>7s}  {'weights':14s} {'attnlens tok/s':>14s} {'llama.cpp tok/s':>15s} {'ratio':>7s} "
          f"{'(each rep)':>18s}  {'tokens':>11s}  {'first token ms':>16s}  {'tok per CPU-s (diag.)':>24s}  "
          f"{'decode-only tok/s (diag.)':>25s}")
    for level in levels:
        for mode, theirs in MODES:
            ours_f = bench.figures.get((level, mode, "attnlens"))
            peer_f = bench.figures.get((level, mode, "llama.cpp")) or Figures()
            if ours_f is None:
                continue
            a, b = median(ours_f.tok_s), median(peer_f.tok_s)
            ratio = f"{a / b:6.2f}x" if a and b else "      -"
            reps = ",".join(f"{x / y:.2f}" for x, y in zip(ours_f.tok_s, peer_f.tok_s))
            tokens = f"{ours_f.tokens}/{peer_f.tokens or '-'}"
            first = f"{fmt(median(ours_f.first_token_ms), '7.0f')}/{fmt(median(peer_f.first_token_ms), '7.0f')}"
            decode = pair(ours_f.decode_tok_s, peer_f.decode_tok_s) if level == 1 else ""
            print(f"{level:7d}  {mode + ' / ' + theirs:14s} {fmt(a, '14.1f')} {fmt(b, '15.1f')} {ratio} "
                  f"{'(' + reps + ')':>18s}  {tokens:>11s}  {first:>16s}  "
                  f"{pair(ours_f.cpu_tok_s, peer_f.cpu_tok_s):>24s}  {decode:>25s}")
    print("(tokens: one round's; first token, tokens per CPU-second of the server's processes and decode-only: "
          "attnlens/llama.cpp)")
    if bench.prefills:
        print("\nprefill: one request, an N-token prompt and one new token, wall seconds (llama.cpp: -np 1)")
        for (n, mode, side), xs in sorted(bench.prefills.items()):
            print(f"  {n:6d} tokens  {mode:8s} {side:10s} {statistics.median(xs):7.2f} s")
    print("\nRSS of each server (attnlens: its engine process included)")
    for s in servers:
        where = f"-np {s.slots}" if s.slots else "every level"
        print(f"  {s.side:10s} {s.weights:8s} {where:12s} {fmt(s.rss_gb, '6.2f')} GB  {s.note}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="threads on every side (default 2)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64], help="levels: requests at once")
    p.add_argument("--modes", nargs="+", default=[m for m, _ in MODES], choices=[m for m, _ in MODES])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-stream", action="store_true", help="whole non-streamed requests instead of SSE streams")
    p.add_argument("--prefill", type=int, nargs="*", default=[], help="prompt lengths of prefill cases (diagnostic)")
    p.add_argument("--in-process", action="store_true", help="transformers and attnlens in this process (diagnostic)")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (no build)")
    p.add_argument("--malloc-defaults", action="store_true",
                   help="glibc's malloc thresholds in this process (in-process rows) and the attnlens servers")
    p.add_argument("--decode-after", type=int, default=0,
                   help="every prompt is this many tokens of the long text instead of a story's start")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still stops its servers (finally)

    import torch

    from attnlens.app.engine.allocator import retain_freed_memory
    from attnlens.app.server.settings import Settings
    from attnlens.model.interop.packaged import SMOLLM2, ensure_checkpoint, locate
    from attnlens.model.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    retained = retain_freed_memory(0 if args.malloc_defaults else Settings.model_fields["malloc_retain_bytes"].default)
    found = locate(SMOLLM2)
    if found is None:
        raise SystemExit(f"{SMOLLM2.distribution} is not installed: make install-dev installs it")
    gguf, dist_version = found
    ckpt_dir = ensure_checkpoint(SMOLLM2, progress=False)
    tok = Tokenizer.from_dir(ckpt_dir)
    levels = sorted(set(args.streams))
    prompts = [tok.encode(text) for text in story_prompts(max(levels))]
    piece = tok.encode(LONG_TEXT)
    if args.decode_after:  # decode at a long context: every row reads this many keys a step
        prompts = [(piece * (args.decode_after // len(piece) + 1))[i:i + args.decode_after] for i in range(len(prompts))]
    long_ids = {n: (piece * (n // len(piece) + 1))[:n] for n in args.prefill}

    llama, why = (None, "--no-llama-cpp") if args.no_llama_cpp else ensure_llama_cpp()
    print(f"model     SmolLM2-135M-Instruct ({SMOLLM2.distribution} {dist_version}: {gguf.name})")
    print(f"runtime   torch {torch.__version__}, llama.cpp {'b' + llama.version.split('.')[0] if llama else 'skipped: ' + why}")
    print(f"setting   {args.threads} thread(s) each, {args.new_tokens} greedy tokens a request, "
          f"{'/'.join(map(str, levels))} requests at once, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, median of {args.reps} after 1 warm-up")
    print(f"malloc    {'thresholds set' if retained else 'glibc defaults'} in this process; the attnlens servers "
          f"{'likewise' if retained else 'with MALLOC_RETAIN_BYTES=0'}")
    print(f"load      {' '.join(f'{x:.2f}' for x in os.getloadavg())} (before)\n", flush=True)

    per_slot = max(map(len, prompts)) + args.new_tokens + 64
    servers: list[Server] = []
    pairs: dict[tuple[int, str], list[Server]] = {}
    one_slot: dict[str, list[Server]] = {}
    try:
        for mode, theirs in MODES:
            if mode not in args.modes:
                continue
            ours = attnlens_server(args, ckpt_dir, mode)
            servers.append(ours)
            one_slot[mode] = [ours]
            for level in levels:
                pairs[(level, mode)] = [ours]
            if llama is None:
                continue
            path = f32_gguf(llama, gguf) if theirs == "F32" else gguf
            for level in levels:
                size = max(per_slot, max(args.prefill, default=0) + 64) if level == 1 else per_slot
                peer = llama_server(args, llama, path, mode, theirs, level, size)
                servers.append(peer)
                if peer.proc is not None:
                    pairs[(level, mode)].append(peer)
                    if level == 1:
                        one_slot[mode].append(peer)
        bench = Bench(args, prompts)
        bench.rounds(pairs, long_ids, one_slot)
        for s in servers:
            if s.proc is not None:
                s.rss_gb = tree_rss_bytes(s.proc.pid) / 1e9
    finally:
        for s in servers:
            if s.proc is not None:
                stop(s.proc)
    print_table(bench, levels, servers)
    if args.in_process:
        print("\nin this process, decode-only tok/s after the first prompt (diagnostic)")
        for name, rate in in_process_rates(args, prompts[0], ckpt_dir, gguf).items():
            print(f"  {name:36s} {rate:7.1f}")
    print(f"\nload      {' '.join(f'{x:.2f}' for x in os.getloadavg())} (after)")
    if llama is None:
        print(f"llama.cpp skipped: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 50: a soak of `attnlens serve` on the default models (CPU) under mixed load for --minutes,
its memory, its answers and anything lost.

    .venv/bin/python bench/soak.py --minutes 20     # the documented run (docs/performance.md)
    .venv/bin/python bench/soak.py --minutes 3      # a short check

The load, all at once for the whole run, on SmolLM2-135M-Instruct (the default model):

* --streams (8) chat streams without pause: POST /v1/chat/completions with stream true, varied
  prompts, max_tokens 64-200, sampled with a seed;
* an overview every minute (or right after the last one, when it took longer): POST /attention
  on an --overview-tokens (8,192) token prompt, pooled 64 x 64, every layer and head, f16, each
  time from another offset of a long text (the engine keeps the last one's queries and keys);
* now and then (every --explain-s, 30 s, in turns): /lens on a short prompt (16 positions) and
  /patch on the IOI pair of docs/explain.md (component heads; exact, or attribution);
* clients that leave mid-answer: one stream in --leave-every (6) is closed after a few chunks,
  and every third overview and patch is closed before its answer;
* one SIGKILL of SmolLM2's engine process at --kill-at (0.4) of the minutes: its streams end with
  the engine_restarting error event and the supervisor starts a new one.

Every 5 s: RSS of the server and of each engine process. Every minute: RSS and PSS of each, the
lowest, highest and median RSS of the minute's 5-s samples, every answer's status so far, the
requests in flight. After the run no new request is sent. The goals (exit status 1 when one fails):

* memory: at the end at most 5% over memory after the first minute, per process and in total. An
  engine's RSS swings by a third from one sample to the next under this load (the KV blocks in
  use, the freed memory it keeps for the next forward: ATTNLENS_MALLOC_RETAIN_BYTES), so a single
  sample at each end compares a peak with a trough; the goal compares like with like: the median
  of every 5-s sample of the last --span-minutes (3) against the median of the --span-minutes
  after the first minute, each process's own samples (its pid). The minutes are counted from the
  first overview's answer (a warm-up: until then the engine process had not yet made an 8k
  overview), and the killed engine's new process is held to the span after its own first
  minute after its first overview;
* no 5xx, and no stream that ends with an error, except the requests the killed engine held
  (a 503 or the error event, code engine_restarting);
* nothing lost: every request sent was answered (within --timeout-s, 30 min, between two bytes),
  or ended by its client on purpose; the requests still in flight --drain-s (300 s) after the
  run are closed by their clients, and then the server must hold no generation and no attention
  request; and the server answered /healthz within 10 s every minute.

The results (every minute's figures, the counts, the goals) are written as JSON to --out
(default out/soak-<UTC time>.json, out/ being ignored by git).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_faults import Server, rss  # noqa: E402

SMOL = "smollm2-135m-instruct"
PROMPTS = ["Write a short poem about the sea.", "What is the capital of France, and why is it famous?",
           "Explain photosynthesis to a child.", "Give three tips for learning to play the guitar.",
           "Tell me a story about a lighthouse keeper.", "How do I make a cup of tea?",
           "What are the planets of the solar system?", "Describe a rainy day in a city.",
           "Why is the sky blue?", "List five fruits and their colours.",
           "Summarise the plot of Hamlet in a few sentences.", "What does a compiler do?"]
LONG_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
             "movable metal type, oil-based ink and a wooden press adapted from those used for wine. ")
IOI = {"answer": " Mary", "foil": " John", "clean": "When Mary and John went to the store, John gave a drink to",
       "corrupted": "When Mary and John went to the store, Mary gave a drink to"}
LENS_TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
RESTART_CODE = "engine_restarting"


@dataclass
class Call:
    """One request: what, when, and how it ended."""

    kind: str
    sent: float  # seconds since the start
    status: int | None = None
    outcome: str = ""  # done | error:<code> | left (its client closed it on purpose) | broken:<why>
    ended: float | None = None
    killed_engine: bool = False  # it was in flight on SmolLM2 when its engine process was killed

    def end(self, t: float, outcome: str, status: int | None = None) -> None:
        self.ended, self.outcome = t, outcome
        if status is not None:
            self.status = status


# --- memory --------------------------------------------------------------------
def pss(pid: int) -> int:
    """Proportional set size (shared pages split among their users), from smaps_rollup."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def memory(server: Server) -> dict[str, dict]:
    """RSS and PSS (MB) of the server and of each model's engine process, with their pids."""
    procs = {"server": server.proc.pid, **{f"engine {name}": pid for name, pid in server.engine_pids().items()}}
    out = {}
    for role, pid in procs.items():
        try:
            out[role] = {"pid": pid, "rss_mb": round(rss(pid) / 1e6, 1), "pss_mb": round(pss(pid) / 1e6, 1)}
        except OSError:  # it ended between the log and /proc
            pass
    return out


# --- the load ------------------------------------------------------------------
class Soak:
    def __init__(self, server: Server, args, overview_ids: list[int]):
        self.server, self.args, self.overview_ids = server, args, overview_ids
        self.calls: list[Call] = []
        self.t0 = time.monotonic()
        self.stopping = asyncio.Event()
        self.warm = asyncio.Event()  # the first overview was answered: the minutes are counted from then
        self.t_warm = 0.0
        self.rng = random.Random(args.seed)
        self.minutes: list[dict] = []
        self.samples: list[dict] = []  # every 5 s once warm: {"t_s", "rss_mb": {role: [pid, MB]}}
        self.kill: dict = {}
        self.unanswered: list[float] = []  # when the server did not answer /healthz (seconds)
        self.client = httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(args.timeout_s, connect=30),
                                        limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def begin(self, kind: str) -> Call:
        call = Call(kind, round(self.now(), 2))
        self.calls.append(call)
        return call

    async def pause(self, seconds: float) -> bool:
        """Sleep unless the run ends first; False once it has ended."""
        try:
            await asyncio.wait_for(self.stopping.wait(), seconds)
            return False
        except asyncio.TimeoutError:
            return True

    # --- streams ---
    async def streams(self, i: int) -> None:
        n = 0
        while not self.stopping.is_set():
            n += 1
            leave = self.rng.randint(1, 12) if n % self.args.leave_every == i % self.args.leave_every else None
            await self.chat_stream(leave)

    async def chat_stream(self, leave_after: int | None) -> None:
        """One chat stream, read to its end, or closed after `leave_after` chunks."""
        call = self.begin("chat stream" + (" (left)" if leave_after else ""))
        body = {"model": SMOL, "messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}],
                "max_tokens": self.rng.randint(64, 200), "stream": True, "seed": self.rng.randint(0, 10**6)}
        try:
            async with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
                call.status = r.status_code
                if r.status_code != 200:
                    await r.aread()
                    call.end(self.now(), f"error:{error_code(r.content)}")
                    return
                outcome = await self.read_stream(r, leave_after)
                call.end(self.now(), outcome)
        except httpx.HTTPError as e:
            call.end(self.now(), f"broken:{type(e).__name__}")

    async def read_stream(self, r: httpx.Response, leave_after: int | None) -> str:
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done"
            data = json.loads(line[6:])
            if "error" in data:
                return f"error:{data['error'].get('code')}"
            chunks += 1
            if leave_after and chunks >= leave_after:
                return "left"  # leaving the block closes the connection mid-answer
        return "broken:no [DONE]"

    # --- model calls ---
    async def post(self, kind: str, path: str, body: dict, leave_after_s: float | None = None) -> Call:
        """A plain POST, answered in full, or left after `leave_after_s` (the connection is closed)."""
        call = self.begin(kind + (" (left)" if leave_after_s else ""))
        try:
            r = await asyncio.wait_for(self.client.post(path, json=body), leave_after_s)
        except asyncio.TimeoutError:
            call.end(self.now(), "left")
        except httpx.HTTPError as e:
            call.end(self.now(), f"broken:{type(e).__name__}")
        else:
            call.end(self.now(), "done" if r.status_code < 400 else f"error:{error_code(r.content)}", r.status_code)
        return call

    async def overviews(self) -> None:
        """Every minute (or right after the last one, if it took longer), the 8k overview."""
        n = 0
        while not self.stopping.is_set():
            n += 1
            start = time.monotonic()
            # another offset each time, a new prompt (the engine keeps the last one's queries and keys)
            shift = n * 97 % (len(self.overview_ids) - self.args.overview_tokens)
            ids = self.overview_ids[shift:shift + self.args.overview_tokens]
            body = {"model": SMOL, "ids": ids, "pool": 64, "format": "f16"}
            self.note_warm(await self.post("overview 8k", "/attention", body,
                                           leave_after_s=5.0 if n % 3 == 0 else None))
            if not await self.pause(max(0.0, 60 - (time.monotonic() - start))):
                return

    def note_warm(self, call: Call) -> None:
        """An overview answered warms SmolLM2's engine process: the first, the server's run; the
        first sent to a restarted engine process, that process."""
        if call.status != 200:
            return
        if not self.warm.is_set():
            self.t_warm = self.now()
            self.warm.set()
        elif "ready_at_s" in self.kill and "warm_at_s" not in self.kill and call.sent >= self.kill["ready_at_s"]:
            self.kill["warm_at_s"] = round(self.now(), 1)

    async def explain(self) -> None:
        """/lens and /patch in turns, every --explain-s; every third patch is left early."""
        n = 0
        while await self.pause(self.args.explain_s if n else 5):
            n += 1
            if n % 2:
                await self.post("lens", "/lens", {"model": SMOL, "text": LENS_TEXT, "top_k": 3,
                                                  "positions": list(range(16))})
            else:
                method = "attribution" if n % 4 == 0 else "exact"
                await self.post(f"patch {method}", "/patch", {"model": SMOL, **IOI, "method": method},
                                leave_after_s=2.0 if n % 6 == 2 else None)

    # --- the kill ---
    async def killer(self) -> None:
        await self.warm.wait()
        if not await self.pause(self.args.kill_at * self.args.minutes * 60):
            return
        pid = self.server.engine_pids()[SMOL]
        for call in self.calls:  # what SmolLM2's engine holds now (every load here is on SmolLM2)
            if call.ended is None:
                call.killed_engine = True
        os.kill(pid, signal.SIGKILL)
        self.kill = {"pid": pid, "at_s": round(self.now(), 1),
                     "in_flight": sum(c.killed_engine for c in self.calls)}
        tqdm.write(f"{self.now():7.1f} s  SIGKILL to SmolLM2's engine process {pid} "
                   f"({self.kill['in_flight']} requests in flight)")
        while self.server.engine_pids().get(SMOL) in (None, pid) or not await self.ready():
            await asyncio.sleep(0.2)
        self.kill.update(new_pid=self.server.engine_pids()[SMOL], ready_at_s=round(self.now(), 1),
                         ready_after_s=round(self.now() - self.kill["at_s"], 1))
        tqdm.write(f"{self.now():7.1f} s  SmolLM2 answers again ({self.kill['ready_after_s']} s after the kill)")

    async def ready(self) -> bool:
        r = await self.client.get("/readyz")
        model = r.json().get("models", {}).get(SMOL, {})
        return r.status_code == 200 and model.get("state") == "running"

    # --- every minute ---
    def statuses(self) -> dict[str, int]:
        return dict(sorted(Counter(f"{c.kind}: {c.status} {c.outcome}" for c in self.calls
                                   if c.ended is not None).items()))

    async def probe(self) -> float | None:
        """The server answers /healthz within 10 s: its time (ms), or None (noted as a failure)."""
        t = time.monotonic()
        try:
            ok = (await self.client.get("/healthz", timeout=10)).status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            self.unanswered.append(round(self.now(), 1))
            tqdm.write(f"{self.now():7.1f} s  the server did not answer /healthz within 10 s")
        return round((time.monotonic() - t) * 1000, 1) if ok else None

    def sample(self, minute: int, healthz_ms: float | None) -> None:
        mem = memory(self.server)
        in_flight = sum(c.ended is None for c in self.calls)
        window: dict[str, list[float]] = {}  # the minute's 5-s samples, by role
        for x in self.samples:
            if x["t_s"] >= self.t_warm + (minute - 1) * 60:
                for role, (_, mb) in x["rss_mb"].items():
                    window.setdefault(role, []).append(mb)
        spread = {role: {"low": min(v), "high": max(v), "median": statistics.median(v)} for role, v in window.items()}
        self.minutes.append({"minute": minute, "t_s": round(self.now(), 1), "memory": mem,
                             "rss_minute_mb": spread, "requests": len(self.calls), "in_flight": in_flight,
                             "statuses": self.statuses(), "healthz_ms": healthz_ms})
        roles = "  ".join(f"{role.removeprefix('engine ')} {m['rss_mb']:.0f}/{m['pss_mb']:.0f}" for role, m in mem.items())
        answers = Counter(answer(c) for c in self.calls if c.ended is not None)
        tqdm.write(f"minute {minute:2d}  RSS/PSS MB: {roles}  total RSS {sum(m['rss_mb'] for m in mem.values()):.0f}"
                   f" | {len(self.calls)} sent, {in_flight} in flight, lost {len(lost(self.calls))}; answers "
                   + ", ".join(f"{k} x{n}" for k, n in sorted(answers.items())))

    def watch(self) -> None:
        """Every 5 s: each process's RSS, kept for the goal and for the minute's spread."""
        mem = memory(self.server)
        self.samples.append({"t_s": round(self.now(), 1), "rss_mb": {r: [m["pid"], m["rss_mb"]] for r, m in mem.items()}})

    async def sampler(self, bar: tqdm) -> None:
        await self.warm.wait()
        tqdm.write(f"{self.now():7.1f} s  the first overview was answered: minute 0 of the soak")
        bar.reset()
        for minute in range(1, self.args.minutes + 1):
            while self.now() < self.t_warm + minute * 60:
                bar.update(round(self.now() - self.t_warm) - bar.n)
                if round(self.now()) % 5 == 0:
                    self.watch()
                await asyncio.sleep(1)
            self.sample(minute, await self.probe())
        self.stopping.set()

    async def run(self) -> None:
        with tqdm(total=self.args.minutes * 60, unit="s", desc="soak", leave=False) as bar:
            workers = [asyncio.create_task(self.streams(i)) for i in range(self.args.streams)]
            workers += [asyncio.create_task(w) for w in (self.overviews(), self.explain(), self.killer())]
            await self.sampler(bar)
        done, pending = await asyncio.wait(workers, timeout=self.args.drain_s)
        for task in pending:  # still running after the drain: their clients leave (the server must let go)
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for call in self.calls:
            if call.ended is None:
                call.end(self.now(), "left at the end")
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # a bug in the soak itself
        await asyncio.sleep(5)  # the server lets go of what the last requests held
        try:
            metrics = (await self.client.get("/metrics", timeout=30)).text
            held, counted = in_flight(metrics), server_counts(metrics)
        except httpx.HTTPError as e:  # a server that stopped answering holds whatever it held
            held, counted = {f"no answer to /metrics ({type(e).__name__})": 1.0}, {}
        self.after = {"t_s": round(self.now(), 1), "memory": memory(self.server), "server": held,
                      "server_counted": counted}
        await self.client.aclose()


def in_flight(metrics: str) -> dict[str, float]:
    """The server's own count of generations and attention requests still running or waiting."""
    sums: Counter = Counter()
    for line in metrics.splitlines():
        for name in ("attnlens_requests_in_flight", "attnlens_queue_depth", "attnlens_attention_in_flight"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                sums[name] += float(line.split()[-1])
    return dict(sums)


def server_counts(metrics: str) -> dict[str, int]:
    """The server's answers by route and status (attnlens_http_requests_total; 499: its client left)."""
    counts: Counter = Counter()
    for line in metrics.splitlines():
        if line.startswith("attnlens_http_requests_total{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            route, status = labels.get("route", "?").strip('"'), labels.get("status", "?").strip('"')
            if route not in ("/metrics", "/readyz"):
                counts[f"{route} {status}"] += int(float(line.split()[-1]))
    return dict(sorted(counts.items()))


def lost(calls: list[Call]) -> list[Call]:
    """Sent and never answered, or ended without its end (a connection broken, not closed by its client)."""
    return [c for c in calls if c.outcome.startswith("broken")]


def answer(call: Call) -> str:
    """A call's status, its outcome when it is not plainly done."""
    if call.outcome == "left":
        return "left"
    return f"{call.status}" if call.outcome == "done" else f"{call.status} {call.outcome}"


def error_code(content: bytes) -> str:
    try:
        data = json.loads(content)
    except ValueError:
        return "?"
    return str(data.get("code") or (data.get("error") or {}).get("code") or data.get("detail", "?"))[:60]


# --- the goals -------------------------------------------------------------------
def span_median(samples: list[dict], role: str, pid: int, start_s: float, end_s: float) -> float | None:
    """The median of process `pid`'s RSS samples (in role `role`) from start_s to end_s."""
    v = [x["rss_mb"][role][1] for x in samples
         if start_s <= x["t_s"] < end_s and x["rss_mb"].get(role, [None])[0] == pid]
    return statistics.median(v) if v else None


def memory_goals(samples: list[dict], t_warm: float, kill: dict, span_s: float, limit: float = 1.05) -> dict:
    """Per process (by role: the server, each model's engine) and in total: the median RSS of the
    last span_s against the median of the span_s after the first minute, at most `limit` times it
    (the module docstring). The minute is counted from t_warm (the first overview's answer); a
    restarted engine process's from its own first overview (kill["warm_at_s"])."""
    out = {}
    end = samples[-1]
    for role, (pid, _) in end["rss_mb"].items():
        warm = kill["warm_at_s"] if pid == kill.get("new_pid") and "warm_at_s" in kill else t_warm
        first = span_median(samples, role, pid, warm + 60, warm + 60 + span_s)
        last = span_median(samples, role, pid, end["t_s"] - span_s, end["t_s"] + 1)
        if first is None or last is None:  # a restart too near the end to have a span of its own
            continue
        out[role] = {"pid": pid, "first_mb": round(first, 1), "last_mb": round(last, 1)}
    out["total"] = {"first_mb": round(sum(r["first_mb"] for r in out.values()), 1),
                    "last_mb": round(sum(r["last_mb"] for r in out.values()), 1)}
    for row in out.values():
        row["ratio"] = round(row["last_mb"] / row["first_mb"], 3)
        row["ok"] = row["ratio"] <= limit
    return out


def unexpected(call: Call) -> bool:
    """A 5xx, or a stream's error event, other than the killed engine's own."""
    stream_error = call.outcome.startswith("error:") and (call.status or 0) < 400  # an error event in a 200
    bad = (call.status or 0) >= 500 or stream_error
    return bad and not (call.killed_engine and call.outcome == f"error:{RESTART_CODE}")


def goals(soak: Soak) -> dict:
    gone = [c for c in soak.calls if c.ended is None] + lost(soak.calls)
    errors = [c for c in soak.calls if unexpected(c)]
    held = {k: v for k, v in soak.after["server"].items() if v}
    mem = memory_goals(soak.samples, soak.t_warm, soak.kill, soak.args.span_minutes * 60)
    return {"memory": mem, "memory_ok": all(row["ok"] for row in mem.values()),
            "unexpected_errors": [asdict(c) for c in errors], "errors_ok": not errors,
            "lost": [asdict(c) for c in gone], "server_still_holds": held, "healthz_unanswered_s": soak.unanswered,
            "lost_ok": not gone and not held and not soak.unanswered}


def durations(calls: list[Call]) -> dict[str, tuple[float, float]]:
    """Per kind of request answered in full: the median and the longest time it took."""
    by_kind: dict[str, list[float]] = {}
    for c in calls:
        if c.outcome == "done" and c.ended is not None:
            by_kind.setdefault(c.kind, []).append(c.ended - c.sent)
    return {k: (sorted(v)[len(v) // 2], max(v)) for k, v in sorted(by_kind.items())}


def summary(soak: Soak, result: dict) -> None:
    span = soak.args.span_minutes
    print(f"\nmemory, median RSS MB of every 5-s sample ({span} min after the first minute -> the last {span} min):")
    for role, row in result["memory"].items():
        print(f"  {role:32s} {row['first_mb']:8.1f} -> {row['last_mb']:8.1f}  x{row['ratio']:.3f}"
              f"  {'ok' if row['ok'] else 'OVER 5%'}")
    print("  after the drain: " + ", ".join(f"{r} {m['rss_mb']:.0f}" for r, m in soak.after["memory"].items()))
    print(f"\nanswers ({len(soak.calls)} requests):")
    for key, n in soak.statuses().items():
        print(f"  {n:6d}  {key}")
    print("seconds from sent to ended, by kind (median, longest): " + ", ".join(
        f"{kind} {m:.0f} / {x:.0f}" for kind, (m, x) in durations(soak.calls).items()))
    print("the server's count (attnlens_http_requests_total; 499: its client left): "
          + ", ".join(f"{k} x{n}" for k, n in soak.after["server_counted"].items()))
    if soak.kill:
        restart = sum(c.killed_engine and c.outcome == f"error:{RESTART_CODE}" for c in soak.calls)
        print(f"\nkill: {soak.kill}; {restart} of its requests ended with {RESTART_CODE}")
    print(f"\nunexpected 5xx / error events: {len(result['unexpected_errors'])}; lost: {len(result['lost'])}; "
          f"held by the server after the drain: {result['server_still_holds'] or 'nothing'}; "
          f"/healthz unanswered at: {result['healthz_unanswered_s'] or 'never'}")
    for name in ("memory_ok", "errors_ok", "lost_ok"):
        print(f"  {name}: {result[name]}")


# --- main ------------------------------------------------------------------------
def overview_ids(n: int) -> list[int]:
    """n + 1,000 token ids of SmolLM2's tokenizer (the printing-press text, repeated): each overview
    takes n of them from its own offset."""
    from attnlens.model.interop.packaged import SMOLLM2, ensure_checkpoint
    from attnlens.model.tokenizer import Tokenizer

    folder = ensure_checkpoint(SMOLLM2, progress=False)
    if folder is None:
        raise SystemExit("SmolLM2 is not installed (make install): the soak runs on the default model")
    ids = Tokenizer.from_dir(folder).encode(LONG_TEXT * 4)
    return (ids * ((n + 1000) // len(ids) + 1))[:n + 1000]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=int, default=20)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--overview-tokens", type=int, default=8192)
    ap.add_argument("--span-minutes", type=int, default=3,
                    help="the memory goal compares the median RSS of this many minutes at each end")
    ap.add_argument("--explain-s", type=float, default=30.0, help="seconds between /lens and /patch requests")
    ap.add_argument("--leave-every", type=int, default=6, help="one stream in this many is left after a few chunks")
    ap.add_argument("--kill-at", type=float, default=0.4, help="when SmolLM2's engine is killed (0..1 of the run)")
    ap.add_argument("--drain-s", type=float, default=300.0,
                    help="after the run, how long requests in flight may take before their clients leave")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="a client's read timeout (between two bytes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", type=Path, default=Path("/tmp") / f"soak-server-{os.getpid()}.log")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / time.strftime("soak-%Y%m%d-%H%M%S.json", time.gmtime()))
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # each minute's line as it comes
    ids = overview_ids(args.overview_tokens)
    server = Server(None, ROOT, args.log)
    try:
        print(f"server ready in {server.wait_ready():.1f} s (log: {args.log}); engines: {server.engine_pids()}")
        soak = Soak(server, args, ids)
        asyncio.run(soak.run())
    finally:
        server.stop()
    result = goals(soak)
    summary(soak, result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "kill": soak.kill,
                                    "minutes": soak.minutes, "samples": soak.samples, "after_drain": soak.after, **result,
                                    "durations_s": durations(soak.calls),
                                    "calls": [asdict(c) for c in soak.calls]}, indent=1))
    print(f"\nresults: {args.out}")
    return 0 if result["memory_ok"] and result["errors_ok"] and result["lost_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

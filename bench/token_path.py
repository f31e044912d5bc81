"""Where a generated token's time goes between the engine's step and the client's socket, in the
real server (`attnlens serve`, the engine in its own process), streaming `POST /generate`.

    .venv/bin/python bench/token_path.py                             # packed, 1 stream then 16 and 64
    .venv/bin/python bench/token_path.py --dtype float32 --streams 1 16 --new-tokens 64

The server runs in a child of this script that wraps a few functions of the engine and the
server with timers before it starts (`install_probes`); the engine process is forked from it
(app/engine/prestart.py), so it carries them too. Nothing is added to the code in the repository.
Each wrapper stamps the time a token passes it, keyed by (generation, token number), and adds
the time spent inside it to its stage:

    engine process   decode step (model + sampling) -> the sink: Step built, msgpack, pipe write
    server, reader   msgpack decode -> records for the front, hand-over to the event loop
    event loop       output stage (text, stop strings, queue) -> the stream's task takes the
                     token (TokenEvent) -> API schema (StreamToken) -> SSE text -> ASGI send
                     and socket write
    client           this script's asyncio reader, the arrival of the token's event

At one stream: the median time between those points (latency, a token at a time). At many
streams: each stage's time per token (the work every token costs, whoever waits), and the CPU
seconds per token of the engine process, the server process and this client (Linux /proc), which
share the machine's cores with the model's threads. The wrappers themselves cost a few µs a token.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "bench"))

# --- in the server's process (and the engine process forked from it) ---------------------------
STAMPS: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)  # (generation, k-th token) -> point -> time
SPANS: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # stage -> [seconds inside, calls]
SEQ: dict[tuple[str, int], int] = defaultdict(int)  # (where, generation) -> tokens seen there
KEYS: dict[int, tuple[int, int]] = {}  # id(an event object in flight) -> its token's key


def _next(where: str, number: int) -> tuple[int, int]:
    SEQ[(where, number)] += 1
    return number, SEQ[(where, number)]


def _span(stage: str, seconds: float) -> None:
    s = SPANS[stage]
    s[0] += seconds
    s[1] += 1


def _dump(signum, frame) -> None:
    out = Path(os.environ["TOKEN_PATH_DIR"]) / f"{os.getpid()}.json"
    data = {"stamps": [[k[0], k[1], v] for k, v in STAMPS.items()], "spans": dict(SPANS)}
    out.write_text(json.dumps(data))


def _reset(signum, frame) -> None:
    STAMPS.clear()
    SPANS.clear()
    SEQ.clear()
    KEYS.clear()


def install_probes() -> None:
    """Wrap the engine's and the server's hand-over functions (module docstring)."""
    from attnlens.app.engine import core, outputs, process, worker
    from attnlens.app.serving import generate_serving, generation_streams

    clock = time.perf_counter

    def timed_rows(name: str, first_only: bool):
        inner = getattr(core.EngineCore, name)

        def wrapper(self, *args):
            rows = list(args[0]) if first_only else list(self.scheduler.decoding)
            t0 = clock()
            inner(self, *args)
            t1 = clock()
            _span(f"engine: {name.strip('_').replace('_', ' ')}", t1 - t0)
            for g in rows:
                if g.produced:
                    STAMPS[(g.number, g.produced)].update(step_in=t0, step_out=t1)
        setattr(core.EngineCore, name, wrapper)

    timed_rows("_run_decode", False)
    timed_rows("_run_prefills", True)

    add = core.EngineCore.add_generation

    def stamped_add(self, g):
        STAMPS[(g.number, 0)]["added"] = clock()  # the request's own points are token 0's
        add(self, g)
    core.EngineCore.add_generation = stamped_add

    from attnlens.app.engine import front
    submit_all = front.EngineFront.submit_all

    def stamped_submit(self, params, **kwargs):
        t0 = clock()
        states = submit_all(self, params, **kwargs)
        for state in states:
            STAMPS[(state.generation.number, 0)]["submitted"] = t0
        return states
    front.EngineFront.submit_all = stamped_submit

    sink_call = worker.PipeSink.__call__

    def sink(self, records):
        t0 = clock()
        sink_call(self, records)
        t1 = clock()
        _span("engine: hand-over (Step, msgpack, pipe write)", t1 - t0)
        for r in records:
            if isinstance(r, worker.TokenRecord):
                STAMPS[_next("sink", r.generation.number)].update(sink_in=t0, sent=t1)
    worker.PipeSink.__call__ = sink

    encode = worker.encode

    def timed_encode(message):
        t0 = clock()
        data = encode(message)
        _span("engine:   of which msgpack encode", clock() - t0)
        return data
    worker.encode = timed_encode

    decode = process.decode_from_engine
    received = [0.0, 0.0]

    def timed_decode(data):
        t0 = clock()
        message = decode(data)
        received[:] = [t0, clock()]
        _span("server reader: msgpack decode", received[1] - t0)
        return message
    process.decode_from_engine = timed_decode

    on_step = process.ProcessClient._on_step

    def timed_on_step(self, counters, items):
        t0 = clock()
        on_step(self, counters, items)
        t1 = clock()
        _span("server reader: records, front, hand-over to the loop", t1 - t0)
        for item in items:
            if isinstance(item, process.TokenOut):
                STAMPS[_next("reader", item.number)].update(recv=received[0], decoded=received[1], handed=t1)
    process.ProcessClient._on_step = timed_on_step

    dispatch = outputs.dispatch

    def timed_dispatch(records, states):
        t0 = clock()
        dispatch(records, states)
        t1 = clock()
        _span("loop: output stage (text, stop strings, queue)", t1 - t0)
        for r in records:
            if isinstance(r, outputs.TokenRecord):
                STAMPS[_next("loop", r.generation.number)].update(loop_in=t0, loop_out=t1)
    outputs.dispatch = timed_dispatch

    take = outputs.RequestState._take

    def timed_take(self, item):
        t0 = clock()
        event = take(self, item)
        _span("loop: token taken, TokenEvent built", clock() - t0)
        if isinstance(event, outputs.TokenEvent):
            key = (self.generation.number, event.index + 1)
            STAMPS[key]["taken"] = t0
            KEYS[id(event)] = key
        return event
    outputs.RequestState._take = timed_take

    api_event = generation_streams.api_event

    def timed_api_event(event):
        t0 = clock()
        out = api_event(event)
        t1 = clock()
        _span("loop: API schema (StreamToken)", t1 - t0)
        key = KEYS.pop(id(event), None)
        if key is not None:
            STAMPS[key]["api"] = t1
            KEYS[id(out)] = key
        return out
    generation_streams.api_event = timed_api_event

    sse = generate_serving.sse

    def timed_sse(name, data):
        t0 = clock()
        text = sse(name, data)
        t1 = clock()
        _span("loop: SSE text (model_dump_json)", t1 - t0)
        key = KEYS.get(id(data))
        if key is not None:
            STAMPS[key]["sse"] = t1
        return text
    generate_serving.sse = timed_sse

    batches = generate_serving.event_batches

    async def timed_batches(state):
        async for batch in batches(state):
            yield batch  # resumed once the batch's text was sent (ASGI send, socket write)
            t1 = clock()
            sent = [KEYS.pop(id(e)) for e in batch if id(e) in KEYS]
            if sent:
                _span("loop: ASGI send and socket write", t1 - STAMPS[sent[-1]].get("sse", t1))
            for key in sent:
                STAMPS[key]["written"] = t1
    generate_serving.event_batches = timed_batches

    signal.signal(signal.SIGUSR1, _reset)
    signal.signal(signal.SIGUSR2, _dump)


def serve_with_probes(args: list[str]) -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as `attnlens serve` sets it, before torch is imported
    install_probes()
    from attnlens.app.cli.commands import main

    sys.exit(main(["serve", *args]))


# --- in this script ----------------------------------------------------------------
POINTS = [("step_in", "step_out", "engine: the step (model, sampling)"),
          ("step_out", "sink_in", "engine: step end -> sink (retire, bookkeeping)"),
          ("sink_in", "sent", "engine: Step, msgpack, pipe write"),
          ("sent", "recv", "pipe -> server reader thread"),
          ("recv", "decoded", "server: msgpack decode"),
          ("decoded", "handed", "server: records, front, call_soon_threadsafe"),
          ("handed", "loop_in", "event loop wakes (GIL, other callbacks)"),
          ("loop_in", "loop_out", "loop: output stage (text, stop strings, queue)"),
          ("loop_out", "taken", "the stream's task wakes, takes the token"),
          ("taken", "api", "loop: TokenEvent, StreamToken"),
          ("api", "sse", "loop: SSE text"),
          ("sse", "written", "loop: ASGI send, socket write"),
          ("written", "arrival", "socket -> client's reader")]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_pid(server: int) -> int:
    for task in Path(f"/proc/{server}/task").iterdir():
        for child in (task / "children").read_text().split():
            if Path(f"/proc/{child}/comm").read_text().strip() == "attnlens-engine":
                return int(child)
    raise RuntimeError("no engine process under the server")


def collect(pids: list[int], folder: Path) -> tuple[dict, dict]:
    """Every process's stamps (merged by token) and spans."""
    for f in folder.glob("*.json"):
        f.unlink()
    for pid in pids:
        os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while len(list(folder.glob("*.json"))) < len(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the last file's write
    stamps: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    spans: dict[str, list[float]] = {}
    for f in folder.glob("*.json"):
        data = json.loads(f.read_text())
        for number, k, points in data["stamps"]:
            stamps[(number, k)].update(points)
        spans.update(data["spans"])
    return stamps, spans


def level(port: int, pids: list[int], folder: Path, ids: list[list[int]], n: int) -> None:
    from peer_client import run_all

    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(0.2)
    cpu0 = [cpu_seconds(p) for p in pids] + [time.process_time()]
    bodies = [{"ids": p, "max_new_tokens": n, "temperature": 0, "stream": True} for p in ids]
    answers, wall = run_all(port, "/generate", bodies)
    cpu1 = [cpu_seconds(p) for p in pids] + [time.process_time()]
    stamps, spans = collect(pids, folder)
    tokens = sum(a.tokens for a in answers)
    print(f"\n{len(ids)} stream(s): {tokens} tokens in {wall:.2f} s, {tokens / wall:.1f} tok/s; "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    by_number = sorted({number for number, _ in stamps})
    if len(by_number) == len(answers):  # the generations in order of submission: the answers' order
        for number, a in zip(by_number, answers):
            for k, t in enumerate(a.arrivals, 1):
                stamps[(number, k)]["arrival"] = t
    if len(ids) == 1:
        print("  latency of a token, step to socket (median over the tokens after the first, ms)")
        total = []
        for a, b, what in POINTS:
            gaps = [(p[b] - p[a]) * 1000 for (_, k), p in stamps.items() if k > 1 and a in p and b in p]
            if gaps:
                print(f"    {what:52s} {statistics.median(gaps):8.3f}")
        total = [(p["arrival"] - p["step_out"]) * 1000 for (_, k), p in stamps.items()
                 if k > 1 and "arrival" in p and "step_out" in p]
        if total:
            print(f"    {'step end -> the client has the token':52s} {statistics.median(total):8.3f}")
        first, number = answers[0], by_number[0]
        points = {**stamps[(number, 0)], "sent": first.t_send, "prefill_in": stamps[(number, 1)].get("step_in"),
                  "prefill_out": stamps[(number, 1)].get("step_out"), "first": first.arrivals[0],
                  "last": first.arrivals[-1], "end": first.t_end}
        line = [("sent", "submitted", "client -> HTTP, route, submit"), ("submitted", "added", "-> the engine process"),
                ("added", "prefill_in", "-> its step begins"), ("prefill_in", "prefill_out", "the prefill"),
                ("prefill_out", "first", "-> the client has the first token"), ("first", "last", "the other tokens"),
                ("last", "end", "-> the answer's end")]
        print("  the request, end to end (ms)")
        for a, b, what in line:
            if points.get(a) is not None and points.get(b) is not None:
                print(f"    {what:52s} {1000 * (points[b] - points[a]):8.1f}")
        print(f"    {'whole':52s} {1000 * first.wall:8.1f}")
    print("  time inside each stage, per token (ms; every call's time over the tokens)")
    for stage, (seconds, calls) in sorted(spans.items()):
        print(f"    {stage:55s} {1000 * seconds / max(tokens, 1):8.3f}   ({calls} calls)")
    names = ["server process", "engine process", "this client"]
    print("  CPU per token (ms): " + ", ".join(f"{name} {1000 * (b - a) / max(tokens, 1):.3f}"
                                            for name, a, b in zip(names, cpu0, cpu1)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        serve_with_probes(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="packed", choices=["packed", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still stops its server (finally)

    from bench_peers import story_prompts, wait_ready
    from bench_service import free_port

    from attnlens.model.interop.packaged import SMOLLM2, ensure_checkpoint
    from attnlens.model.tokenizer import Tokenizer

    ckpt = ensure_checkpoint(SMOLLM2, progress=False)
    tok = Tokenizer.from_dir(ckpt)
    prompts = [tok.encode(t) for t in story_prompts(max(args.streams))]
    folder = Path(tempfile.mkdtemp(prefix="token-path-"))
    port = free_port()
    env = {**os.environ, "ATTNLENS_DEVICE": "cpu", "ATTNLENS_DTYPE": args.dtype, "OMP_NUM_THREADS": str(args.threads),
           "ATTNLENS_LOG_LEVEL": "warning", "TOKEN_PATH_DIR": str(folder),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    log = folder / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--serve", "--model", str(ckpt), "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, port, "/readyz", log)
        pids = [proc.pid, engine_pid(proc.pid)]
        print(f"attnlens serve ({args.dtype}, {args.threads} threads), {args.new_tokens} greedy tokens a stream")
        level(port, pids, folder, prompts[:1], args.new_tokens)  # a warm-up
        for n in args.streams:
            level(port, pids, folder, prompts[:n], args.new_tokens)
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

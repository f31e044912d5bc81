"""The modules a request really runs through, in the order it first enters them: POST /attention
and a streamed chat completion, on the default model (SmolLM2) with the engine on a thread of the
server (an engine process runs the same core; the pipe's two ends, process.py / worker.py /
messages.py, then stand where client.py stands). Every Python call on every thread of the server
is recorded while the request runs; a module counts when one of its functions is called.

    python bench/request_path.py            # both requests, every module
    python bench/request_path.py --spine    # only the modules before the model's parts
    python bench/request_path.py --calls    # and, per module, which functions were entered, from where

"Call-backs" counts calls into a module the path had already entered and left, made from a module
that comes later in the path (control coming back up).
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's attnlens (a worktree's), whatever the environment installed
MODEL_INTERNALS = ("model/parts/", "model/native/", "model/packed/", "model/fused_decode.py",
                   "model/weight_arena.py")


class PathRecorder:
    """sys.setprofile on every thread: the project's modules in first-entered order, and call-backs."""

    def __init__(self):
        self.on = False
        self.order: list[str] = []
        self.callbacks: list[tuple[str, str]] = []
        self.entries: dict[str, Counter] = {}  # module -> "function <- caller module:function" counts

    def __call__(self, frame, event, arg):
        if not self.on or event != "call":
            return
        callee = self._module(frame)
        caller = self._module(frame.f_back) if frame.f_back is not None else None
        if callee is None or callee == caller:
            return
        back = frame.f_back
        self.entries.setdefault(callee, Counter())[
            f"{frame.f_code.co_name} <- {caller}:{back.f_code.co_name if back is not None else ''}"] += 1
        if callee not in self.order:
            self.order.append(callee)
        elif caller in self.order and self.order.index(caller) > self.order.index(callee):
            self.callbacks.append((caller, callee))

    @staticmethod
    def _module(frame) -> str | None:
        name = frame.f_code.co_filename
        try:
            rel = Path(name).resolve().relative_to(ROOT)
        except ValueError:
            return None
        return None if rel.parts[0] in (".venv", "tests", "bench") or name.startswith("<") else str(rel)


def run(spine: bool, calls: bool = False) -> None:
    from fastapi.testclient import TestClient

    from attnlens.app.engine.supervisor import Supervision
    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    Supervision.start = lambda self: None  # its ticks run beside the request, not in its path
    recorder = PathRecorder()
    threading.setprofile(recorder)  # the threads started from here on: the server's, the engine's
    sys.setprofile(recorder)
    from attnlens.app.server.settings import default_model_dir

    smollm2 = default_model_dir(packaged=True)  # the bundled decoder where the package is not installed
    settings = Settings(model=smollm2, models=[smollm2], device="cpu", engine_process=False)
    requests = [("POST /attention", "/attention", {"text": "To be, or not to be", "layers": [0], "heads": [0]}),
                ("POST /v1/chat/completions (streamed)", "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "To be"}], "max_tokens": 4, "stream": True})]
    with TestClient(create_app(settings)) as client:
        for _, route, body in requests:
            client.post(route, json=body)  # once before: imports and first-use work are not the path
        for title, route, body in requests:
            recorder.order.clear()
            recorder.callbacks.clear()
            recorder.entries.clear()
            recorder.on = True
            status = client.post(route, json=body).status_code
            recorder.on = False
            modules = [m for m in recorder.order if not (spine and m.startswith(MODEL_INTERNALS))]
            backs = {(a, b) for a, b in recorder.callbacks if not (spine and (a.startswith(MODEL_INTERNALS)
                                                                               or b.startswith(MODEL_INTERNALS)))}
            print(f"{title}: HTTP {status}, {len(modules)} modules, {len(backs)} call-backs")
            for i, m in enumerate(modules, 1):
                print(f"  {i:2d}. {m}")
                if calls:
                    for entry, n in recorder.entries[m].most_common(6):
                        print(f"        {n:4d}x {entry}")
            for a, b in sorted(backs):
                print(f"  call-back: {a} -> {b}")
    sys.setprofile(None)
    threading.setprofile(None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spine", action="store_true", help="leave out the model's parts and kernels")
    parser.add_argument("--calls", action="store_true", help="under each module, the functions entered and their callers")
    args = parser.parse_args()
    run(args.spine, args.calls)

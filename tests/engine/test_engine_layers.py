"""The engine knows nothing of the API: importing it (core, front, admission, process, output
stage) loads none of the API's schemas, and what it hands a route is a request's server-side
state, apart from the engine-side request the core schedules (issue 19: split the request)."""

from __future__ import annotations

import subprocess
import sys

from helpers import run_async

from attnlens.app.api.generate_schemas import StreamDone, StreamToken
from attnlens.app.engine import Engine, GenerationParams, RequestState
from attnlens.app.engine.core import Generation
from attnlens.app.serving.generation_streams import events
from attnlens.model import SamplingParams


def test_importing_the_engine_loads_no_api_schema():
    code = ("import sys, attnlens.app.engine, attnlens.app.engine.worker; "
            "bad = sorted(m for m in sys.modules if m.startswith('attnlens.app.') and "
            "m.split('.')[2] in ('schemas', 'openai_schemas', 'encoder_schemas', 'routers', 'main')); "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the engine imports the API's modules: {out.stdout}"


def test_engine_side_request_holds_no_loop_or_output(ckpt):
    engine = Engine(ckpt, max_concurrent=2)
    try:
        async def go():
            state = engine.submit(GenerationParams(ckpt.tokenizer.encode("To be"), 3,
                                                   SamplingParams(temperature=0.0)))
            assert isinstance(state, RequestState) and isinstance(state.generation, Generation)
            g = state.generation
            assert not hasattr(g, "loop") and not hasattr(g, "output")  # the server's side is the state's
            got = [e async for e in events(state)]
            return state, got

        state, got = run_async(go())
        assert all(isinstance(e, StreamToken) for e in got[:-1]) and isinstance(got[-1], StreamDone)
        assert got[-1].id == state.id and got[-1].usage.completion_tokens == len(got) - 1
        assert engine._states == {}  # the front forgets a state at its generation's end
    finally:
        engine.close()

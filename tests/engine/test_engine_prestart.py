"""Engine processes `attnlens serve` starts before it imports torch (app/engine/prestart.py):
which models get one is read from config.json alone, as the families declare it; a prestarted
process is the one a model's engine then runs in; one never used exits without a word."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO_ROOT, drain, reference_ids, run_async

from attnlens.app.engine import prestart as engine_prestart
from attnlens.app.engine.prestart import GENERATING_FAMILIES, generates


def test_the_generating_families_are_those_whose_declaration_generates():
    from attnlens.model.families import FAMILIES

    assert set(GENERATING_FAMILIES) == {name for name, f in FAMILIES.items() if f.generation is not None}


def test_which_models_get_an_engine_process_is_read_from_config_json(tmp_path):
    bundled = REPO_ROOT / "checkpoints"
    if not (bundled / "encoder" / "config.json").is_file():
        pytest.skip("the bundled checkpoints are not here")
    assert [generates(bundled / n) for n in ("default", "encoder", "translator")] == [True, False, True]
    (tmp_path / "config.json").write_text(json.dumps({"n_layers": 2}))  # an old config: a decoder
    assert generates(tmp_path)
    assert not generates(tmp_path / "missing")


FORKED = """
import asyncio, os, sys
from attnlens.app.engine import prestart as p
from attnlens.app.server.settings import Settings

n = p.prestart_engine_processes(Settings(model=sys.argv[1], models=sys.argv[2]).model_dirs(), fork=True)
first, spare = p._waiting
same = open(f"/proc/{first.process.pid}/cmdline").read() == open("/proc/self/cmdline").read()
print(n, type(first.process).__name__, same)

from helpers import drain, reference_ids
from attnlens.app.engine import EngineProcess, GenerationParams
from attnlens.model import SamplingParams, load_checkpoint

ckpt = load_checkpoint(sys.argv[1])
engine = EngineProcess(ckpt, model_dir=sys.argv[1], device="cpu", dtype="float32")
print(open(f"/proc/{first.process.pid}/comm").read().strip())  # as `ps -e` names it
ids = ckpt.tokenizer.encode("To be")


async def generate():
    return await drain(engine.submit(GenerationParams(ids, 4, SamplingParams(temperature=0.0))))


tokens, _ = asyncio.run(generate())
print(engine.client.process.pid == first.process.pid, tokens == reference_ids(ckpt, ids, 4, temperature=0.0))
engine.close()
p.close_unused_engine_processes()
print(engine.client.process.returncode, spare.process.returncode)
"""


def test_serve_forks_its_engine_processes_once_torch_is_imported(tiny_checkpoint):
    """`attnlens serve`'s first step: one engine process per generating model (the encoder gets
    none), forked (the same command line: nothing executed again), and the model's engine runs in
    the first; the spare is killed. In a fresh interpreter, as the command line's: a fork is for a
    process that has run no torch operation."""
    bundled = [REPO_ROOT / "checkpoints" / n for n in ("default", "encoder")]
    if not all((d / "config.json").is_file() for d in bundled):
        pytest.skip("the bundled checkpoints are not here")
    done = subprocess.run([sys.executable, "-c", FORKED, str(tiny_checkpoint), ",".join(map(str, bundled))],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT / "tests",
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "tests"),
                                                                            os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "ForkedProcess", "True", "attnlens-engine", "True", "True", "0", "-9"], done.stdout
    assert "Traceback" not in done.stderr


def test_a_prestarted_process_runs_the_engine_and_an_unused_one_exits_quietly(ckpt, tiny_checkpoint):
    from attnlens.app.engine import EngineProcess, GenerationParams
    from attnlens.model import SamplingParams

    first, spare = engine_prestart.spawn_engine_process(), engine_prestart.spawn_engine_process()
    engine_prestart._waiting.extend([first, spare])
    try:
        engine = EngineProcess(ckpt, model_dir=tiny_checkpoint, device="cpu", dtype="float32")
        try:
            assert engine.client.process.pid == first.process.pid  # the one started first
            assert open(f"/proc/{first.process.pid}/comm").read().strip() == "attnlens-engine"  # as forked ones
            ids = ckpt.tokenizer.encode("To be")

            async def generate():
                return await drain(engine.submit(GenerationParams(ids, 3, SamplingParams(temperature=0.0))))

            tokens, _ = run_async(generate())
            assert tokens == reference_ids(ckpt, ids, 3, temperature=0.0)
        finally:
            engine.close()
    finally:
        engine_prestart.close_unused_engine_processes()
    assert spare.process.returncode is not None and engine_prestart._waiting == []


def test_an_engine_process_whose_server_goes_before_its_spec_exits_without_a_traceback(capfd):
    bare = engine_prestart.spawn_engine_process()
    os.close(bare.commands)  # as when the server exits during its start
    os.close(bare.records)
    assert bare.process.wait(120) == 0
    assert "Traceback" not in capfd.readouterr().err


def test_a_start_that_converted_a_packaged_model_spawns_its_engine_processes(monkeypatch, tiny_checkpoint):
    """A first start converts the packaged models in the server's own process, which starts torch's
    OpenMP team there; a child forked after it inherits the team without its threads and waits for
    them forever in its first parallel region (seen in CI: every engine stuck in
    gomp_team_barrier_wait_end while loading). So such a start spawns, and any other forks."""
    from attnlens.app.engine import prestart
    from attnlens.model.interop import packaged

    made = []
    monkeypatch.setattr(prestart, "fork_engine_process", lambda: made.append("fork") or "forked")
    monkeypatch.setattr(prestart, "spawn_engine_process", lambda: made.append("spawn") or "spawned")
    monkeypatch.setattr(prestart, "_waiting", [])
    monkeypatch.setattr(prestart.sys, "platform", "linux")
    monkeypatch.setattr(packaged, "converted_here", False)
    assert prestart.prestart_engine_processes([tiny_checkpoint]) == 1 and made == ["fork"]
    monkeypatch.setattr(packaged, "converted_here", True)
    assert prestart.torch_ran_here()
    assert prestart.prestart_engine_processes([tiny_checkpoint]) == 1 and made == ["fork", "spawn"]

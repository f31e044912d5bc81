"""Shared fixtures: a tiny randomly initialised checkpoint that every test can load fast, loaded
(`ckpt`) and served in-process (`client`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The tests sit in folders by layer (model, engine, api, live; browser is a package of its own).
# The shared helpers here, and the few test modules that others import from, are found by name.
TESTS = Path(__file__).resolve().parent
for _folder in [TESTS, *(TESTS / layer for layer in ("model", "engine", "api", "live"))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# Keep the 2-core CI machine responsive: tests never need more than one intra-op thread
# per process (the service tests start extra processes of their own).
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# the tiny checkpoint's maker lives in helpers (test modules import it from there)
from helpers import REPO_ROOT, TINY_TEXT, make_tiny_checkpoint, sharp_checkpoint  # noqa: E402,F401


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A GPT-2-shaped 2-layer, 4-head model with context 64, saved once per session."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def default_checkpoint() -> Path:
    path = REPO_ROOT / "checkpoints" / "default"
    if not (path / "model.safetensors").is_file():
        pytest.skip("the bundled default model is not in checkpoints/default")
    return path


@pytest.fixture(scope="session")
def ckpt(tiny_checkpoint):
    """The tiny checkpoint, loaded (CPU, float32)."""
    from attnlens.model import load_checkpoint

    return load_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    """The app on the tiny checkpoint, started (lifespan) in a TestClient."""
    from fastapi.testclient import TestClient
    from helpers import MAX_NEW, MAX_PROMPT

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    settings = Settings(model=tiny_checkpoint, device="cpu", max_prompt_tokens=MAX_PROMPT, max_new_tokens=MAX_NEW,
                        cors_origins="http://viewer.example")
    with TestClient(create_app(settings)) as c:
        yield c


BUNDLED = ("default", "encoder", "translator")


@pytest.fixture(scope="session")
def bundled_server(tmp_path_factory):
    """A real `attnlens serve` (attnlens.Server) on the three bundled checkpoints: a decoder, an
    encoder and an encoder-decoder, the models the client tests and the example notebook use."""
    import attnlens

    dirs = [REPO_ROOT / "checkpoints" / name for name in BUNDLED]
    missing = [d for d in dirs if not (d / "model.safetensors").is_file()]
    if missing:
        pytest.skip(f"the bundled checkpoints are not all here: {', '.join(map(str, missing))}")
    log = tmp_path_factory.mktemp("bundled-server") / "server.log"
    with attnlens.Server(*dirs, log=log, env={"ATTNLENS_DEVICE": "cpu"}) as server:
        yield server


@pytest.fixture(scope="session")
def gpt2_export(tmp_path_factory):
    """(our checkpoint, its export loaded in transformers' GPT2LMHeadModel): random, perturbed
    weights (every LayerNorm and bias non-trivial, sharp attention), float32 on the CPU."""
    transformers = pytest.importorskip("transformers")
    from attnlens.model import load_checkpoint
    from attnlens.model.interop.hf import export_hf

    root = tmp_path_factory.mktemp("gpt2-export")
    ours = sharp_checkpoint(root, seed=3, layer_norm_eps=1e-6)
    hf_dir = export_hf(ours, root / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="eager").eval()
    return load_checkpoint(ours), hf


@pytest.fixture(scope="module")
def bundled_client():
    """The app on the three bundled checkpoints (decoder default, encoder, translator), in-process
    (engines on threads), with a small ablation limit so the limit can be tested."""
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    dirs = [REPO_ROOT / "checkpoints" / name for name in BUNDLED]
    if not all((d / "model.safetensors").is_file() for d in dirs):
        pytest.skip("the bundled checkpoints are not all here")
    settings = Settings(model=dirs[0], models=dirs, device="cpu", engine_process=False, max_ablations=3)
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory):
    """A small random Llama 3-style model with a chat template (<|start_header_id|> turns ended by
    <|eot_id|>, which generation_config.json makes a stop id), built by transformers and imported
    with import-hf: (the transformers directory, the attnlens checkpoint "llama3-chat"). Its
    context is 128: the tiny vocabulary spends ~20 tokens on each turn of a conversation."""
    pytest.importorskip("transformers")
    from dataclasses import replace

    from arch_helpers import CASES, write_hf_checkpoint

    from attnlens.model.interop.convert import import_checkpoint

    case = CASES["llama3"]
    case = replace(case, config={**case.config, "max_position_embeddings": 128})
    root = tmp_path_factory.mktemp("chat")
    src, _ = write_hf_checkpoint(case, root / "hf", seed=3)
    ours, _ = import_checkpoint(src, root / "llama3-chat")
    return src, ours


@pytest.fixture(scope="session")
def smollm2_file():
    """The packaged SmolLM2 GGUF file (skips when its package is not installed)."""
    from helpers import installed_packaged_file

    from attnlens.model.interop.packaged import SMOLLM2

    return installed_packaged_file(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2(smollm2_file):
    """SmolLM2 converted (once, into the cache) and loaded in float32."""
    from helpers import packaged_checkpoint

    from attnlens.model.interop.packaged import SMOLLM2

    return packaged_checkpoint(SMOLLM2)

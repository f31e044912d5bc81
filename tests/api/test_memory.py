"""What each model holds (GET /models' `memory`) and the KV cache sized from a memory budget
(ATTNLENS_KV_CACHE_BYTES), not only from MAX_CONCURRENT."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from helpers import REPO_ROOT

from attnlens.app.registry.memory import cache_row_bytes
from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings


def one_row(ckpt) -> int:
    c = ckpt.config  # keys and values, every layer, a whole context, float32
    return 2 * c.n_layers * c.n_heads * c.context_length * c.d_head * 4


@pytest.mark.parametrize("family", ["decoder", "encoder-decoder"])
def test_a_rows_bytes_are_those_of_a_real_row(family):
    from attnlens.model import ModelConfig
    from attnlens.model.families import FAMILY_CLASSES

    model = FAMILY_CLASSES[family](ModelConfig(family=family, vocab_size=50, context_length=24, d_model=32,
                                               n_layers=3, n_heads=4, d_ff=16))
    cache = model.new_kv_cache(1)
    assert cache_row_bytes(model) == sum(t.numel() * t.element_size() for t in cache.keys + cache.values)


def test_models_say_what_each_model_holds(tiny_checkpoint, ckpt):
    assert cache_row_bytes(ckpt.model) == one_row(ckpt)
    with TestClient(create_app(Settings(model=tiny_checkpoint, device="cpu", max_concurrent=5))) as c:
        memory = c.get("/models").json()["models"][0]["memory"]
    params = sum(p.numel() * 4 for p in ckpt.model.parameters())  # the tied LM head counted once
    assert memory["weights_bytes"] == params
    # on the CPU the cache is a pool of blocks: what it may hold is the budget (1 GiB by default)
    assert memory == {"weights_bytes": params, "kv_cache_rows": 5, "kv_cache_bytes": 1 << 30}


@pytest.mark.parametrize("engine_process", [False, True])
def test_on_the_cpu_the_budget_bounds_a_cache_in_blocks_and_every_slot_stays_open(tiny_checkpoint, ckpt,
                                                                                engine_process):
    budget = int(3.5 * one_row(ckpt))
    settings = Settings(model=tiny_checkpoint, device="cpu", max_concurrent=32, kv_cache_bytes=budget,
                        engine_process=engine_process, warmup=False)
    with TestClient(create_app(settings)) as c:
        memory = c.get("/models").json()["models"][0]["memory"]
        assert memory["kv_cache_rows"] == 32 and memory["kv_cache_bytes"] == budget
        engine = c.app.state.attnlens.registry.get(None).runner
        assert engine.max_concurrent == 32
        if not engine_process:
            assert engine.client.core.cache_paged and engine.client.core.cache.blocks_in_use == 0  # nothing in flight: nothing held


def test_whole_rows_are_as_many_as_the_budget_holds_where_the_cache_is_not_in_blocks():
    from attnlens.app.registry.memory import cache_rows

    assert cache_rows("m", 100, 32, 350) == 3
    assert cache_rows("m", 100, 32, 350, paged=True) == 32
    assert cache_rows("m", 100, 32, None) == 32


def test_a_budget_that_holds_no_row_is_a_start_up_error(tiny_checkpoint, ckpt):
    settings = Settings(model=tiny_checkpoint, device="cpu", kv_cache_bytes=one_row(ckpt) - 1)
    with pytest.raises(RuntimeError, match="holds no row of model 'tiny'"):
        with TestClient(create_app(settings)):
            pass


@pytest.mark.parametrize("engine_process", [False, True])
def test_the_weights_are_held_once(tiny_checkpoint, ckpt, engine_process):
    """With an engine process, that process holds the generating model's weights; the server's own
    copy is its shapes on the meta device. What the routes say about the model stays the same."""
    settings = Settings(model=tiny_checkpoint, device="cpu", engine_process=engine_process, warmup=False)
    with TestClient(create_app(settings)) as c:
        served = c.app.state.attnlens.registry.get(None)
        assert served.checkpoint.model.tok_emb.weight.is_meta == engine_process
        info = c.get("/model").json()
        assert (info["device"], info["dtype"], info["parameters"]) == ("cpu", "float32", ckpt.model.num_parameters())
        memory = c.get("/models").json()["models"][0]["memory"]
        assert memory["weights_bytes"] == sum(p.numel() * 4 for p in ckpt.model.parameters())
        r = c.post("/attention", json={"text": "To be", "layers": [0], "heads": [0]})  # the engine holds them
        assert r.status_code == 200


def test_a_checkpoint_loaded_as_shapes_still_checks_its_weights_file(tiny_checkpoint, tmp_path):
    """load_checkpoint(weights=False) reads no tensor data but the file's header: a file cut short, or
    one whose tensors are not the model's, fails there (in the server), not later in an engine."""
    import shutil

    from attnlens.model import CheckpointError, load_checkpoint

    assert load_checkpoint(tiny_checkpoint, weights=False).model.tok_emb.weight.is_meta
    cut = tmp_path / "cut"
    shutil.copytree(tiny_checkpoint, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(cut, weights=False)
    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    shutil.copy(REPO_ROOT / "checkpoints" / "translator" / "model.safetensors", other / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor|unexpected tensor|has shape"):
        load_checkpoint(other, weights=False)

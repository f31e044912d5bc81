"""A model's recommended sampling (model/generation_config.py): read from its checkpoint's
generation_config.json, copied there by import-hf, written there for a packaged model (also into a
folder converted before), and applied by /generate, /v1/completions and /v1/chat/completions to
the fields a request leaves unset, each on its own; ATTNLENS_GENERATION_CONFIG=none turns it off;
GET /models and /model show it."""

from __future__ import annotations

import json
import shutil

import pytest

from attnlens.model.generation_config import GENERATION_CONFIG_FILE, read_sampling, sampling_of
from attnlens.model.sampling import SamplingDefaults, choose


# --- generation_config.json -> the recommended sampling ---------------------------------------
@pytest.mark.parametrize("config,want", [
    ({}, SamplingDefaults()),
    ({"bos_token_id": 1, "eos_token_id": [2, 3], "transformers_version": "4.46"}, SamplingDefaults()),
    ({"do_sample": True, "temperature": 0.2, "top_p": 0.9}, SamplingDefaults(temperature=0.2, top_p=0.9)),
    ({"temperature": 0.7, "top_p": 0.8, "top_k": 20}, SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20)),
    # transformers' do_sample=false is greedy whatever the other fields say
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, SamplingDefaults(temperature=0.0)),
    ({"temperature": 0}, SamplingDefaults(temperature=0.0)),
    ({"top_k": 0}, SamplingDefaults(top_k=0)),
    ({"top_k": -1}, SamplingDefaults(top_k=0)),
])
def test_generation_config_fields_map_to_sampling(config, want):
    got = sampling_of(config)
    assert got.defaults == want and got.not_applied == {}


def test_what_cannot_be_applied_is_named_and_bad_values_are_skipped():
    got = sampling_of({"do_sample": True, "temperature": 0.7, "top_p": 1.5, "top_k": "20",
                       "repetition_penalty": 1.05, "max_new_tokens": 2048, "num_beams": 1, "typical_p": 1.0})
    assert got.defaults == SamplingDefaults(temperature=0.7)
    assert got.not_applied == {"top_p": 1.5, "top_k": "20", "repetition_penalty": 1.05, "max_new_tokens": 2048}
    assert sampling_of({"temperature": True, "top_p": float("nan")}).defaults == SamplingDefaults()


def test_each_field_is_the_requests_else_the_models_else_the_apis():
    api = SamplingDefaults(temperature=1.0, top_p=1.0)
    model = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40)
    assert choose(SamplingDefaults(), model, api) == {"temperature": 0.2, "top_p": 0.9, "top_k": 40}
    assert choose(SamplingDefaults(temperature=1.3), model, api) == {"temperature": 1.3, "top_p": 0.9, "top_k": 40}
    assert choose(SamplingDefaults(top_p=1.0, top_k=0), model, api) == {"temperature": 0.2, "top_p": 1.0,
                                                                       "top_k": None}
    assert choose(SamplingDefaults(), SamplingDefaults(), api) == {"temperature": 1.0, "top_p": 1.0, "top_k": None}
    assert choose(SamplingDefaults(top_k=5), SamplingDefaults(temperature=0.0), api) == {
        "temperature": 0.0, "top_p": 1.0, "top_k": 5}


# --- import-hf and the packaged models write it -------------------------------------------------
def test_import_hf_copies_generation_config(tiny_checkpoint, tmp_path):
    from attnlens.app.cli.commands import main
    from attnlens.model import load_checkpoint
    from attnlens.model.interop.convert import export_checkpoint

    src, _ = export_checkpoint(tiny_checkpoint, tmp_path / "hf")
    theirs = json.loads((src / GENERATION_CONFIG_FILE).read_text())
    theirs.update({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 30, "repetition_penalty": 1.1,
                   "transformers_version": "4.57.0"})
    (src / GENERATION_CONFIG_FILE).write_text(json.dumps(theirs))
    assert main(["import-hf", "--src", str(src), "--out", str(tmp_path / "ours")]) == 0
    ours = json.loads((tmp_path / "ours" / GENERATION_CONFIG_FILE).read_text())
    # every field but the token ids (the checkpoint's tokenizer writes its own stop ids)
    assert ours == {k: v for k, v in theirs.items() if not k.endswith("_token_id")}
    got = read_sampling(tmp_path / "ours")
    assert got.defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=30)
    assert got.not_applied == {"repetition_penalty": 1.1}
    # the tokenizer read from the imported folder is the one the import made (no stop ids added)
    assert load_checkpoint(tmp_path / "ours").tokenizer.eos_ids == load_checkpoint(tiny_checkpoint).tokenizer.eos_ids


def test_a_packaged_folder_converted_before_gets_the_recommended_sampling(tmp_path, monkeypatch):
    """A cache folder converted without it gets generation_config.json's sampling fields at the next
    start (its other fields kept), with no conversion again; a read-only one is served as it is."""
    from attnlens.model.interop import packaged

    monkeypatch.setenv("ATTNLENS_CACHE_DIR", str(tmp_path / "cache"))
    model = packaged.PackagedModel(name="fake-model", title="Fake", distribution="fake-dist", version="1.0",
                                   file="fake/model.gguf", credit="nobody",
                                   sampling={"do_sample": True, "temperature": 0.2, "top_p": 0.9})
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    monkeypatch.setattr(packaged, "locate", lambda m: (source, "1.0"))
    folder = tmp_path / "cache" / model.name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    (folder / packaged.SOURCE_FILE).write_text(json.dumps(packaged._source_record(model, source, "1.0")))
    (folder / GENERATION_CONFIG_FILE).write_text(json.dumps({"eos_token_id": [2, 7]}))
    monkeypatch.setattr(packaged, "convert_file", lambda *a, **k: pytest.fail("converted again"))

    assert packaged.ensure_checkpoint(model, progress=False) == folder
    assert json.loads((folder / GENERATION_CONFIG_FILE).read_text()) == {
        "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.2, "top_p": 0.9}
    assert read_sampling(folder).defaults == SamplingDefaults(temperature=0.2, top_p=0.9)
    stamp = (folder / GENERATION_CONFIG_FILE).stat().st_mtime_ns
    assert packaged.ensure_checkpoint(model, progress=False) == folder  # already there: not written again
    assert (folder / GENERATION_CONFIG_FILE).stat().st_mtime_ns == stamp

    (folder / GENERATION_CONFIG_FILE).unlink()
    monkeypatch.setattr(packaged, "_lock", lambda path: (_ for _ in ()).throw(PermissionError("read-only")))
    assert packaged.ensure_checkpoint(model, progress=False) == folder  # served without it
    assert not (folder / GENERATION_CONFIG_FILE).exists()


def test_smollm2_recommends_its_model_cards_sampling():
    from attnlens.model.interop.packaged import SMOLLM2

    assert sampling_of(SMOLLM2.sampling).defaults == SamplingDefaults(temperature=0.2, top_p=0.9)


# --- served ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recommending_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with a generation_config.json recommending temperature 0.3, top_k 7."""
    path = tmp_path_factory.mktemp("recommending") / "tiny-rec"
    shutil.copytree(tiny_checkpoint, path)
    (path / GENERATION_CONFIG_FILE).write_text(json.dumps({"do_sample": True, "temperature": 0.3, "top_k": 7,
                                                           "repetition_penalty": 1.2}))
    return path


def serve(checkpoint, **settings):
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    return TestClient(create_app(Settings(model=checkpoint, device="cpu", engine_process=False, **settings)))


def captured(client) -> list:
    """The SamplingParams of every generation the client's app submits from now on."""
    runner = client.app.state.attnlens.registry.get(None).runner
    seen: list = []
    submit_all = runner.submit_all  # submit() admits through it too

    def admit(jobs, *a, **k):
        seen.extend(p.sampling for p in jobs)
        return submit_all(jobs, *a, **k)

    runner.submit_all = admit
    return seen


def rules(params) -> tuple:
    return params.temperature, params.top_p, params.top_k


def test_requests_get_the_models_sampling_for_each_field_they_leave_unset(recommending_checkpoint):
    with serve(recommending_checkpoint) as client:
        seen = captured(client)
        prompt = {"prompt": "To be", "max_new_tokens": 2}
        assert client.post("/generate", json=prompt).status_code == 200
        assert client.post("/generate", json={**prompt, "temperature": 1.1, "top_p": None}).status_code == 200
        assert client.post("/generate", json={**prompt, "top_k": 0, "top_p": 0.5}).status_code == 200
        completions = {"prompt": "To be", "max_tokens": 2}
        assert client.post("/v1/completions", json=completions).status_code == 200
        assert client.post("/v1/completions", json={**completions, "n": 2, "top_k": -1}).status_code == 200
        assert client.post("/v1/completions", json={**completions, "temperature": 0}).status_code == 200
        assert [rules(p) for p in seen] == [
            (0.3, 1.0, 7),  # /generate: the model's temperature and top_k, /generate's top_p
            (1.1, 1.0, 7),  # the request's temperature; null is not set
            (0.3, 0.5, None),  # top_k 0: off
            (0.3, 1.0, 7),  # /v1/completions likewise
            (0.3, 1.0, None), (0.3, 1.0, None),  # each choice; -1 is off too (vLLM)
            (0.0, 1.0, 7),
        ]
        info = client.get("/models").json()["models"][0]["sampling_defaults"]
        assert info == {"temperature": 0.3, "top_p": None, "top_k": 7, "source": "generation_config.json",
                        "not_applied": {"repetition_penalty": 1.2}}
        assert client.get("/model").json()["sampling_defaults"] == info


def test_chat_completions_get_the_models_sampling(chat_checkpoint, tmp_path):
    _, ours = chat_checkpoint
    path = tmp_path / "llama3-chat"
    shutil.copytree(ours, path)
    config = json.loads((path / GENERATION_CONFIG_FILE).read_text())
    (path / GENERATION_CONFIG_FILE).write_text(json.dumps({**config, "temperature": 0.25, "top_p": 0.8}))
    with serve(path) as client:
        seen = captured(client)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        assert client.post("/v1/chat/completions", json={**chat, "top_p": 1}).status_code == 200
        assert [rules(p) for p in seen] == [(0.25, 0.8, None), (0.25, 1.0, None)]


def test_generation_config_none_gives_the_apis_defaults(recommending_checkpoint):
    with serve(recommending_checkpoint, generation_config="none") as client:
        seen = captured(client)
        assert client.post("/generate", json={"prompt": "To be", "max_new_tokens": 2}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2}).status_code == 200
        assert [rules(p) for p in seen] == [(0.8, 1.0, None), (1.0, 1.0, None)]
        info = client.get("/models").json()["models"][0]["sampling_defaults"]
        assert info == {"temperature": None, "top_p": None, "top_k": None, "source": None, "not_applied": {}}


def test_the_setting_is_read_from_the_environment(monkeypatch, tiny_checkpoint):
    from pydantic import ValidationError

    from attnlens.app.server.settings import Settings

    assert Settings(model=tiny_checkpoint).generation_config == "auto"
    monkeypatch.setenv("ATTNLENS_GENERATION_CONFIG", "none")
    assert Settings(model=tiny_checkpoint).generation_config == "none"
    monkeypatch.setenv("ATTNLENS_GENERATION_CONFIG", "vllm")
    with pytest.raises(ValidationError):
        Settings(model=tiny_checkpoint)


def test_the_schemas_leave_sampling_unset_and_say_what_the_default_is(client):
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for name, api_default in (("GenerateRequest", "0.8"), ("CompletionRequest", "1"), ("ChatCompletionRequest", "1")):
        fields = schemas[name]["properties"]
        for key in ("temperature", "top_p", "top_k"):
            assert fields[key].get("default") is None, (name, key)
            assert "default: the model's" in fields[key]["description"], (name, key)
        assert fields["temperature"]["description"].endswith(f"else {api_default}"), name

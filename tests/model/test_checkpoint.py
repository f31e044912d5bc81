"""Checkpoint directories: exact round trips, and a clear error naming the file for each way one breaks."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from attnlens.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from attnlens.model.config import ModelConfig
from attnlens.model.families.decoder import Transformer
from attnlens.model.parts.linear import Linear
from attnlens.model.tokenizer import Tokenizer


@pytest.fixture()
def ckpt(tiny_checkpoint, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))


def random_model(tok: Tokenizer, seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=tok.vocab_size + 3, context_length=32, d_model=16, n_layers=2, n_heads=2,
                      d_ff=24, **overrides)  # fmt: skip
    model = Transformer(cfg).eval()
    with torch.no_grad():  # every tensor non-trivial, LayerNorms included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(["hello world, héllo wörld 東京\n"] * 10, vocab_size=280)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"norm": "post", "activation": "relu", "positional": "sinusoidal", "tie_embeddings": False, "bias": False},
     {"positional": "rotary", "n_kv_heads": 2, "norm_type": "rmsnorm", "ffn": "gated", "activation": "silu"}],
)
def test_round_trip_is_exact(tmp_path, tok, overrides):
    model = random_model(tok, **overrides)
    report = {"steps": 12, "final_val_loss": 3.5}
    save_checkpoint(tmp_path / "c", model, tok, report=report)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json", "train_report.json"
    ]  # fmt: skip
    loaded = load_checkpoint(tmp_path / "c")
    assert loaded.config == model.config
    assert loaded.report == report
    assert loaded.path == tmp_path / "c"
    assert not loaded.model.training
    want, got = model.state_dict(), loaded.model.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want[name]), name
    assert (loaded.model.lm_head.weight is loaded.model.tok_emb.weight) == model.config.tie_embeddings
    # the load skips the random initialisation the file overwrites, never a computed buffer
    buffers = {n: b.tolist() for n, b in model.named_buffers()}
    assert {n: b.tolist() for n, b in loaded.model.named_buffers()} == buffers
    assert bool(buffers) == (model.config.positional != "learned")  # rotary frequencies, a sinusoidal table
    assert loaded.tokenizer.to_str() == tok.to_str()
    ids = torch.tensor([tok.encode("hello 東京")])
    with torch.no_grad():  # the same weights laid out alike: exactly the same numbers
        assert torch.equal(loaded.model(ids).logits, model.eval()(ids).logits)


def test_a_cpu_load_keeps_linear_weights_row_major_and_saves_again(tmp_path, tok):
    """model/parts/linear.py takes y^T = W x^T from row-major (out, in) weights: a load keeps that
    layout (a transposed one would send every product down BLAS's slow path)."""
    model = random_model(tok, seed=2)
    save_checkpoint(tmp_path / "c", model, tok)
    loaded = load_checkpoint(tmp_path / "c").model
    linears = [m for m in loaded.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, Linear) and m.weight.is_contiguous() for m in linears)
    assert loaded.lm_head.weight is loaded.tok_emb.weight  # still tied
    one = torch.tensor([[tok.encode("hello")[0]]])
    with torch.no_grad():  # a one-token step (W x^T, one column padded to two) against F.linear's products
        with torch.enable_grad():
            plain = model.eval()(one).logits.detach()  # autograd on: every Linear takes F.linear
        assert torch.allclose(loaded(one).logits, plain, atol=1e-5, rtol=0)
    save_checkpoint(tmp_path / "again", loaded, tok)  # model_state stores contiguous copies
    again = load_checkpoint(tmp_path / "again").model
    for name, t in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


def test_tied_head_is_stored_once(tmp_path, tok):
    save_checkpoint(tmp_path / "c", random_model(tok), tok)
    with safe_open(str(tmp_path / "c" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "tok_emb.weight" in names and "lm_head.weight" not in names


def test_fp16_save_halves_the_file_and_loads_as_rounded_fp32(tmp_path, tok):
    model = random_model(tok, seed=1)
    save_checkpoint(tmp_path / "full", model, tok)
    save_checkpoint(tmp_path / "half", model, tok, dtype=torch.float16)
    with safe_open(str(tmp_path / "half" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    full_size = (tmp_path / "full" / "model.safetensors").stat().st_size
    half_size = (tmp_path / "half" / "model.safetensors").stat().st_size
    assert half_size < 0.55 * full_size
    loaded = load_checkpoint(tmp_path / "half")
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], t.half().float()), name
    half_model = load_checkpoint(tmp_path / "half", dtype=torch.float16).model
    assert half_model.tok_emb.weight.dtype == torch.float16


def test_the_session_fixture_loads(tiny_checkpoint):
    ck = load_checkpoint(tiny_checkpoint)
    assert ck.config.is_gpt2_shaped() == []
    assert ck.report is None
    assert ck.tokenizer.vocab_size <= ck.config.vocab_size


# --- corrupt checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file(ckpt, name):
    (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=rf"{name}: file is missing"):
        load_checkpoint(ckpt)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="nope: checkpoint directory does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_truncated_safetensors(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("where", ["header", "everything"])
def test_garbage_bytes_in_safetensors(ckpt, where):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    if where == "header":
        data[8:40] = b"\x00\xff garbage garbage garbage \xfe\x01"[:32].ljust(32, b"!")
    else:
        data = bytearray(random.Random(0).randbytes(len(data)))
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        load_checkpoint(ckpt)


def test_empty_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_checkpoint(ckpt)


def test_tensor_shape_disagreeing_with_config(ckpt):
    data = json.loads((ckpt / "config.json").read_text())
    data["d_ff"] = 48  # the weights were saved with d_ff=64
    (ckpt / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor blocks\.0\.ffn\.fc\.weight has shape "
                                              r"\[64, 32\] but config\.json implies \[48, 32\]"):  # fmt: skip
        load_checkpoint(ckpt)


def test_config_with_more_layers_than_the_weights(ckpt):
    data = json.loads((ckpt / "config.json").read_text())
    data["n_layers"] = 3
    (ckpt / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing tensor\(s\) blocks\.2\."):
        load_checkpoint(ckpt)


def test_config_with_fewer_layers_than_the_weights(ckpt):
    data = json.loads((ckpt / "config.json").read_text())
    data["n_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unexpected tensor\(s\) blocks\.1\."):
        load_checkpoint(ckpt)


def test_invalid_config_json(ckpt):
    (ckpt / "config.json").write_text('{"vocab_size": 300, "d_model": ')
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_heads": 5}, "divisible by n_heads"),
        ({"norm": "sandwich"}, "norm must be one of"),
        ({"mystery": 1}, "unknown config field"),
    ],
)
def test_invalid_config_values(ckpt, change, message):
    data = json.loads((ckpt / "config.json").read_text())
    data.update(change)
    (ckpt / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=rf"config\.json: invalid model config .*{message}"):
        load_checkpoint(ckpt)


def test_config_that_is_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2, 3]")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_checkpoint(ckpt)


def test_garbage_tokenizer(ckpt):
    (ckpt / "tokenizer.json").write_text("not a tokenizer")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: cannot be read as a tokenizer"):
        load_checkpoint(ckpt)


def test_tokenizer_larger_than_the_vocab(ckpt):
    data = json.loads((ckpt / "config.json").read_text())
    data["vocab_size"] = 10
    (ckpt / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: tokenizer has \d+ tokens but config\.json says vocab_size=10"):
        load_checkpoint(ckpt)


def test_invalid_report_json(ckpt):
    (ckpt / "train_report.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"train_report\.json: not valid JSON"):
        load_checkpoint(ckpt)


def test_weights_are_written_with_the_umasks_mode_not_owner_only(tmp_path):
    """safetensors writes 0600; a checkpoint (or the cache a Docker build fills as root) is read by
    a server running as another user, so the file gets the mode any new file would."""
    import os

    from helpers import make_tiny_checkpoint

    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "a"))
    old = os.umask(0o022)
    try:
        out = save_checkpoint(tmp_path / "b", ckpt.model, ckpt.tokenizer)
    finally:
        os.umask(old)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644

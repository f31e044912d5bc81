"""Hugging Face GPT-2 interop: our export loads in `transformers` and computes the same thing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from attnlens.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from attnlens.model.decoding import SamplingParams, generate_tokens
from attnlens.model.interop.hf import export_hf, import_hf
from attnlens.model.tokenizer import EOS_TOKEN, Tokenizer

transformers = pytest.importorskip("transformers")
from conftest import TINY_TEXT, make_tiny_checkpoint  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: E402

TEXTS = ["To be, or not to be", "Café naïve 東京 😀🎭\r\n\ttabs", "  leading spaces\n\nand " + EOS_TOKEN]


def perturb_(model, seed: int) -> None:
    """Make every tensor non-trivial (LayerNorms, biases) so no mapping mistake can hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    """A GPT-2-shaped attnlens checkpoint with random weights everywhere."""
    root = tmp_path_factory.mktemp("hf")
    make_tiny_checkpoint(root / "seed", seed=3, layer_norm_eps=1e-6)
    ck = load_checkpoint(root / "seed")
    perturb_(ck.model, seed=4)
    with torch.no_grad():  # sharper attention, so attention maps differ between heads and layers
        for block in ck.model.blocks:
            block.attn.qkv.weight.mul_(8)
    save_checkpoint(root / "ours", ck.model, ck.tokenizer)
    return root / "ours"


@pytest.fixture(scope="module")
def exported(ours, tmp_path_factory) -> Path:
    return export_hf(ours, tmp_path_factory.mktemp("export") / "gpt2")


@pytest.fixture(scope="module")
def hf_model(exported):
    return GPT2LMHeadModel.from_pretrained(exported, attn_implementation="eager").eval()


# --- export --------------------------------------------------------------------------------


def test_export_writes_a_gpt2_directory(ours, exported):
    ck = load_checkpoint(ours)
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"} <= names  # fmt: skip
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["model_type"] == "gpt2"
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == ck.tokenizer.eos_id
    assert ck.tokenizer.backend.id_to_token(cfg["eos_token_id"]) == EOS_TOKEN
    assert (cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["n_inner"], cfg["n_positions"]) == (32, 2, 4, 64, 64)
    assert cfg["layer_norm_epsilon"] == 1e-6
    assert cfg["activation_function"] == "gelu_new"
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("transformer.h.0.attn.c_attn.weight").shape == (32, 96)  # Conv1D: (in, out)
        assert torch.equal(f.get_tensor("transformer.h.1.mlp.c_proj.weight"), ck.model.blocks[1].ffn.proj.weight.t())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    assert all(k.startswith("transformer.") for k in keys)


def test_transformers_loads_every_weight_and_ties_the_head(ours, hf_model):
    ck = load_checkpoint(ours)
    assert hf_model.lm_head.weight.data_ptr() == hf_model.transformer.wte.weight.data_ptr()
    assert torch.equal(hf_model.lm_head.weight, ck.model.tok_emb.weight)
    assert torch.equal(hf_model.transformer.h[1].attn.c_proj.weight, ck.model.blocks[1].attn.proj.weight.t())
    assert torch.equal(hf_model.transformer.h[0].ln_2.bias, ck.model.blocks[0].ln2.bias)
    assert hf_model.config.layer_norm_epsilon == 1e-6


def test_logits_and_every_layers_attention_match_transformers(ours, hf_model):
    model = load_checkpoint(ours).model
    ids = torch.randint(0, model.config.vocab_size, (2, model.config.context_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf_model(ids, output_attentions=True)
        logits, attentions = model(ids, return_attention=True)
        fast = model(ids).logits
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast, out.logits, atol=1e-5, rtol=0)
    assert len(attentions) == len(out.attentions) == 2
    for ours_att, theirs in zip(attentions, out.attentions):
        torch.testing.assert_close(ours_att, theirs, atol=1e-5, rtol=0)
    # the maps are not degenerate: heads differ, so a head mix-up would be caught
    assert (attentions[0][:, 0] - attentions[0][:, 1]).abs().max() > 0.05


def test_transformers_tokenizer_loads_and_agrees(ours, exported):
    tok = load_checkpoint(ours).tokenizer
    fast = PreTrainedTokenizerFast(tokenizer_file=str(exported / "tokenizer.json"))
    auto = transformers.AutoTokenizer.from_pretrained(exported)
    assert auto.eos_token == EOS_TOKEN and auto.eos_token_id == tok.eos_id
    for hf_tok in (fast, auto):
        for text in TEXTS + [TINY_TEXT]:
            ids = hf_tok.encode(text, add_special_tokens=False)
            assert ids == tok.encode(text)
            assert hf_tok.decode(ids) == text


def test_greedy_generate_matches_transformers(ours, hf_model):
    ck = load_checkpoint(ours)
    prompt = ck.tokenizer.encode("To be, or not")
    ours_ids = [t.id for t in generate_tokens(ck.model, prompt, 30, SamplingParams(temperature=0))]
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30,
                                pad_token_id=ck.tokenizer.eos_id)  # fmt: skip
    theirs = out[0, len(prompt):].tolist()
    assert len(theirs) >= 1
    assert ours_ids[: len(theirs)] == theirs
    if len(theirs) < 30:  # transformers stops at EOS; we leave stopping to the caller
        assert theirs[-1] == ck.tokenizer.eos_id
    assert len(set(ours_ids)) > 1  # a non-trivial sequence


def test_export_refuses_a_config_gpt2_cannot_express(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "post", norm="post", activation="relu")
    with pytest.raises(ValueError, match=r"cannot export as GPT-2: GPT-2 is pre-LN.*; GPT-2 uses tanh-GELU"):
        export_hf(src, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    src = make_tiny_checkpoint(tmp_path / "scaled", scale_embeddings=True, tie_embeddings=False)
    with pytest.raises(ValueError, match=r"ties the LM head.*does not scale embeddings"):
        export_hf(src, tmp_path / "out")


# --- import --------------------------------------------------------------------------------


def test_import_of_export_reproduces_the_model_exactly(ours, exported, tmp_path):
    back = import_hf(exported, tmp_path / "back")
    assert back == tmp_path / "back"
    a, b = load_checkpoint(ours), load_checkpoint(back)
    assert b.config == a.config
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert b.model.lm_head.weight is b.model.tok_emb.weight
    assert b.tokenizer.to_str() == a.tokenizer.to_str()


def gpt2_dir_from_transformers(root: Path, *, bare_keys: bool, **config) -> tuple[Path, GPT2LMHeadModel]:
    """A GPT-2 directory in the original layout: pytorch_model.bin + vocab.json + merges.txt."""
    tok = Tokenizer.train([TINY_TEXT] * 4, vocab_size=300)
    cfg = GPT2Config(**{"vocab_size": tok.vocab_size, "n_positions": 48, "n_embd": 24, "n_layer": 2, "n_head": 3,
                        "bos_token_id": tok.eos_id, "eos_token_id": tok.eos_id, **config})  # fmt: skip
    torch.manual_seed(7)
    model = GPT2LMHeadModel(cfg).eval()
    perturb_(model, seed=8)
    root.mkdir(parents=True)
    model.config.save_pretrained(root)
    state = model.state_dict()  # has lm_head.weight, tied to transformer.wte.weight
    if bare_keys:  # the original OpenAI-converted layout: no "transformer." prefix, with mask buffers
        state = {k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}
        for i in range(cfg.n_layer):
            state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(48, 48)).view(1, 1, 48, 48)
            state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    # transformers 5 only writes safetensors, so write the legacy pickle ourselves
    torch.save(state, root / "pytorch_model.bin")
    tok.backend.model.save(str(root))  # vocab.json + merges.txt
    return root, model


@pytest.mark.parametrize("bare_keys", [False, True])
def test_import_from_pytorch_model_bin_and_vocab_merges(tmp_path, bare_keys):
    src, hf = gpt2_dir_from_transformers(
        tmp_path / "gpt2", bare_keys=bare_keys, activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-6
    )
    assert not (src / "model.safetensors").exists() and not (src / "tokenizer.json").exists()
    ck = load_checkpoint(import_hf(src, tmp_path / "ours"))
    cfg = ck.config
    assert (cfg.vocab_size, cfg.context_length, cfg.d_model, cfg.n_layers, cfg.n_heads) == (hf.config.vocab_size, 48, 24, 2, 3)
    assert cfg.d_ff == 4 * 24  # n_inner None
    assert cfg.layer_norm_eps == 1e-6
    assert cfg.is_gpt2_shaped() == []
    assert torch.equal(ck.model.blocks[0].attn.qkv.weight, hf.transformer.h[0].attn.c_attn.weight.t())
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    if hasattr(hf, "set_attn_implementation"):  # attention maps come from the eager path
        hf.set_attn_implementation("eager")
    else:
        hf.config._attn_implementation = "eager"
    with torch.no_grad():
        out = hf(ids, output_attentions=True)
        logits, attentions = ck.model(ids, return_attention=True)
    torch.testing.assert_close(logits, out.logits, atol=1e-5, rtol=0)
    for a, b in zip(attentions, out.attentions):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    text = "To be, or not to be " + EOS_TOKEN
    assert ck.tokenizer.encode(text)[-1] == ck.tokenizer.eos_id
    assert ck.tokenizer.decode(ck.tokenizer.encode(text)) == text


@pytest.fixture()
def gpt2_src(exported, tmp_path) -> Path:
    """A private copy of the exported directory that a test may damage."""
    return Path(shutil.copytree(exported, tmp_path / "src"))


def edit_config(src: Path, **changes) -> None:
    data = json.loads((src / "config.json").read_text())
    data.update(changes)
    (src / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"activation_function": "relu"}, r"activation_function 'relu' is not a tanh-GELU"),
        ({"activation_function": "gelu"}, r"activation_function 'gelu' is not a tanh-GELU"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"tie_word_embeddings": False}, "untied LM head"),
        ({"model_type": "llama"}, "model_type is 'llama', only 'gpt2'"),
        ({"n_head": 5}, r"invalid GPT-2 config .*divisible by n_heads"),
        ({"n_inner": 100}, r"model\.safetensors: tensor h\.0\.mlp\.c_fc\.weight has shape \[32, 64\] but config\.json implies \[32, 100\]"),
        ({"n_layer": 3}, r"model\.safetensors: missing tensor\(s\) h\.2\."),
    ],
)
def test_import_refuses_with_the_reason(gpt2_src, tmp_path, changes, message):
    edit_config(gpt2_src, **changes)
    with pytest.raises(CheckpointError, match=message):
        import_hf(gpt2_src, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_import_reports_missing_and_broken_files(gpt2_src, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="does not exist"):
        import_hf(tmp_path / "nowhere", out)
    (gpt2_src / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer found"):
        import_hf(gpt2_src, out)
    (gpt2_src / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: cannot be read"):
        import_hf(gpt2_src, out)
    data = (gpt2_src / "model.safetensors").read_bytes()
    (gpt2_src / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        import_hf(gpt2_src, out)
    (gpt2_src / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        import_hf(gpt2_src, out)
    (gpt2_src / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        import_hf(gpt2_src, out)
    (gpt2_src / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file is missing"):
        import_hf(gpt2_src, out)


class NotATensor:
    pass


def test_import_never_unpickles_arbitrary_objects(gpt2_src, tmp_path):
    (gpt2_src / "model.safetensors").unlink()
    torch.save({"wte.weight": torch.zeros(2), "evil": NotATensor()}, gpt2_src / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: cannot be read as a PyTorch state dict"):
        import_hf(gpt2_src, tmp_path / "out")


def test_import_refuses_an_untied_head_in_the_weights(gpt2_src, tmp_path):
    with safe_open(str(gpt2_src / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    state["lm_head.weight"] = state["transformer.wte.weight"] + 1
    (gpt2_src / "model.safetensors").unlink()
    torch.save(state, gpt2_src / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="lm_head.weight differs from wte.weight"):
        import_hf(gpt2_src, tmp_path / "out")


# --- the CLI -------------------------------------------------------------------------------


def test_cli_export_import_and_info(ours, tmp_path, capsys):
    from attnlens.app.cli.commands import main

    assert main(["export-hf", "--model", str(ours), "--out", str(tmp_path / "hf")]) == 0
    assert main(["import-hf", "--src", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    assert main(["info", "--model", str(tmp_path / "back")]) == 0
    out = capsys.readouterr().out
    assert "wrote a transformers GPT-2 directory" in out and "wrote an attnlens checkpoint" in out
    assert "2 x 4 heads, d_model 32, d_ff 64" in out and "parameters" in out


def test_cli_export_refusal_is_one_clear_line(tmp_path, capsys):
    from attnlens.app.cli.commands import main

    src = make_tiny_checkpoint(tmp_path / "relu", activation="relu")
    assert main(["export-hf", "--model", str(src), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "attnlens export-hf: error:" in err and "tanh-GELU" in err

"""Real architectures from disk: a small random Llama 3, Llama 2, Qwen2, Mistral, Qwen3 and Pythia built
by transformers (tests/arch_helpers.py), saved with their tokenizers, imported with import-hf,
and checked against transformers on the same weights (logits, every attention map, greedy
generation), against our own full recompute (incremental decoding, batched rows of different
lengths through the engine's decode step), and exported back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlens.model.checkpoint import CheckpointError, load_checkpoint
from attnlens.model.decoding import RowSampler, SamplingParams, decode_step, generate_tokens
from attnlens.model.hooks import HookPoint, Hooks, hooked
from attnlens.model.interop.convert import export_checkpoint, find_for_export, import_checkpoint

transformers = pytest.importorskip("transformers")

from arch_helpers import (  # noqa: E402
    ARCH_NAMES,
    CASES,
    ROUND_TRIP,
    assert_batched_rows_equal_each_alone,
    ids_for,
    load_hf,
    write_hf_checkpoint,
)

# what import-hf must make of each case: (architecture, n_kv_heads, head_dim, rotary_pct, tied, window, biases)
EXPECTED = {
    "llama3": ("LlamaForCausalLM", 2, 8, 1.0, False, None, (False, False, False)),
    "llama2": ("LlamaForCausalLM", None, 8, 1.0, True, None, (True, True, True)),
    "qwen2": ("Qwen2ForCausalLM", 1, 8, 1.0, True, None, (True, False, False)),
    "mistral": ("MistralForCausalLM", 2, 16, 1.0, False, 8, (False, False, False)),
    "qwen3": ("Qwen3ForCausalLM", 2, 32, 1.0, False, None, (False, False, False)),
    "pythia": ("GPTNeoXForCausalLM", None, 16, 0.25, False, None, (True, True, True)),
}


@pytest.fixture(scope="module", params=ARCH_NAMES)
def arch(request, tmp_path_factory):
    case = CASES[request.param]
    root = tmp_path_factory.mktemp(case.name)
    src, _ = write_hf_checkpoint(case, root / "hf")
    out, architecture = import_checkpoint(src, root / "ours")
    return SimpleNamespace(case=case, src=src, ours=out, ckpt=load_checkpoint(out), hf=load_hf(src, case),
                           architecture=architecture, root=root)


def full_last(model, ids: list[int]):
    """Logits and per-layer (H, len) attention rows of the last position, recomputed from scratch."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), return_attention=True)
    return out.logits[0, -1], [a[0, :, -1] for a in out.attentions]


# --- import --------------------------------------------------------------------------------------


def test_import_reads_the_architecture_and_its_parts(arch):
    cfg = arch.ckpt.config
    hf_class, n_kv, head_dim, pct, tied, window, biases = EXPECTED[arch.case.name]
    assert arch.architecture.hf_class == cfg.architecture == hf_class
    assert (cfg.n_kv_heads, cfg.d_head, cfg.rotary_pct, cfg.tie_embeddings, cfg.sliding_window) == \
        (n_kv, head_dim, pct, tied, window)
    assert (cfg.bias_of("qkv"), cfg.bias_of("attn_out"), cfg.bias_of("ffn")) == biases
    assert cfg.positional == "rotary" and cfg.n_layers == 2 and cfg.context_length == 64
    assert (cfg.norm_type, cfg.ffn, cfg.parallel_residual) == (
        ("layernorm", "plain", True) if arch.case.name == "pythia" else ("rmsnorm", "gated", False))
    assert (arch.ckpt.model.lm_head.weight is arch.ckpt.model.tok_emb.weight) == tied
    assert cfg.qk_norm == (arch.case.name == "qwen3")
    assert arch.ckpt.model.new_kv_cache(2).keys[0].shape == (2, n_kv or cfg.n_heads, 64, head_dim)


def test_logits_and_every_attention_map_match_transformers(arch):
    model, hf = arch.ckpt.model, arch.hf
    ids = ids_for(arch.ckpt, 2, 40)
    with torch.no_grad():
        ref = hf(ids, output_attentions=True)
        ours = model(ids, return_attention=True)
        fast = model(ids).logits
    torch.testing.assert_close(ours.logits, ref.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(fast, ref.logits, atol=1e-4, rtol=0)
    assert len(ours.attentions) == len(ref.attentions) == 2
    for a, b in zip(ours.attentions, ref.attentions):
        assert a.shape == b.shape == (2, 4, 40, 40)  # one map per query head, GQA or not
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert (ours.attentions[0][:, 0] - ours.attentions[0][:, 1]).abs().max() > 0.05  # heads differ
    if arch.case.name == "mistral":  # the window of 8: a query's keys more than 7 back get exactly 0
        assert (ours.attentions[1][:, :, 30, :23] == 0).all() and (ours.attentions[1][:, :, 30, 23:31] > 0).all()


def test_every_hook_point_is_a_module_named_as_hooks_see_it(arch):
    """named_modules lists each HookPoint under its TransformerLens name, every one of them, and those
    names are what a forward that keeps everything keeps; the logits stay the same bits."""
    model = arch.ckpt.model
    points = {n for n, m in model.named_modules() if isinstance(m, HookPoint)}
    rotary = {"hook_rot_q", "hook_rot_k"}  # every architecture here has rotary positions
    per_attn = {"hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z"} | rotary
    per_block = {"hook_resid_pre", "hook_attn_out", "hook_mlp_out", "hook_resid_post"}
    assert points == {f"blocks.{l}.{p}" for l in range(model.config.n_layers) for p in per_block} | {
        f"blocks.{l}.attn.{p}" for l in range(model.config.n_layers) for p in per_attn}
    ids = ids_for(arch.ckpt, 1, 12)
    everything = Hooks(record=lambda n: True)
    with torch.no_grad():
        plain = model(ids).logits
        with hooked(model, everything):
            kept = model(ids).logits
    assert set(everything.captured) == points
    torch.testing.assert_close(kept, plain, atol=1e-5, rtol=0)  # hook_pattern takes the explicit softmax


@pytest.mark.slow
def test_greedy_32_tokens_equal_transformers_generate(arch):
    tok, model = arch.ckpt.tokenizer, arch.ckpt.model
    prompt = tok.encode_prompt("To be, or not")
    ours = [t.id for t in generate_tokens(model, prompt, 32, SamplingParams(temperature=0))]
    with torch.no_grad():
        out = arch.hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                               pad_token_id=tok.eos_id, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    theirs = out[0, len(prompt):].tolist()
    assert ours[:len(theirs)] == theirs
    if len(theirs) < 32:  # transformers stops at an EOS id; we leave stopping to the caller
        assert theirs[-1] in tok.eos_ids
    assert len(set(ours)) > 3  # not a degenerate repetition


@pytest.mark.slow
def test_incremental_decoding_equals_a_full_recompute(arch):
    """A 7-token prefill, a 5-token chunk, then one token at a time to 24: every step's logits and
    attention rows against our own full recompute (Mistral's window of 8 slides past its start)."""
    model = arch.ckpt.model
    ids = ids_for(arch.ckpt, 1, 24, seed=1)[0].tolist()
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        model(torch.tensor([ids[:7]]), kv_cache=cache)
        chunk = model(torch.tensor([ids[7:12]]), kv_cache=cache, return_attention=True)
        full = model(torch.tensor([ids[:12]]), return_attention=True)
        torch.testing.assert_close(chunk.logits, full.logits[:, 7:12], atol=1e-4, rtol=0)
        for a, b in zip(chunk.attentions, full.attentions):
            torch.testing.assert_close(a, b[:, :, 7:12, :12], atol=1e-5, rtol=0)
        for t in range(12, 24):
            step = model(torch.tensor([[ids[t]]]), kv_cache=cache, return_attention=True)
            logits, rows = full_last(model, ids[:t + 1])
            torch.testing.assert_close(step.logits[0, -1], logits, atol=1e-4, rtol=0)
            for a, b in zip(step.attentions, rows):
                torch.testing.assert_close(a[0, :, -1], b, atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [24]


@pytest.mark.slow
def test_batched_rows_of_different_lengths_equal_each_row_alone(arch):
    """The engine's path: right-padded prompts of 3, 17 and 9 tokens prefilled together, then 10
    batched decode steps (model.decoding.decode_step on a 3-row cache), one row streaming its
    attention: each row's tokens, log-probabilities and attention rows equal that row decoded alone."""
    together = assert_batched_rows_equal_each_alone(arch.ckpt, steps=10)
    assert all(t.attention is not None and t.attention[0].shape[0] == 4 for t in together[2])
    assert len({t.id for t in together[1]}) > 2


@pytest.mark.slow
def test_the_fixed_shape_step_equals_the_cached_forward(arch):
    """The CUDA-graph step (decode_fixed: keys over the whole capacity, rotary angles and the
    window from each row's length, no host sync), run eagerly through GraphedDecoder's padded
    bucket: the same logits, tokens and attention rows as the plain step."""
    from attnlens.model.cuda_graphs import GraphedDecoder

    model = arch.ckpt.model
    prompts = [ids_for(arch.ckpt, 1, n, seed=n)[0].tolist() for n in (5, 12, 2)]
    plain, graphed = model.new_kv_cache(4), model.new_kv_cache(4)
    decoder = GraphedDecoder(model, graphed, capture=False)
    samplers = [RowSampler(SamplingParams(temperature=0), return_attention=True) for _ in prompts]
    with torch.no_grad():
        for cache in (plain, graphed):
            for row, ids in enumerate(prompts):
                model(torch.tensor([ids]), kv_cache=cache, rows=slice(row, row + 1))
        last = torch.tensor([[1], [2], [3]])
        for _ in range(8):
            a = decode_step(model, plain, last, samplers)
            b = decode_step(model, graphed, last, samplers, graphs=decoder)
            torch.testing.assert_close(b.output.logits, a.output.logits, atol=1e-4, rtol=0)
            assert [t.id for t in a.tokens] == [t.id for t in b.tokens]
            for x, y in zip(a.tokens, b.tokens):
                for ra, rb in zip(x.attention, y.attention):
                    torch.testing.assert_close(rb, ra, atol=1e-5, rtol=0)
            last = torch.tensor([[t.id] for t in a.tokens])
    assert graphed.lengths.tolist() == plain.lengths.tolist() == [13, 20, 10, 0]


# --- export --------------------------------------------------------------------------------------


def test_export_loads_in_transformers_and_imports_back_exactly(arch, tmp_path):
    out, architecture = export_checkpoint(arch.ours, tmp_path / "hf")
    assert architecture is arch.architecture
    hf = load_hf(out, arch.case)
    ids = ids_for(arch.ckpt, 2, 30, seed=3)
    with torch.no_grad():
        ref, ours = hf(ids, output_attentions=True), arch.ckpt.model(ids, return_attention=True)
    torch.testing.assert_close(ours.logits, ref.logits, atol=1e-4, rtol=0)
    for a, b in zip(ours.attentions, ref.attentions):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert auto.chat_template == arch.case.tokenizer_config.get("chat_template")
    assert auto.eos_token == arch.case.tokenizer_config["eos_token"]
    back, _ = import_checkpoint(out, tmp_path / "back")
    a, b = load_checkpoint(arch.ours), load_checkpoint(back)
    assert b.config == a.config
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert b.tokenizer.special_tokens == a.tokenizer.special_tokens
    assert b.tokenizer.eos_ids == a.tokenizer.eos_ids


def test_export_refuses_an_architecture_that_cannot_express_the_model(arch):
    names = {"llama3": "gpt_neox", "llama2": "qwen2", "qwen2": "mistral", "mistral": "llama", "pythia": "llama",
             "qwen3": "llama"}
    reason = {"llama3": "GPT-NeoX uses LayerNorm", "llama2": "Qwen2 has biases on q, k, v only",
              "qwen2": "Mistral has no biases", "mistral": "Llama attends to every earlier position",
              "pythia": "Llama uses RMSNorm", "qwen3": r"Llama does not normalise queries and keys \(qk_norm=False\)"}
    with pytest.raises(ValueError, match=f"cannot export as .*{reason[arch.case.name]}"):
        find_for_export(arch.ckpt.config, names[arch.case.name])


# --- the tokenizer ---------------------------------------------------------------------------------


def test_the_checkpoints_own_tokenizer_round_trips_and_agrees_with_transformers(arch):
    tok = arch.ckpt.tokenizer
    auto = transformers.AutoTokenizer.from_pretrained(arch.src)
    assert tok.scheme == ("metaspace" if arch.case.tokenizer == "sentencepiece" else "byte_level")
    for text in ROUND_TRIP:
        ids = tok.encode(text)
        assert ids == auto.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text == auto.decode(ids)
        assert tok.encode_prompt(text) == auto(text)["input_ids"]  # BOS first where the tokenizer puts it
        pieces = b"".join(tok.token_bytes(i) for i in ids)  # what streaming adds up
        assert pieces.decode("utf-8") == (" " + text if tok.scheme == "metaspace" else text)
    assert tok.add_bos == (arch.case.name in ("llama3", "llama2", "mistral"))


def test_display_text_of_real_tokenizers(arch):
    """Spaces shown as spaces (not Ġ or ▁), special tokens as themselves, and a character split
    across tokens (Ω = CE A9: byte fallback, or byte-level fragments) as its bytes."""
    tok = arch.ckpt.tokenizer
    shown = tok.display_texts(tok.encode("To be, or not"))
    assert "".join(shown).strip() == "To be, or not" and not any(c in "".join(shown) for c in "Ġ\u2581")
    assert any(s.startswith(" ") for s in shown[1:])
    omega = tok.display_texts(tok.encode("Ω"))
    assert "".join(omega).strip() == "<0xCE><0xA9>" or omega[-1].strip() == "Ω"
    assert tok.decode(tok.encode("Ω")) == "Ω"
    eos = arch.case.tokenizer_config["eos_token"]
    assert tok.display_text(tok.eos_id) == eos and tok.eos_token == eos
    for special in arch.case.special:
        assert tok.display_text(tok.backend.token_to_id(special)) == special


def test_special_tokens_chat_template_and_stop_ids_are_carried(arch):
    tok, case = arch.ckpt.tokenizer, arch.case
    assert tok.chat_template == case.tokenizer_config.get("chat_template")
    assert tok.bos_token == case.tokenizer_config.get("bos_token")
    named = {k: v for k, v in case.tokenizer_config.items() if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    assert tok.template_tokens == named  # what a chat template reads, as transformers passes them
    stops = {tok.backend.token_to_id(t) for t in case.generation_eos} | {tok.eos_id}
    assert tok.eos_ids == stops
    saved = json.loads((arch.ours / "tokenizer_config.json").read_text())
    assert saved.get("chat_template") == case.tokenizer_config.get("chat_template")
    if case.generation_eos:
        assert set(json.loads((arch.ours / "generation_config.json").read_text())["eos_token_id"]) == stops


# --- refusals ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_src(tmp_path_factory) -> Path:
    src, _ = write_hf_checkpoint(CASES["llama3"], tmp_path_factory.mktemp("refusals") / "llama3")
    return src


@pytest.fixture()
def damaged(llama_src, tmp_path) -> Path:
    """A private copy of the Llama 3 directory that a test may damage."""
    return Path(shutil.copytree(llama_src, tmp_path / "src"))


def edit_config(src: Path, **changes) -> None:
    data = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (src / "config.json").write_text(json.dumps(data))


SUPPORTED = ("GPT2LMHeadModel, BertForMaskedLM, LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, "
             "GPTNeoXForCausalLM, Qwen3ForCausalLM")


@pytest.mark.parametrize("changes, message", [
    ({"architectures": ["PhiForCausalLM"], "model_type": "phi"},
     r"architecture 'PhiForCausalLM' \(model_type 'phi'\) is not supported; supported: " + SUPPORTED),
    ({"architectures": None, "model_type": "falcon"}, "model_type 'falcon' is not supported"),
    ({"architectures": ["LlamaForSequenceClassification"]},
     "architecture 'LlamaForSequenceClassification' is not supported .*imported as LlamaForCausalLM"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 16}},
     r"cannot import this Llama: rope scaling rope_type 'yarn' is not supported \(supported: default, linear, llama3\)"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ({"hidden_act": "gelu_fast"}, "hidden_act 'gelu_fast' is not supported"),
    ({"quantization_config": {"quant_method": "awq"}}, r"quantized weights \(quantization_config, awq\)"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5 is not supported by Llama"),
    ({"num_key_value_heads": 3}, r"invalid Llama config .*multiple of n_kv_heads"),
    ({"intermediate_size": 48}, r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape \[64, 32\] but config\.json "
                                r"implies \[48, 32\]"),
    ({"num_hidden_layers": 3}, r"missing tensor\(s\) model\.layers\.2\."),
    ({"hidden_act": "gelu_fast", "mlp_bias": "yes"}, "mlp_bias must be true or false, got 'yes'; hidden_act 'gelu_fast'"),
])
def test_import_refuses_what_it_cannot_run_naming_it(damaged, tmp_path, changes, message):
    edit_config(damaged, **changes)
    with pytest.raises(CheckpointError, match=message):
        import_checkpoint(damaged, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_qwen_sliding_window_layers_are_refused(tmp_path, name):
    src, _ = write_hf_checkpoint(CASES[name], tmp_path / name)
    edit_config(src, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(CheckpointError, match=f"cannot import this {name.title()}: use_sliding_window=true"):
        import_checkpoint(src, tmp_path / "out")


def test_qwen3_hooks_see_the_normalised_queries_and_keys_and_leave_the_output_alone(tmp_path):
    """hook_q / hook_k are what Qwen3's q_norm / k_norm give (before rotary positions), hook_rot_*
    what the maps are made of; recording them changes no logit; head_dim defaults to 128 (as
    Qwen3Config) when config.json leaves it out, and the export refusals name the q/k norm."""
    from attnlens.model.hooks import Hooks, hooked

    case = CASES["qwen3"]
    src, _ = write_hf_checkpoint(case, tmp_path / "hf", seed=5)
    out, _ = import_checkpoint(src, tmp_path / "ours")
    ckpt, hf = load_checkpoint(out), load_hf(src, case)
    ids = ids_for(ckpt, 2, 20, seed=6)
    seen = {}
    handles = [getattr(hf.model.layers[1].self_attn, n).register_forward_hook(
        lambda m, i, o, n=n: seen.__setitem__(n, o)) for n in ("q_norm", "k_norm")]
    try:
        with torch.no_grad():
            want = hf(ids).logits
    finally:
        for h in handles:
            h.remove()
    names = {f"blocks.1.attn.{n}" for n in ("hook_q", "hook_k", "hook_rot_q", "hook_rot_k")}
    with torch.no_grad():
        plain = ckpt.model(ids).logits
        with hooked(ckpt.model, Hooks(record=names)) as hooks:
            recorded = ckpt.model(ids).logits
    assert torch.equal(recorded, plain)
    torch.testing.assert_close(plain, want, atol=1e-4, rtol=0)
    got = hooks.captured
    assert got["blocks.1.attn.hook_q"].shape == seen["q_norm"].shape == (2, 20, 4, 32)  # [B, T, H, D]
    assert got["blocks.1.attn.hook_k"].shape == seen["k_norm"].shape == (2, 20, 2, 32)  # [B, S, K, D]
    torch.testing.assert_close(got["blocks.1.attn.hook_q"], seen["q_norm"], atol=1e-5, rtol=0)
    torch.testing.assert_close(got["blocks.1.attn.hook_k"], seen["k_norm"], atol=1e-5, rtol=0)
    assert not torch.allclose(got["blocks.1.attn.hook_rot_q"], got["blocks.1.attn.hook_q"])

    edit_config(src, head_dim=None)
    with pytest.raises(CheckpointError, match=r"self_attn\.q_proj\.weight has shape \[128, 64\] but config\.json "
                                              r"implies \[512, 64\]"):
        import_checkpoint(src, tmp_path / "no-head-dim")
    llama = load_checkpoint(import_checkpoint(write_hf_checkpoint(CASES["llama3"], tmp_path / "llama")[0],
                                              tmp_path / "llama-ours")[0]).config
    with pytest.raises(ValueError, match=r"cannot export as Qwen3: Qwen3 normalises each head's queries and keys "
                                         r"\(qk_norm=True\)"):
        find_for_export(llama, "qwen3")
    with pytest.raises(ValueError, match=r"cannot export as GPT-2: .*GPT-2 does not normalise queries and keys"):
        find_for_export(ckpt.config, "gpt2")


def test_import_refuses_missing_tokenizer_weights_and_an_untied_head_under_a_tied_config(damaged, tmp_path):
    out = tmp_path / "out"
    (damaged / "tokenizer.json").rename(damaged / "tokenizer.model")
    with pytest.raises(CheckpointError, match="no tokenizer.json found: only a SentencePiece tokenizer.model"):
        import_checkpoint(damaged, out)
    (damaged / "tokenizer.model").rename(damaged / "tokenizer.json")
    state = load_file(str(damaged / "model.safetensors"))
    edit_config(damaged, tie_word_embeddings=True)
    save_file(state, str(damaged / "model.safetensors"))  # still holds an lm_head unlike embed_tokens
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
        import_checkpoint(damaged, out)
    del state["model.norm.weight"]
    save_file(state, str(damaged / "model.safetensors"))
    edit_config(damaged, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.norm\.weight"):
        import_checkpoint(damaged, out)
    state["model.layers.0.extra.weight"] = torch.zeros(2)
    state["model.norm.weight"] = torch.ones(32)
    save_file(state, str(damaged / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) model\.layers\.0\.extra\.weight"):
        import_checkpoint(damaged, out)


def test_a_bf16_source_stays_bf16_and_the_context_can_be_capped(llama_src, tmp_path):
    src = Path(shutil.copytree(llama_src, tmp_path / "src"))
    state = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(src / "model.safetensors"))
    out, _ = import_checkpoint(src, tmp_path / "out", context_length=32)
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    ck = load_checkpoint(out)
    assert ck.config.context_length == 32 and ck.config.rope_scaling["original_max_position_embeddings"] == 16
    from helpers import make_tiny_checkpoint

    from attnlens.model.interop.hf import export_hf

    gpt2 = export_hf(make_tiny_checkpoint(tmp_path / "gpt2"), tmp_path / "gpt2-hf")
    with pytest.raises(CheckpointError, match="context-length cap is for rotary-position models"):
        import_checkpoint(gpt2, tmp_path / "gpt2-back", context_length=32)


def test_cli_imports_and_exports_a_llama(llama_src, tmp_path, capsys):
    from attnlens.app.cli.commands import main

    assert main(["import-hf", "--src", str(llama_src), "--out", str(tmp_path / "ours"), "--context-length", "48"]) == 0
    assert main(["export-hf", "--model", str(tmp_path / "ours"), "--out", str(tmp_path / "hf")]) == 0
    assert main(["info", "--model", str(tmp_path / "ours")]) == 0
    out = capsys.readouterr().out
    assert "from a transformers Llama, LlamaForCausalLM" in out
    assert "wrote a transformers Llama directory (LlamaForCausalLM)" in out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"] == 48
    assert main(["export-hf", "--model", str(tmp_path / "ours"), "--out", str(tmp_path / "x"),
                 "--architecture", "gpt2"]) == 2
    assert "cannot export as GPT-2" in capsys.readouterr().err
    bad = Path(shutil.copytree(llama_src, tmp_path / "bad"))
    edit_config(bad, architectures=["PhiForCausalLM"], model_type="phi")
    assert main(["import-hf", "--src", str(bad), "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "attnlens import-hf: error:" in err and "'PhiForCausalLM'" in err and "supported:" in err


def test_cli_generate_starts_a_llama_prompt_with_bos_and_stops_at_any_end_id(llama_src, tmp_path):
    """`attnlens generate` on an imported Llama 3 feeds <|begin_of_text|> first, as transformers'
    tokenizer(text) does, and stops at <|eot_id|> (generation_config.json) as at EOS."""
    import io
    from argparse import Namespace

    from attnlens.app.cli.generate_command import generate_to_terminal

    out, _ = import_checkpoint(llama_src, tmp_path / "ours")
    ckpt = load_checkpoint(out)
    tok = ckpt.tokenizer
    ids = tok.encode_prompt("To be")
    assert ids[0] == tok.bos_id == tok.backend.token_to_id("<|begin_of_text|>") and ids[1:] == tok.encode("To be")
    want = []
    for t in generate_tokens(ckpt.model, ids, 20, SamplingParams(temperature=0)):
        if t.id in tok.eos_ids:
            break
        want.append(t.id)
    buf = io.StringIO()
    args = Namespace(model=str(out), prompt="To be", max_new_tokens=20, temperature=0.0, top_k=None, top_p=1.0,
                     seed=None, device="cpu")
    assert generate_to_terminal(args, out=buf) == 0
    assert buf.getvalue() == "To be" + tok.decode_bytes(want).decode("utf-8", errors="replace") + "\n"
    assert tok.backend.token_to_id("<|eot_id|>") in tok.eos_ids and len(tok.eos_ids) == 2

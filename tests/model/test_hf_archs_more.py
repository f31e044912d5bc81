"""The architectures of issue 47 from disk, each proven against transformers: a small random
model of each class (tests/arch_helpers.py's MORE_CASES, special paths made to bite) saved with
a tokenizer, imported with import-hf, then: logits and every attention map against transformers
(eager attention), greedy generation, incremental decoding (dense and paged caches) against our
own full recompute, the fused C decode step refused, export back to transformers, the chat
template carried."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from attnlens.model.checkpoint import load_checkpoint
from attnlens.model.decoding import SamplingParams, generate_tokens
from attnlens.model.fused_decode import FUSED_PARTS, FusedDecode
from attnlens.model.interop.convert import export_checkpoint, import_checkpoint

transformers = pytest.importorskip("transformers")

from arch_helpers import (  # noqa: E402
    MORE_CASES,
    assert_batched_rows_equal_each_alone,
    ids_for,
    load_hf,
    write_hf_checkpoint,
)


@pytest.fixture(scope="module", params=list(MORE_CASES))
def arch(request, tmp_path_factory):
    case = MORE_CASES[request.param]
    root = tmp_path_factory.mktemp(case.name)
    src, _ = write_hf_checkpoint(case, root / "hf")
    out, architecture = import_checkpoint(src, root / "ours")
    return SimpleNamespace(case=case, src=src, ours=out, ckpt=load_checkpoint(out), hf=load_hf(src, case),
                           architecture=architecture)


def check_maps(ours, ref, n_heads: int, T: int) -> None:
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape == (b.shape[0], n_heads, T, T)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_logits_and_every_attention_map_match_transformers(arch):
    model, hf, cfg = arch.ckpt.model, arch.hf, arch.ckpt.config
    assert arch.architecture.hf_class == cfg.architecture == arch.case.model_class
    ids = ids_for(arch.ckpt, 2, 40)
    with torch.no_grad():
        ref = hf(ids, output_attentions=True)
        ours = model(ids, return_attention=True)
        fast = model(ids).logits
    torch.testing.assert_close(ours.logits, ref.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(fast, ref.logits, atol=1e-4, rtol=0)
    check_maps(ours.attentions, ref.attentions, cfg.n_heads, 40)
    for i, a in enumerate(ours.attentions):  # each windowed layer: keys more than window - 1 back get 0
        window = cfg.window_of(i)
        if window is not None:
            assert (a[:, :, 30, :31 - window] == 0).all() and (a[:, :, 30, 31 - window:31] > 0).all()
        else:
            assert (a[:, :, 30, :31] > 0).all()
    if cfg.final_softcap is not None:  # the cap bites: logits pressed against it
        assert ours.logits.abs().max() < cfg.final_softcap and ours.logits.abs().max() > 0.9 * cfg.final_softcap


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_generate(arch):
    tok, model = arch.ckpt.tokenizer, arch.ckpt.model
    prompt = tok.encode_prompt("To be, or not to be, that is the question")
    ours = [t.id for t in generate_tokens(model, prompt, 16, SamplingParams(temperature=0))]
    with torch.no_grad():
        out = arch.hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=tok.eos_id,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    theirs = out[0, len(prompt):].tolist()
    assert ours[:len(theirs)] == theirs


@pytest.mark.slow
@pytest.mark.parametrize("paged", [False, True])
def test_incremental_decoding_equals_a_full_recompute(arch, paged):
    """A 7-token prefill, a 5-token chunk, then one token at a time to 24 (windows of 8 slide past
    the start): every step's logits and attention rows against our own full recompute. The fused
    C step refuses a model with any part it does not compute (Gemma's), and takes the paged steps
    of those it can (Phi-3's until the window narrows the rows' mask)."""
    model = arch.ckpt.model
    if set(arch.ckpt.config.special_parts()) - FUSED_PARTS:
        assert FusedDecode.build(model) is None
    ids = ids_for(arch.ckpt, 1, 24, seed=1)[0].tolist()
    cache = model.new_kv_cache(1, paged=paged, pool_bytes=1 << 22) if paged else model.new_kv_cache(1)
    with torch.no_grad():
        model(torch.tensor([ids[:7]]), kv_cache=cache)
        chunk = model(torch.tensor([ids[7:12]]), kv_cache=cache, return_attention=True)
        full = model(torch.tensor([ids[:12]]), return_attention=True)
        torch.testing.assert_close(chunk.logits, full.logits[:, 7:12], atol=1e-4, rtol=0)
        for a, b in zip(chunk.attentions, full.attentions):
            torch.testing.assert_close(a, b[:, :, 7:12, :12], atol=1e-5, rtol=0)
        for t in range(12, 24):
            step = model(torch.tensor([[ids[t]]]), kv_cache=cache, return_attention=t % 2 == 0)
            whole = model(torch.tensor([ids[:t + 1]]), return_attention=True)
            torch.testing.assert_close(step.logits[0, -1], whole.logits[0, -1], atol=1e-4, rtol=0)
            if step.attentions is not None:
                for a, b in zip(step.attentions, whole.attentions):
                    torch.testing.assert_close(a[0, :, -1, :t + 1], b[0, :, -1], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_batched_rows_of_different_lengths_equal_each_row_alone(arch):
    """The engine's path: right-padded prompts of 3, 17 and 9 tokens prefilled together, then 8
    batched decode steps (each row's own positions, windows and rotary bases): each row's tokens,
    log-probabilities and attention rows equal that row decoded alone."""
    assert_batched_rows_equal_each_alone(arch.ckpt, steps=8)


@pytest.mark.slow
def test_the_fixed_shape_step_equals_the_cached_forward(arch):
    """The CUDA-graph step (decode_fixed: keys over the whole capacity, each layer's window and
    rotary angles from each row's length), run eagerly: the same logits, tokens and maps."""
    from attnlens.model.cuda_graphs import GraphedDecoder
    from attnlens.model.decoding import RowSampler, decode_step

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
        for _ in range(6):
            a = decode_step(model, plain, last, samplers)
            b = decode_step(model, graphed, last, samplers, graphs=decoder)
            torch.testing.assert_close(b.output.logits, a.output.logits, atol=1e-4, rtol=0)
            assert [t.id for t in a.tokens] == [t.id for t in b.tokens]
            for x, y in zip(a.tokens, b.tokens):
                for ra, rb in zip(x.attention, y.attention):
                    torch.testing.assert_close(rb, ra, atol=1e-5, rtol=0)
            last = torch.tensor([[t.id] for t in a.tokens])


def test_export_loads_in_transformers_and_imports_back_exactly(arch, tmp_path):
    out, architecture = export_checkpoint(arch.ours, tmp_path / "hf")
    assert architecture is arch.architecture
    hf = load_hf(out, arch.case)
    ids = ids_for(arch.ckpt, 2, 30, seed=3)
    with torch.no_grad():
        ref, ours = hf(ids, output_attentions=True), arch.ckpt.model(ids, return_attention=True)
    torch.testing.assert_close(ours.logits, ref.logits, atol=1e-4, rtol=0)
    check_maps(ours.attentions, ref.attentions, arch.ckpt.config.n_heads, 30)
    back, _ = import_checkpoint(out, tmp_path / "back")
    a, b = load_checkpoint(arch.ours), load_checkpoint(back)
    assert b.config == a.config
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_chat_template_renders_as_transformers(arch):
    from attnlens.app.serving.prompts import render_chat

    tok = arch.ckpt.tokenizer
    template = arch.case.tokenizer_config.get("chat_template")
    if template is None:
        pytest.skip("this tokenizer has no chat template")
    assert tok.chat_template == template
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": "To be?"}]
    auto = transformers.AutoTokenizer.from_pretrained(arch.src)
    want = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_chat(template, messages, tok.template_tokens) == want


@pytest.mark.parametrize("name, changes, message", [
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                  "long_factor": [2.0] * 4, "original_max_position_embeddings": 16}},
     r"cannot import this Phi-3: rope scaling rope_type 'longrope' is not supported"),
    ("gemma3", {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     r"cannot import this Gemma 3: a scaled rotary base on the sliding layers \(rope_type 'linear'\)"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    ("gemma2", {"layer_types": ["chunked_attention"] * 3}, "layer_types other than sliding_attention"),
])
def test_import_refuses_what_it_cannot_run_naming_it(tmp_path, name, changes, message):
    import json

    from attnlens.model.checkpoint import CheckpointError

    src, _ = write_hf_checkpoint(MORE_CASES[name], tmp_path / "hf")
    data = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**data, **changes}))
    with pytest.raises(CheckpointError, match=message):
        import_checkpoint(src, tmp_path / "out")


def test_export_refuses_what_the_architecture_cannot_express(arch):
    """A Gemma's parts named when it is written as a Llama; a Llama-shaped model refused as Gemma 2."""
    from attnlens.model.interop.convert import find_for_export

    cfg = arch.ckpt.config
    if cfg.special_parts():
        with pytest.raises(ValueError, match="cannot export as Llama: .*Llama has no "):
            find_for_export(cfg, "llama")
    else:
        with pytest.raises(ValueError, match=r"cannot export as Gemma 2: .*post_norms=True"):
            find_for_export(cfg, "gemma2")


def test_mixtral_hooks_record_which_experts_each_token_chose(tmp_path):
    """blocks.{i}.ffn.hook_experts holds the experts transformers' router chose for every token
    (the same set, most probable first) and hook_router their probabilities; recording them
    changes no logit; editing the router's probabilities reroutes."""
    from attnlens.model.hooks import Hooks, hooked

    case = MORE_CASES["mixtral"]
    src, _ = write_hf_checkpoint(case, tmp_path / "hf", seed=2)
    ckpt, hf = load_checkpoint(import_checkpoint(src, tmp_path / "ours")[0]), load_hf(src, case)
    ids = ids_for(ckpt, 2, 20, seed=4)
    seen = {}
    handle = hf.model.layers[1].mlp.gate.register_forward_hook(lambda m, i, o: seen.__setitem__("gate", o))
    try:
        with torch.no_grad():
            want = hf(ids).logits
    finally:
        handle.remove()
    names = {"blocks.1.ffn.hook_router", "blocks.1.ffn.hook_experts"}
    with torch.no_grad():
        plain = ckpt.model(ids).logits
        with hooked(ckpt.model, Hooks(record=names)) as hooks:
            recorded = ckpt.model(ids).logits
    assert torch.equal(recorded, plain)
    torch.testing.assert_close(plain, want, atol=1e-4, rtol=0)
    experts, probs = hooks.captured["blocks.1.ffn.hook_experts"], hooks.captured["blocks.1.ffn.hook_router"]
    assert experts.shape == (2, 20, 2) and probs.shape == (2, 20, 4)
    logits, _, indices = seen["gate"]
    assert torch.equal(experts.reshape(-1, 2), indices)
    torch.testing.assert_close(probs.reshape(-1, 4), torch.softmax(logits.float(), dim=-1), atol=1e-6, rtol=0)
    assert len(experts.unique()) == 4  # every expert serves some token

    class ExpertZeroFirst(Hooks):  # every token's router probabilities edited: expert 0 most probable
        def point(self, name, tensor):
            tensor = super().point(name, tensor)
            return tensor + torch.tensor([1.0, 0, 0, 0]) if name.endswith("hook_router") else tensor

    with torch.no_grad(), hooked(ckpt.model, ExpertZeroFirst(record=names)) as hooks:
        rerouted = ckpt.model(ids).logits
    assert (hooks.captured["blocks.1.ffn.hook_experts"][..., 0] == 0).all()
    assert not torch.allclose(rerouted, plain)


def test_the_views_recompute_gemma_2s_capped_windowed_maps(tmp_path):
    """The analysis views that recompute a head's attention from its q and k (the attention
    reductions' blocks; the step-by-step explain) cap the scores and use each layer's own window,
    as the forward does: their maps equal the model's on both kinds of layer."""
    from attnlens.model.analysis.attention_maps import Window, blocked_maps
    from attnlens.model.analysis.explain import explain_head

    case = MORE_CASES["gemma2"]
    ckpt = load_checkpoint(import_checkpoint(write_hf_checkpoint(case, tmp_path / "hf")[0], tmp_path / "ours")[0])
    model, ids = ckpt.model, ids_for(ckpt, 1, 24, seed=7)[0].tolist()
    with torch.no_grad():
        full = model(torch.tensor([ids]), return_attention=True).attentions  # per layer (1, H, T, T)
    layers, heads = [0, 1], [0, 3]
    reductions = {"self": Window(2, 2, (0, 24), (0, 24))}
    blocked_maps(model, {"tokens": ids}, layers, heads, reductions, block_bytes=2048)
    got = reductions["self"].result()["maps"]  # (L', H', T, T)
    for i, layer in enumerate(layers):
        torch.testing.assert_close(got[i], full[layer][0, heads], atol=1e-5, rtol=0)
    for layer in layers:  # 0: sliding (window 8), 1: full
        step = explain_head(model, ids, None, "self", layer, 2, 20, ())
        torch.testing.assert_close(torch.tensor(step["softmax"]).float(), full[layer][0, 2, 20], atol=1e-5, rtol=0)
        assert sum(step["mask"]) == (8 if layer == 0 else 21)


def test_the_lens_shows_which_experts_each_block_chose(tmp_path):
    """The logit lens of a Mixtral: each block's row carries, per position, the experts the block
    routed it to and their weights (as transformers' router chose them: the hooks test above)."""
    from attnlens.model.analysis.explain import lens_report
    from attnlens.model.hooks import Hooks, hooked

    case = MORE_CASES["mixtral"]
    ckpt = load_checkpoint(import_checkpoint(write_hf_checkpoint(case, tmp_path / "hf")[0], tmp_path / "ours")[0])
    ids = ids_for(ckpt, 1, 12, seed=5)[0].tolist()
    report = lens_report(ckpt.model, ids, None, (), top_k=3, positions=[0, 5, 11])
    assert "experts" not in report["layers"][0]  # the embeddings
    names = {f"blocks.{l}.ffn.hook_experts" for l in range(2)}
    with torch.no_grad(), hooked(ckpt.model, Hooks(record=names)) as hooks:
        ckpt.model(torch.tensor([ids]))
    for row in report["layers"][1:]:
        chosen = hooks.captured[f"blocks.{row['index']}.ffn.hook_experts"][0, [0, 5, 11]].tolist()
        assert [[e for e, _ in p] for p in row["experts"]] == chosen
        assert all(abs(sum(w for _, w in p) - 1) < 1e-6 and p[0][1] >= p[1][1] for p in row["experts"])


@pytest.mark.parametrize("name, changes, want", [
    ("gemma2", {"layer_types": None}, ["sliding", "full", "sliding"]),  # Gemma 2's released configs
    ("gemma3", {"layer_types": None, "sliding_window_pattern": 2}, ["sliding", "full"] * 2),
    ("gemma3", {"layer_types": None, "rope_parameters": None, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, None),  # 4 layers, the default 6: all sliding
])
def test_gemma_configs_without_layer_types_take_transformers_defaults(tmp_path, name, changes, want):
    """The configs Gemma 2 and 3 were released with list no layer_types (nor Gemma 3's rope per
    layer type): the pattern transformers fills in is the one imported, and the logits agree."""
    import json

    case = MORE_CASES[name]
    src, _ = write_hf_checkpoint(case, tmp_path / "hf", seed=4)
    data = json.loads((src / "config.json").read_text())
    data.update(changes)
    (src / "config.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    ckpt = load_checkpoint(import_checkpoint(src, tmp_path / "ours")[0])
    assert ckpt.config.layer_types == want and ckpt.config.sliding_window == 8
    hf = load_hf(src, case)
    ids = ids_for(ckpt, 1, 30, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(ckpt.model(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)

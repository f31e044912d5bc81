"""model/hooks.py: named intermediates and head ablation, checked against transformers on the same
weights (GPT-2, BERT), TransformerLens's definitions written out here, and full recomputes."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TINY_TEXT, head_slice_prehook, small_config_model

from attnlens.model import load_checkpoint
from attnlens.model.analysis.explain import (
    explain_head,
    lens_names,
    lens_report,
    logits_report,
    sequence_logits,
    sequence_of,
)
from attnlens.model.decoding import SamplingParams, generate_tokens
from attnlens.model.families import family_of
from attnlens.model.hooks import (
    AblationError,
    HeadAblation,
    HookPoint,
    Hooks,
    ablation_targets,
    hooked,
    run_until,
    unchanged_outputs,
)

transformers = pytest.importorskip("transformers")


def targets(model, *ablations, limit=None):
    return ablation_targets(family_of(model), model.config, list(ablations), limit=limit)


def ids_for(vocab: int, n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory, ckpt):
    """One model of every family and the parts that change attention: GPT-2-shaped, Llama-shaped
    (GQA, rotary, RMSNorm, gated FFN, sliding window), GPT-NeoX-shaped (parallel residual, partial
    rotary), an encoder and an encoder-decoder."""
    from encoder_helpers import make_tiny_encoder
    from translator_helpers import make_tiny_translator

    root = tmp_path_factory.mktemp("hooks")
    return {
        "gpt2": ckpt.model.eval(),
        "llama": small_config_model(positional="rotary", n_kv_heads=2, norm_type="rmsnorm", ffn="gated",
                                    activation="silu", bias=False, tie_embeddings=False, sliding_window=6),
        "neox": small_config_model(positional="rotary", rotary_pct=0.5, parallel_residual=True),
        "encoder": load_checkpoint(make_tiny_encoder(root / "enc")).model.eval(),
        "translator": load_checkpoint(make_tiny_translator(root / "tr")).model.eval(),
    }


def source(model, n=9):
    return ids_for(model.config.vocab_size, n, seed=n)


@pytest.mark.parametrize("name", ["gpt2", "llama", "neox", "encoder", "translator"])
def test_hooks_unused_or_empty_change_nothing_bit_for_bit(models, name):
    model = models[name]
    seq = sequence_of(model, source(model), [5, 6, 7] if family_of(model).takes_target else None)
    with torch.inference_mode():
        plain = sequence_logits(model, seq, None)
        empty = sequence_logits(model, seq, Hooks())
        streams = Hooks(record=lambda name: not name.endswith("hook_pattern"), ablate=())
        recorded = sequence_logits(model, seq, streams)
        # asking for the probabilities takes the explicit softmax path instead of SDPA's kernel
        everything = Hooks(record=lambda name: True)
        with_patterns = sequence_logits(model, seq, everything)
    assert torch.equal(plain, empty) and torch.equal(plain, recorded)
    assert streams.captured and everything.captured  # and it did record
    torch.testing.assert_close(with_patterns, plain, atol=1e-5, rtol=0)


def test_hook_names_and_shapes_gqa_rotary(models):
    model = models["llama"]
    T, H, K, D, C = 10, 4, 2, 8, 32
    hooks = Hooks(record=lambda n: True)
    with torch.inference_mode(), hooked(model, hooks):
        model(torch.tensor([ids_for(97, T)]))
    got = {k: tuple(v.shape) for k, v in hooks.captured.items()}
    for l in range(2):
        assert got[f"blocks.{l}.hook_resid_pre"] == got[f"blocks.{l}.hook_resid_post"] == (1, T, C)
        assert got[f"blocks.{l}.hook_attn_out"] == got[f"blocks.{l}.hook_mlp_out"] == (1, T, C)
        a = f"blocks.{l}.attn"
        assert got[f"{a}.hook_q"] == got[f"{a}.hook_rot_q"] == got[f"{a}.hook_z"] == (1, T, H, D)
        assert got[f"{a}.hook_k"] == got[f"{a}.hook_rot_k"] == got[f"{a}.hook_v"] == (1, T, K, D)
        assert got[f"{a}.hook_pattern"] == (1, H, T, T)
    # the residual stream adds up: resid_post = resid_pre + attn_out + mlp_out (pre-LN)
    c = hooks.captured
    torch.testing.assert_close(c["blocks.0.hook_resid_post"],
                               c["blocks.0.hook_resid_pre"] + c["blocks.0.hook_attn_out"] + c["blocks.0.hook_mlp_out"])


def expected_points(model) -> list[str]:
    """TransformerLens's names of every hook point of `model`, in the order a forward passes them,
    written out from the family and the config (model/hooks.py's table)."""
    rotary = model.config.positional == "rotary"
    attn = ["hook_q", "hook_k", *(["hook_rot_q", "hook_rot_k"] if rotary else []), "hook_v", "hook_pattern", "hook_z"]
    cross = family_of(model).name == "encoder-decoder"
    stacks = [("encoder.blocks", False), ("decoder.blocks", True)] if cross else [("blocks", False)]
    names = []
    for stack, with_cross in stacks:
        for l in range(model.config.n_layers):
            b = f"{stack}.{l}"
            names += [f"{b}.hook_resid_pre", *(f"{b}.attn.{a}" for a in attn), f"{b}.hook_attn_out"]
            if with_cross:
                names += [*(f"{b}.cross_attn.{a}" for a in attn if "rot" not in a), f"{b}.hook_cross_out"]
            names += [f"{b}.hook_mlp_out", f"{b}.hook_resid_post"]
    return names


@pytest.mark.parametrize("name", ["gpt2", "llama", "neox", "encoder", "translator"])
def test_named_modules_list_every_hook_point_by_the_name_hooks_see(models, name):
    """Hook points are modules: named_modules lists each under its TransformerLens name (its path, and
    its own `name`), and a forward that keeps everything keeps exactly those names."""
    model = models[name]
    points = [(n, m) for n, m in model.named_modules() if isinstance(m, HookPoint)]
    assert [n for n, _ in points] == expected_points(model)
    assert all(m.name == n for n, m in points)
    seq = sequence_of(model, source(model), [5, 6, 7] if family_of(model).takes_target else None)
    everything = Hooks(record=lambda n: True)
    with torch.inference_mode():
        sequence_logits(model, seq, everything)
    assert set(everything.captured) == {n for n, _ in points}
    assert not any("hook_" in k for k in model.state_dict())  # no parameters, no buffers: no checkpoint keys


@pytest.mark.parametrize("name", ["gpt2", "llama", "neox", "encoder", "translator"])
def test_forward_returns_the_same_with_and_without_hooks(models, name):
    """Keeping every point, or ablating a head, never changes what forward returns: the same output
    type and fields, every tensor the same shape; kept or unused, the same bits."""
    model = models[name]
    ids = torch.tensor([source(model)])
    extra = {"source": ids} if family_of(model).takes_target else {}
    inputs = torch.tensor([[5, 6, 7, 8]]) if extra else ids
    with torch.inference_mode():
        plain = model(inputs, return_attention=True, **extra)
        with hooked(model, Hooks(record=lambda n: True)):
            kept = model(inputs, return_attention=True, **extra)
        with hooked(model, Hooks(ablate=targets(model, HeadAblation(1, 2, "zero")))):
            ablated = model(inputs, return_attention=True, **extra)
    for out in (kept, ablated):
        assert type(out) is type(plain)
        for a, b in zip(plain, out):
            assert (a is None) == (b is None)
            if a is not None:
                pairs = zip(a, b) if isinstance(a, list) else [(a, b)]
                assert all(x.shape == y.shape for x, y in pairs)
    for a, b in zip(plain, kept):
        if a is not None:
            assert all(torch.equal(x, y) for x, y in (zip(a, b) if isinstance(a, list) else [(a, b)]))
    assert not torch.equal(plain.logits, ablated.logits)


def test_a_hook_point_is_a_module_a_torch_hook_on_it_can_edit(models):
    """Without active hooks a point returns its input and the forward never calls it; under them a
    torch forward hook on it sees the tensor, and what it returns is what the forward goes on with."""
    model = models["gpt2"]
    point = model.get_submodule("blocks.1.hook_resid_post")
    x = torch.randn(2, 3)
    assert point(x) is x and point.name == "blocks.1.hook_resid_post"
    seen = []

    def zero(module, args, out):
        seen.append(out.shape)
        return torch.zeros_like(out)

    handle = point.register_forward_hook(zero)
    try:
        with torch.inference_mode():
            plain = model(torch.tensor([source(model)])).logits
            assert seen == []  # no hooks: the point was never called
            with hooked(model, Hooks()):
                zeroed = model(torch.tensor([source(model)])).logits
    finally:
        handle.remove()
    assert seen == [(1, 9, model.config.d_model)]
    # the last block's output zeroed: every position's logits are the head's of ln_f(0)
    assert torch.equal(zeroed[0], zeroed[0, :1].expand_as(zeroed[0])) and not torch.equal(zeroed, plain)


def test_translator_hook_names(models):
    model = models["translator"]
    hooks = Hooks(record=lambda n: True)
    with torch.inference_mode():
        sequence_logits(model, sequence_of(model, source(model, 7), [4, 5, 6, 8]), hooks)
    S, T = 7, 5
    c = hooks.captured
    assert c["encoder.blocks.0.attn.hook_pattern"].shape[-2:] == (S, S)
    assert c["decoder.blocks.0.attn.hook_pattern"].shape[-2:] == (T, T)
    assert c["decoder.blocks.0.cross_attn.hook_pattern"].shape[-2:] == (T, S)
    assert c["decoder.blocks.0.hook_cross_out"].shape[:2] == (1, T)


@pytest.mark.parametrize("name", ["llama", "encoder", "translator"])
def test_stop_after_keeps_what_came_before_and_never_reaches_the_head(models, name):
    model = models[name]
    ids = source(model)
    seq = sequence_of(model, ids, None)
    last = lens_names(model)[-1]
    full = Hooks(record={last})
    with torch.inference_mode():
        logits = sequence_logits(model, seq, full)
    final_norm = model.decoder_norm if name == "translator" else model.ln_f
    calls = []
    handle = final_norm.register_forward_hook(lambda *_: calls.append(1))
    stopped = Hooks(record={last}, stop_after=last)
    try:
        with torch.inference_mode():
            run_until(model, stopped, lambda: model.stream_logits(seq.tokens))
    finally:
        handle.remove()
    assert calls == []  # the final norm (and so the head) never ran
    assert torch.equal(stopped.captured[last], full.captured[last])
    with torch.inference_mode():  # the unembedded residual is the model's own logits
        torch.testing.assert_close(model.unembed(stopped.captured[last][0]).float(), logits, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="never reached"):
        run_until(model, Hooks(stop_after="blocks.99.hook_resid_post"), lambda: model.stream_logits(seq.tokens))


def test_ablation_targets_are_checked(models):
    model = models["translator"]
    assert targets(model, HeadAblation(1, 2, "mean"))[0].module == "decoder.blocks.1.attn"  # default group
    assert targets(model, HeadAblation(0, 0, "zero", "cross"))[0].module == "decoder.blocks.0.cross_attn"
    for bad, match in [(HeadAblation(9, 0), "layer 9"), (HeadAblation(0, 9), "head 9"),
                       (HeadAblation(0, 0, "half"), "how"), (HeadAblation(0, 0, "zero", "self"), "no attention group")]:
        with pytest.raises(AblationError, match=match):
            targets(model, bad)
    with pytest.raises(AblationError, match="twice"):
        targets(model, HeadAblation(0, 1), HeadAblation(0, 1, "mean", "decoder"))
    with pytest.raises(AblationError, match="at most 1"):
        targets(model, HeadAblation(0, 1), HeadAblation(0, 2), limit=1)


# --- ablation against transformers ---------------------------------------------------------


@pytest.mark.parametrize("how", ["zero", "mean"])
def test_gpt2_head_ablation_equals_transformers_with_a_c_proj_pre_hook(gpt2_export, how):
    ours, hf = gpt2_export
    model = ours.model.eval()
    ids = ours.tokenizer.encode(TINY_TEXT)[:40]
    D = model.config.d_model // model.config.n_heads
    ablations = [(1, 2), (0, 3)]
    handles = [hf.transformer.h[l].attn.c_proj.register_forward_pre_hook(head_slice_prehook(h, D, how))
               for l, h in ablations]
    try:
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits[0]
    finally:
        for handle in handles:
            handle.remove()
    with torch.inference_mode():
        seq = sequence_of(model, ids, None)
        edits = targets(model, *(HeadAblation(l, h, how) for l, h in ablations))
        mine = sequence_logits(model, seq, Hooks(ablate=edits))
        clean = sequence_logits(model, seq, None)
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    assert (mine - clean).abs().max() > 1e-2  # the ablation did something


@pytest.mark.parametrize("how", ["zero", "mean"])
def test_bert_head_ablation_equals_transformers(tmp_path, how):
    from test_hf_bert import make_wordpiece_tokenizer_json

    from attnlens.model.interop.hf_bert import import_bert

    src = tmp_path / "bert"
    src.mkdir()
    make_wordpiece_tokenizer_json(src / "tokenizer.json")
    torch.manual_seed(7)
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=40)
    hf = transformers.BertForMaskedLM(cfg).eval()
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    hf.save_pretrained(src)
    hf = transformers.BertForMaskedLM.from_pretrained(src, attn_implementation="eager").eval()
    model = load_checkpoint(import_bert(src, tmp_path / "ours")).model.eval()
    ids = ids_for(120, 17, seed=2)
    handle = hf.bert.encoder.layer[1].attention.output.dense.register_forward_pre_hook(head_slice_prehook(3, 8, how))
    try:
        with torch.no_grad():
            theirs = hf(input_ids=torch.tensor([ids])).logits[0]
    finally:
        handle.remove()
    with torch.inference_mode():
        seq = sequence_of(model, ids, None)
        mine = sequence_logits(model, seq, Hooks(ablate=targets(model, HeadAblation(1, 3, how))))
        empty = sequence_logits(model, seq, Hooks(ablate=()))
        plain = sequence_logits(model, seq, None)
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    assert torch.equal(empty, plain)


# --- the lens ------------------------------------------------------------------------------


def test_lens_equals_transformers_hidden_states_through_ln_f_and_lm_head(gpt2_export):
    ours, hf = gpt2_export
    model = ours.model.eval()
    ids = ours.tokenizer.encode(TINY_TEXT)[:30]
    report = lens_report(model, ids, None, (), top_k=3, rank=True)
    torch.set_grad_enabled(False)
    try:
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    finally:
        torch.set_grad_enabled(True)
    L = model.config.n_layers
    assert [row["index"] for row in report["layers"]] == list(range(-1, L))
    for l, row in enumerate(report["layers"]):
        # transformers' last hidden state already went through ln_f
        with torch.no_grad():
            h = out.hidden_states[l] if l == L else hf.transformer.ln_f(out.hidden_states[l])
            probs = torch.softmax(hf.lm_head(h)[0], dim=-1)
        top = torch.topk(probs, 3)
        assert row["top_ids"] == top.indices.tolist()
        assert row["top_probs"] == [pytest.approx(v, abs=1e-5) for v in top.values.tolist()]
        for t in range(len(ids)):
            if t + 1 < len(ids):
                assert report["actual"][t] == ids[t + 1]
                assert row["prob"][t] == pytest.approx(float(probs[t, ids[t + 1]]), abs=1e-5)
                assert row["rank"][t] == int((probs[t] > probs[t, ids[t + 1]]).sum())
            else:
                assert report["actual"][t] is None and row["rank"][t] is None and row["prob"][t] is None
    # the last row is the model's own output
    final = torch.softmax(out.logits[0], dim=-1)
    assert report["layers"][-1]["top_probs"][4] == pytest.approx(torch.topk(final[4], 3).values.tolist(), abs=1e-5)


@pytest.mark.parametrize("name", ["llama", "encoder", "translator"])
def test_lens_last_row_is_the_models_logits(models, name):
    model = models[name]
    ids = source(model)
    report = lens_report(model, ids, None, (), top_k=4)
    with torch.inference_mode():
        probs = torch.softmax(sequence_logits(model, sequence_of(model, ids, None), None), dim=-1)
    last = report["layers"][-1]
    for t in range(len(probs)):
        assert last["top_ids"][t] == torch.topk(probs[t], 4).indices.tolist()
        assert last["top_probs"][t] == pytest.approx(torch.topk(probs[t], 4).values.tolist(), abs=1e-5)


def test_lens_at_chosen_positions_is_the_full_lens_at_those_columns(models, monkeypatch):
    """`positions` unembeds only those columns, in the order asked, and each is the full report's
    column; a rank not asked for is None. Blocks of 7 rows (BLOCK_FLOATS) and slices of 3
    (SLICE_FLOATS) across the rows give the same numbers as one block."""
    from attnlens.model.analysis import vocab_rows

    model = models["llama"]
    ids = source(model)
    full = lens_report(model, ids, None, (), top_k=3, rank=True)
    V = model.config.vocab_size
    monkeypatch.setattr(vocab_rows, "BLOCK_FLOATS", 7 * V)
    monkeypatch.setattr(vocab_rows, "SLICE_FLOATS", 3 * V)
    at = [len(ids) - 1, 0, 3]
    part = lens_report(model, ids, None, (), top_k=3, positions=at, rank=True)
    bare = lens_report(model, ids, None, (), top_k=3, positions=at)
    assert part["positions"] == at and part["actual"] == [full["actual"][p] for p in at]
    for f, p, b in zip(full["layers"], part["layers"], bare["layers"]):
        assert p["top_ids"] == [f["top_ids"][i] for i in at]
        assert p["top_probs"] == [pytest.approx(f["top_probs"][i], abs=1e-6) for i in at]
        assert p["rank"] == [f["rank"][i] for i in at]
        assert p["prob"] == [pytest.approx(f["prob"][i], abs=1e-6) if f["prob"][i] is not None else None for i in at]
        assert b["rank"] == [None] * len(at) and b["prob"] == p["prob"]


# --- logits and their effect ---------------------------------------------------------------


@pytest.mark.parametrize("name,ablation,skipped", [
    ("gpt2", HeadAblation(1, 3, "mean"), ["blocks.0"]),
    ("gpt2", HeadAblation(0, 1, "zero"), []),
    ("neox", HeadAblation(1, 0, "zero"), ["blocks.0"]),
    ("encoder", HeadAblation(1, 2, "mean"), ["blocks.0"]),
    ("translator", HeadAblation(1, 0, "zero", "cross"), ["encoder.blocks.0", "encoder.blocks.1", "decoder.blocks.0"]),
    ("translator", HeadAblation(1, 1, "mean", "encoder"), ["encoder.blocks.0"]),
])
def test_an_ablated_run_from_the_clean_runs_unchanged_blocks_equals_a_full_recompute(models, name, ablation, skipped):
    """Hooks.given (start_at_layer): the blocks before the first ablated head are taken from the clean
    run, not run again, and the logits are those of the whole ablated forward, bit for bit."""
    model = models[name]
    edits = targets(model, ablation)
    seq = sequence_of(model, source(model), None)
    clean = Hooks(record=lambda n: n.endswith(".hook_resid_post"))
    with torch.inference_mode():
        sequence_logits(model, seq, clean)
    given = unchanged_outputs(clean.captured, edits)
    assert list(given) == [f"{b}.hook_resid_post" for b in skipped]
    first = model.get_submodule(f"{skipped[0]}.attn") if skipped else None  # a module's path is its hook name
    calls = []
    handle = first.register_forward_hook(lambda *_: calls.append(1)) if first is not None else None
    try:
        with torch.inference_mode():
            resumed = sequence_logits(model, seq, Hooks(ablate=edits, given=given))
    finally:
        if handle is not None:
            handle.remove()
    assert calls == []  # the given blocks did not run
    with torch.inference_mode():
        whole = sequence_logits(model, seq, Hooks(ablate=edits))
    assert torch.equal(resumed, whole)


def test_logits_report_effect_is_kl_and_delta_logprob(models):
    model = models["gpt2"]
    ids = source(model, 12)
    edits = targets(model, HeadAblation(0, 1, "zero"), HeadAblation(1, 3, "mean"))
    report = logits_report(model, ids, None, edits, top_k=5, last_only=False)
    with torch.inference_mode():
        seq = sequence_of(model, ids, None)
        clean = torch.log_softmax(sequence_logits(model, seq, None), -1).double()
        edited = torch.log_softmax(sequence_logits(model, seq, Hooks(ablate=edits)), -1).double()
    for t, e in enumerate(report["effect"]):
        kl = float((clean[t].exp() * (clean[t] - edited[t])).sum())  # KL(clean || ablated), written out
        assert e["kl"] == pytest.approx(kl, abs=1e-5)
        if t + 1 < len(ids):
            assert e["delta_logprob"] == pytest.approx(float(edited[t, ids[t + 1]] - clean[t, ids[t + 1]]), abs=1e-5)
        assert report["clean"][t]["next_logprob"] == (None if t + 1 == len(ids) else
                                                      pytest.approx(float(clean[t, ids[t + 1]]), abs=1e-5))
    last = logits_report(model, ids, None, (), top_k=2, last_only=True)
    assert [p["position"] for p in last["positions"]] == [len(ids) - 1] and "effect" not in last


# --- explain ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,group,query", [("gpt2", "self", 7), ("llama", "self", 9), ("neox", "self", 4),
                                              ("encoder", "self", 3), ("translator", "encoder", 2),
                                              ("translator", "decoder", 3), ("translator", "cross", 1)])
def test_explain_recomputes_the_maps_row_and_z(models, name, group, query):
    model = models[name]
    ids = source(model, 10)
    target = [4, 5, 6, 7] if family_of(model).takes_target else None
    e = explain_head(model, ids, target, group, 1, 3, query, ())
    assert max(abs(a - b) for a, b in zip(e["softmax"], e["pattern_row"])) < 1e-6
    assert max(abs(a - b) for a, b in zip(e["z"], e["z_model"])) < 1e-5
    # written out: softmax over the allowed keys of q.k / sqrt(D)
    q, keys = torch.tensor(e["q"]), torch.tensor(e["keys"])
    scaled = (keys @ q) / math.sqrt(len(e["q"]))
    assert e["scale"] == 1 / math.sqrt(e["d_head"])
    w = torch.softmax(scaled.masked_fill(~torch.tensor(e["mask"]), float("-inf")), -1)
    assert w.tolist() == pytest.approx(e["softmax"], abs=1e-6)
    if name == "llama":  # GQA: head 3 reads key/value head 1; the window of 6 masks old keys
        assert e["kv_head"] == 1 and e["mask"] == [query - 6 < k <= query for k in range(len(ids))]


def test_explain_takes_the_scale_from_the_model_not_from_d_head(models):
    """A model whose attention multiplies q.k by another factor (here layer 1's, changed by hand):
    the forward's maps follow it, and the step-by-step row reports that scale and still equals
    the map's row, on every attention path (SDPA and the maps' own product)."""
    model = models["llama"]
    ids = source(model, 10)
    attn = model.get_submodule("blocks.1.attn")
    before = explain_head(model, ids, None, "self", 1, 3, 7, ())
    attn.scale = 40.0  # sharp enough to change a random model's near-uniform rows
    try:
        e = explain_head(model, ids, None, "self", 1, 3, 7, ())
        with torch.inference_mode():
            plain = model(torch.tensor([ids])).logits
            mapped = model(torch.tensor([ids]), return_attention=True)
    finally:
        attn.scale = 1 / math.sqrt(model.config.d_head)
    assert e["scale"] == 40.0 and before["scale"] == 1 / math.sqrt(e["d_head"])
    assert e["scaled"] == pytest.approx([x * 40.0 for x in e["scores"]], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(e["softmax"], e["pattern_row"])) < 1e-6
    assert max(abs(a - b) for a, b in zip(e["softmax"], before["softmax"])) > 1e-2
    torch.testing.assert_close(mapped.logits, plain, atol=1e-5, rtol=0)
    assert mapped.attentions[1][0, 3, 7].tolist() == pytest.approx(e["softmax"], abs=1e-6)


# --- generation ----------------------------------------------------------------------------


def full_recompute_ids(model, prompt, n, edits):
    """Greedy continuation recomputed from scratch every token (no cache) under zero ablation."""
    seq = list(prompt)
    for _ in range(n):
        with torch.inference_mode(), hooked(model, Hooks(ablate=edits)):
            logits = model(torch.tensor([seq], device=model.tok_emb.weight.device)).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def test_generate_tokens_zero_ablation_equals_full_recompute(models):
    model = models["gpt2"]
    edits = targets(model, HeadAblation(0, 2, "zero"), HeadAblation(1, 0, "zero"))
    prompt = source(model, 6)
    with hooked(model, Hooks(ablate=edits)):
        got = [t.id for t in generate_tokens(model, prompt, 8, SamplingParams(temperature=0))]
    assert got == full_recompute_ids(model, prompt, 8, edits)


# --- imported architectures: GQA, rotary (full, partial), sliding window, q/k norm, parallel residual


def output_projection(hf, layer: int):
    """The module of transformers' model that reads the heads' outputs side by side, [B, T, H*D]."""
    if hasattr(hf, "gpt_neox"):
        return hf.gpt_neox.layers[layer].attention.dense
    return hf.model.layers[layer].self_attn.o_proj


@pytest.mark.parametrize("case", ["llama3", "qwen2", "mistral", "qwen3", "pythia"])
def test_imported_architectures_head_ablation_equals_transformers(tmp_path, case):
    from arch_helpers import CASES, load_hf, write_hf_checkpoint

    from attnlens.model.interop.convert import import_checkpoint

    src, _ = write_hf_checkpoint(CASES[case], tmp_path / "hf", seed=2)
    ours, _ = import_checkpoint(src, tmp_path / "ours")
    model = load_checkpoint(ours).model.eval()
    hf = load_hf(src, CASES[case])
    ids = ids_for(min(model.config.vocab_size, 200), 14, seed=5)
    D = model.config.d_head
    for how in ("zero", "mean"):
        handle = output_projection(hf, 1).register_forward_pre_hook(head_slice_prehook(3, D, how))
        try:
            with torch.no_grad():
                theirs = hf(torch.tensor([ids])).logits[0]
        finally:
            handle.remove()
        with torch.inference_mode():
            mine = sequence_logits(model, sequence_of(model, ids, None),
                                   Hooks(ablate=targets(model, HeadAblation(1, 3, how))))
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    e = explain_head(model, ids, None, "self", 1, 3, 13, ())  # GQA: its kv head; rotary q and k
    assert max(abs(a - b) for a, b in zip(e["softmax"], e["pattern_row"])) < 1e-6
    assert e["kv_head"] == 3 // (model.config.n_heads // model.config.kv_heads)

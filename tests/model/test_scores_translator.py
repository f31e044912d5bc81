"""Why a head of an encoder-decoder attends (model/analysis/encoder_decoder_scores.py): its score split into
pairs of what wrote the query's and the key's streams, for encoder, decoder and cross heads of the bundled
translator (post-norm) and of a sharp random pre-norm one. The pairs sum to a float64 recompute of the
score within 1e-4; each part's row (column) total equals an independent computation: the gradient of the
score with every LayerNorm's scale frozen and every head's z, MLP output and embedding cut from the graph
(the direct path, by torch hooks on a float64 copy's own forward) times that part."""

from __future__ import annotations

import copy
import math
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import REPO_ROOT
from test_patching_translator import sharp_translator

from attnlens.model.analysis.encoder_decoder_scores import decompose_encoder_decoder_score
from attnlens.model.analysis.explain import explain_head
from attnlens.model.analysis.operations import ScoreDecompositionCall, run_operation
from attnlens.model.hooks import Hooks, hooked


@pytest.fixture(scope="module", params=["translator", "pre-norm"])
def case(request):
    if request.param == "translator":
        from attnlens.model import load_checkpoint

        path = REPO_ROOT / "checkpoints" / "translator"
        if not (path / "model.safetensors").is_file():
            pytest.skip("the bundled translator is not in checkpoints/translator")
        ck = load_checkpoint(path)
        model, ids, target = ck.model, ck.tokenizer.encode("March 3, 2021"), ck.tokenizer.encode("3 mars")
    else:
        model, ids, target = sharp_translator("pre", seed=3), [11, 40, 7, 63, 22], [5, 71, 30]
    return SimpleNamespace(model=model, ids=ids, target=target, S=len(ids), T=len(target) + 1,
                           double=copy.deepcopy(model).double())


def heads(case):
    """(group, layer, head, query, key): each group's first and last layer, keys before, at and after."""
    L, S, T = case.model.config.n_layers, case.S, case.T
    return [("encoder", 0, 1, 2, 0), ("encoder", L - 1, 3, 1, S - 1), ("decoder", 0, 0, T - 1, 1),
            ("decoder", L - 1, 2, T - 1, T - 1), ("cross", 0, 1, 1, 0), ("cross", L - 1, 3, T - 1, 2)]


def module_of(group: str, layer: int) -> str:
    return {"encoder": f"encoder.blocks.{layer}.attn", "decoder": f"decoder.blocks.{layer}.attn",
            "cross": f"decoder.blocks.{layer}.cross_attn"}[group]


def run(model, case, group: str, layer: int, query: int, record: set[str]) -> dict:
    """The forward the score reads (the target up to the query), recording `record`."""
    hooks = Hooks(record=record)
    with hooked(model, hooks):
        model(torch.tensor([[model.config.decoder_start_id, *case.target][:query + 1]]),
              source=torch.tensor([case.ids]))
    return hooks.captured


def test_the_pairs_sum_to_a_float64_recompute_of_the_score(case):
    c = case.model.config
    L, H = c.n_layers, c.n_heads
    for group, layer, head, query, key in heads(case):
        s = decompose_encoder_decoder_score(case.model, case.ids, case.target, group, layer, head, query, key, top_k=7)
        module = module_of(group, layer)
        with torch.no_grad():
            got = run(case.double, case, group, layer, query, {f"{module}.hook_q", f"{module}.hook_k"})
        attn = case.double.get_submodule(module)
        score = float(got[f"{module}.hook_q"][0, query, head] @ got[f"{module}.hook_k"][0, key, head]) * attn.scale
        assert s["matrix"].sum() == pytest.approx(score, abs=1e-4)
        assert s["score"] == pytest.approx(score, abs=1e-4)
        assert abs(s["matrix"].sum() - s["score"]) < 1e-5
        step = explain_head(case.model, case.ids, case.target, group, layer, head, query, ())  # the view's own q . k
        assert s["score"] == pytest.approx(step["scaled"][key], abs=1e-5)
        assert s["probability"] == pytest.approx(step["pattern_row"][key], abs=1e-6)
        side = {"encoder": 2 + layer * (H + 1), "decoder": 2 + layer * (2 * H + 1), "cross": 2 + layer * (2 * H + 1) + H}
        keys = 2 + L * (H + 1) if group == "cross" else side[group]
        assert s["matrix"].shape == (side[group] + 1, keys + 1), group  # and the biases' row and column
        assert s["parts"][0] == "embedding" and s["parts"][-1] == "biases" and s["key_parts"][-1] == "biases"
        assert (s["parts"] == s["key_parts"]) == (group != "cross")
        np.testing.assert_allclose(s["query_totals"], s["matrix"].sum(axis=1))
        np.testing.assert_allclose(s["key_totals"], s["matrix"].sum(axis=0))
        magnitudes = [abs(p["value"]) for p in s["top"]]
        assert magnitudes == sorted(magnitudes, reverse=True) and len(magnitudes) == 7
        assert magnitudes[0] == pytest.approx(np.abs(s["matrix"]).max())
        i, j = np.unravel_index(np.abs(s["matrix"]).argmax(), s["matrix"].shape)
        assert (s["top"][0]["query"], s["top"][0]["key"]) == (s["parts"][i], s["key_parts"][j])
        assert s["rest"] + sum(p["value"] for p in s["top"]) == pytest.approx(s["score"])
        assert (s["group"], s["kv_head"], s["masked"]) == (group, head, False)


# --- each part against its direct gradient --------------------------------------------------------------
def direct_parts(case, group: str, layer: int, head: int, query: int, key: int) -> tuple[dict, dict]:
    """{part name: its total} on the query side (its contribution . the real key) and on the key side, from
    the float64 copy's forward: every LayerNorm's scale frozen (detached), every head's z, every MLP's
    output and each stack's embedded input made leaves (so only direct paths reach the receiver), the
    gradient of the scaled score with the other side detached, times each part."""
    model = case.double
    c = model.config
    H, D, C = c.n_heads, c.d_head, c.d_model
    leaves, handles = {}, []

    def frozen(m, args, out):
        u = args[0]
        sigma = torch.sqrt(u.var(-1, unbiased=False, keepdim=True) + m.eps).detach()
        return (u - u.mean(-1, keepdim=True)) / sigma * m.weight + m.bias

    def leaf(key_):
        def make(t):
            t = t.detach().requires_grad_()
            leaves[key_] = t
            return t
        return make
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            handles.append(m.register_forward_hook(frozen))
    for stack in ("encoder", "decoder"):
        blocks = getattr(model, stack).blocks
        handles.append(blocks[0].register_forward_pre_hook(lambda m, args, f=leaf((stack, "embedded")):
                                                           (f(args[0]), *args[1:])))
        for l, block in enumerate(blocks):
            for attn, name in ((block.attn, stack), (block.cross_attn, "cross")):
                if attn is not None:
                    handles.append(attn.proj.register_forward_pre_hook(lambda m, args, f=leaf((name, l)): (f(args[0]),)))
            handles.append(block.ffn.register_forward_hook(lambda m, args, out, f=leaf((stack, l, "mlp")): f(out)))
    module = module_of(group, layer)
    try:
        with torch.enable_grad():
            got = run(model, case, group, layer, query, {f"{module}.hook_q", f"{module}.hook_k"})
    finally:
        for h in handles:
            h.remove()
    q, k = got[f"{module}.hook_q"][0, query, head], got[f"{module}.hook_k"][0, key, head]
    scale = model.get_submodule(module).scale
    names = list(leaves)
    sides = []
    for score in (scale * q @ k.detach(), scale * q.detach() @ k):
        grads = dict(zip(names, torch.autograd.grad(score, [leaves[n] for n in names], retain_graph=True,
                                                    allow_unused=True)))
        totals = {}
        for name, t in leaves.items():
            g, t = grads[name], t.detach()
            if g is None or not g.any():
                continue
            if name[1] == "embedded":
                stack = name[0]
                ids = case.ids if stack == "encoder" else [c.decoder_start_id, *case.target]
                token = model.tok_emb.weight.detach()[torch.tensor(ids[:t.shape[1]])] * (
                    math.sqrt(C) if c.scale_embeddings else 1)
                totals[f"{stack} embedding"] = float((g[0] * token).sum())
                totals[f"{stack} positions"] = float((g[0] * (t[0] - token)).sum())
            elif len(name) == 3:
                totals[f"{name[0]} L{name[1]} MLP"] = float((g * t).sum())
            else:
                value = t[0] - constant_value(model, *name)  # (T, HD): each head's (z - c)
                per_head = (g[0] * value).view(-1, H, D).sum(dim=(0, 2))
                totals.update({f"{name[0]} L{name[1]}H{h}": float(per_head[h]) for h in range(H)})
        sides.append(totals)
    return sides[0], sides[1]


def constant_value(model, group: str, layer: int) -> torch.Tensor:
    """(HD,) each head's constant value: its value bias plus W_V times the bias of the norm whose output its
    values read (the previous block's last norm post-norm, the block's ln1 pre-norm, the encoder norm for
    cross-attention; none for a post-norm first block's embedded stream)."""
    stack = model.encoder if group == "encoder" else model.decoder
    block = stack.blocks[layer]
    attn = block.cross_attn if group == "cross" else block.attn
    HD = attn.n_heads * attn.d_head
    if group == "cross":
        norm = model.encoder_norm
    else:
        norm = block.ln1 if block.pre_norm else stack.blocks[layer - 1].ln2 if layer else None
    c = attn.qkv.bias.detach()[2 * HD:].clone()
    if norm is not None:
        c = c + attn.qkv.weight.detach()[2 * HD:] @ norm.bias.detach()
    return c


def test_each_part_equals_its_direct_gradient(case):
    for group, layer, head, query, key in heads(case):
        s = decompose_encoder_decoder_score(case.model, case.ids, case.target, group, layer, head, query, key)
        want_q, want_k = direct_parts(case, group, layer, head, query, key)
        q_stack = "encoder" if group == "encoder" else "decoder"
        k_stack = "decoder" if group == "decoder" else "encoder"
        for names, totals, want, stack in ((s["parts"], s["query_totals"], want_q, q_stack),
                                           (s["key_parts"], s["key_totals"], want_k, k_stack)):
            got = {f"{stack} {n}" if n in ("embedding", "positions") else n: v for n, v in zip(names, totals)}
            biases = got.pop("biases")
            assert set(want) <= set(got), (group, set(want) - set(got))
            for name, value in got.items():
                assert value == pytest.approx(want.get(name, 0.0), abs=1e-4), (group, layer, name)
            assert abs(biases) + max(abs(v) for v in got.values()) > 1e-3  # not vacuous
        heads_moved = [n for n in want_q if "H" in n] + [n for n in want_k if "H" in n]
        if layer or group == "cross":
            assert heads_moved  # earlier heads wrote into a stream the receiver reads


def test_a_head_that_writes_nothing_gets_nothing(case):
    """Encoder head L0H2 with its output projection zeroed: its column of a cross head's score is exactly 0."""
    silent = copy.deepcopy(case.model)
    D = silent.config.d_head
    with torch.no_grad():
        silent.encoder.blocks[0].attn.proj.weight[:, 2 * D:3 * D] = 0
    s = decompose_encoder_decoder_score(silent, case.ids, case.target, "cross", 1, 0, case.T - 1, 1)
    j = s["key_parts"].index("encoder L0H2")
    assert not s["matrix"][:, j].any() and s["matrix"].sum() == pytest.approx(s["score"], abs=1e-4)
    assert "encoder L0H2" not in s["parts"]  # the query side is the decoder's


def test_the_call_runs_by_name_checks_its_fields_and_a_generated_target(case):
    kw = dict(ids=case.ids, layer=1, head=2, query=1, key=0, top_k=5, target_ids=case.target, group="cross")
    call = pickle.loads(pickle.dumps(ScoreDecompositionCall(**kw)))
    got = run_operation(case.model, call)
    want = decompose_encoder_decoder_score(case.model, case.ids, case.target, "cross", 1, 2, 1, 0, 5)
    np.testing.assert_array_equal(got.pop("matrix"), want.pop("matrix"))
    assert got == want
    generated = run_operation(case.model, ScoreDecompositionCall(**{**kw, "target_ids": None}))
    assert "error" in generated or generated["matrix"].sum() == pytest.approx(generated["score"], abs=1e-4)
    far = run_operation(case.model, ScoreDecompositionCall(**{**kw, "target_ids": None, "query": 40}))
    assert far == {"error": far["error"]} and "query 40 out of range: the target has" in far["error"]
    S, T = case.S, case.T
    for change, words in [(dict(group=None), "group None"), (dict(group="self"), "group 'self'"),
                          (dict(layer=9), "layer 9 out of range"), (dict(head=4), "head 4 out of range"),
                          (dict(group="encoder", query=S), f"query {S} out of range 0..{S - 1}"),
                          (dict(query=T), f"query {T} out of range 0..{T - 1}"),
                          (dict(group="decoder", query=1, key=2), "key 2 out of range 0..1"),
                          (dict(key=S), f"key {S} out of range 0..{S - 1}"),
                          (dict(ids=[]), "ids is empty")]:
        bad = ScoreDecompositionCall(**{**kw, **change})
        with pytest.raises(ValueError, match=words):
            bad.check(case.model.config)
        with pytest.raises(ValueError, match=words):
            run_operation(case.model, bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_the_decomposition_on_cuda_equals_the_cpus(case):
    cuda = copy.deepcopy(case.model).to("cuda")
    for group, layer, head, query, key in heads(case):
        call = ScoreDecompositionCall(case.ids, layer, head, query, key, target_ids=case.target, group=group)
        got, want = run_operation(cuda, call), run_operation(case.model, call)
        np.testing.assert_allclose(got["matrix"], want["matrix"], atol=1e-4)
        assert got["parts"] == want["parts"] and got["key_parts"] == want["key_parts"]

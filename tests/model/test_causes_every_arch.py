"""The causal tools on every decoder architecture import-hf reads (tests/arch_helpers.py's CASES and
MORE_CASES: small random models, their special paths made to bite), each against the model's own
forward with hooks: exact patching (block_runs' hand-run blocks) against hooked whole forwards,
attribution patching against autograd through the forward, path patching (or its refusal), and the
direct logit attribution's and the score decomposition's parts against the model's own values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from attnlens.model.analysis.attribution_patching import attribution_patch
from attnlens.model.analysis.logit_attribution import logit_attribution
from attnlens.model.analysis.patching import patch
from attnlens.model.analysis.score_decomposition import decompose_score
from attnlens.model.checkpoint import load_checkpoint
from attnlens.model.hooks import Hooks, hooked

transformers = pytest.importorskip("transformers")

from arch_helpers import CASES, MORE_CASES, write_hf_checkpoint  # noqa: E402

ALL = {**CASES, **MORE_CASES}
T, POSITION, CHANGES = 12, 10, (3, 7)  # windows of 8 bite at 12 tokens
ANSWER, FOIL = 5, 7


@pytest.fixture(scope="module", params=list(ALL))
def arch(request, tmp_path_factory):
    from attnlens.model.interop.convert import import_checkpoint

    case = ALL[request.param]
    root = tmp_path_factory.mktemp(case.name)
    src, _ = write_hf_checkpoint(case, root / "hf")
    out, _ = import_checkpoint(src, root / "ours")
    model = load_checkpoint(out).model
    V = model.config.vocab_size
    clean = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
    corrupted = clean.clone()
    for p in CHANGES:
        corrupted[0, p] = (corrupted[0, p] + 7) % V
    kw = dict(clean_ids=clean[0].tolist(), corrupted_ids=corrupted[0].tolist(), answer_id=ANSWER, foil_id=FOIL,
              position=POSITION)
    return SimpleNamespace(name=case.name, model=model, clean=clean, corrupted=corrupted, kw=kw)


def metric_of(logits: torch.Tensor) -> float:
    return float(logits[0, POSITION, ANSWER] - logits[0, POSITION, FOIL])


def keep_inputs(model, ids: torch.Tensor) -> dict:
    """Each block's input (its residual stream) and its attention's z (the output projection's input),
    (1, T, C) and (1, T, HD), from the model's own forward."""
    kept: dict = {}
    handles = []
    for layer, block in enumerate(model.blocks):
        handles.append(block.register_forward_pre_hook(
            lambda m, args, layer=layer: kept.__setitem__(("resid_pre", layer), args[0].detach().clone())))
        handles.append(block.attn.proj.register_forward_pre_hook(
            lambda m, args, layer=layer: kept.__setitem__(("z", layer), args[0].detach().clone())))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return kept


def run_with(model, ids: torch.Tensor, handles: list) -> float:
    try:
        with torch.no_grad():
            return metric_of(model(ids).logits)
    finally:
        for h in handles:
            h.remove()


def test_exact_patching_equals_hooked_forwards(arch):
    model, c = arch.model, arch.model.config
    D = c.d_head
    with torch.no_grad():
        want = [metric_of(model(ids).logits) for ids in (arch.clean, arch.corrupted)]
    heads = patch(model, component="heads", **arch.kw)
    assert heads.clean_metric == pytest.approx(want[0], abs=1e-4)
    assert heads.corrupted_metric == pytest.approx(want[1], abs=1e-4)
    clean = keep_inputs(model, arch.clean)
    for layer, head in ((0, 0), (0, c.n_heads - 1), (c.n_layers - 1, 1), (c.n_layers // 2, 2)):
        z = clean[("z", layer)]

        def pre(module, args, head=head, z=z):
            x = args[0].clone()
            x[0, :, head * D:(head + 1) * D] = z[0, :, head * D:(head + 1) * D]
            return (x,)
        hooked_value = run_with(model, arch.corrupted, [model.blocks[layer].attn.proj.register_forward_pre_hook(pre)])
        assert heads.values[layer][head] == pytest.approx(hooked_value, abs=1e-4), (layer, head)
    residual = patch(model, component="residual", **arch.kw)
    for layer in range(c.n_layers):
        x0 = clean[("resid_pre", layer)]

        def pre_block(module, args, x0=x0):
            x = args[0].clone()
            x[0, CHANGES[1]] = x0[0, CHANGES[1]]
            return (x, *args[1:])
        hooked_value = run_with(model, arch.corrupted, [model.blocks[layer].register_forward_pre_hook(pre_block)])
        assert residual.values[layer][CHANGES[1]] == pytest.approx(hooked_value, abs=1e-4), layer


def test_attribution_patching_equals_autograd_through_the_forward(arch):
    model, c = arch.model, arch.model.config
    clean = keep_inputs(model, arch.clean)
    leaves: dict = {}  # per layer: zeros added to z (the gradient at z, every later path kept), and z
    handles = []
    for layer, block in enumerate(model.blocks):
        def leaf(module, args, layer=layer):
            zeros = torch.zeros_like(args[0], requires_grad=True)
            leaves[layer] = (zeros, args[0].detach().clone())
            return (args[0] + zeros,)
        handles.append(block.attn.proj.register_forward_pre_hook(leaf))
    try:
        with torch.enable_grad():
            value = model(arch.corrupted).logits[0, POSITION]
            grads = torch.autograd.grad(value[ANSWER] - value[FOIL], [leaves[layer][0] for layer in range(c.n_layers)])
    finally:
        for h in handles:
            h.remove()
    got = attribution_patch(model, component="heads", **arch.kw)
    corrupted = float((value[ANSWER] - value[FOIL]).detach())
    assert got.corrupted_metric == pytest.approx(corrupted, abs=1e-4)
    for layer, g in enumerate(grads):
        z_corrupted = leaves[layer][1]
        effect = ((clean[("z", layer)] - z_corrupted) * g)[0].view(T, c.n_heads, c.d_head).sum(dim=(0, 2))  # (H,)
        torch.testing.assert_close(torch.tensor(got.values[layer]), corrupted + effect, atol=2e-4, rtol=1e-4)


def test_path_patching_equals_a_hooked_forward_or_is_refused(arch):
    model, c = arch.model, arch.model.config
    if c.post_norms:
        with pytest.raises(ValueError, match="post_norms"):
            patch(model, component="paths", sender=(0, 1), **arch.kw)
        return
    got = patch(model, component="paths", sender=(0, 1), **arch.kw)
    D = c.d_head
    clean, corrupted = keep_inputs(model, arch.clean), keep_inputs(model, arch.corrupted)
    w_o = model.blocks[0].attn.proj.weight[:, D:2 * D]  # (C, D)
    delta = (clean[("z", 0)][0, :, D:2 * D] - corrupted[("z", 0)][0, :, D:2 * D]) @ w_o.t()  # (T, C)
    delta = delta * model.blocks[0].residual_multiplier
    layer = c.n_layers - 1
    block = model.blocks[layer]
    for head in range(c.n_heads):
        seen: dict = {}

        def keep(module, args):
            seen["x"] = args[0]

        def patch_q(module, args, out, head=head):
            mine = F.linear(block.ln1(seen["x"] + delta), module.weight, module.bias)  # the receiver's own projection
            out = out.clone()
            out[..., head * D:(head + 1) * D] = mine[..., head * D:(head + 1) * D]
            return out
        hooked_value = run_with(model, arch.corrupted, [block.register_forward_pre_hook(keep),
                                                         block.attn.qkv.register_forward_hook(patch_q)])
        assert got.values["q"][layer][head] == pytest.approx(hooked_value, abs=1e-4), head


def test_logit_attribution_parts_sum_to_the_logit_difference(arch):
    model, c = arch.model, arch.model.config
    ids = arch.clean[0].tolist()
    got = logit_attribution(model, ids, ANSWER, FOIL, POSITION)
    parts = sum(map(sum, got["heads"])) + sum(got["mlps"]) + got["embedding"] + got["other"]
    assert parts == pytest.approx(got["logit_difference"], abs=1e-4)
    with torch.no_grad():
        logits = model(arch.clean).logits
    if c.final_softcap is None:
        assert got["softcap"] is None
        assert got["logit_difference"] == pytest.approx(metric_of(logits), abs=1e-4)
    else:  # Gemma 2: the parts sum to the logits before the cap, named so; the capped ones are the model's
        assert got["softcap"] == c.final_softcap
        capped = [c.final_softcap * torch.tanh(torch.tensor(v) / c.final_softcap) for v in
                  (got["answer_logit"], got["foil_logit"])]
        assert float(capped[0] - capped[1]) == pytest.approx(metric_of(logits), abs=1e-4)
        assert got["capped_logit_difference"] == pytest.approx(metric_of(logits), abs=1e-4)


def test_score_decomposition_parts_sum_to_the_models_score(arch):
    model, c = arch.model, arch.model.config
    ids = arch.clean[0].tolist()
    rotary = c.positional == "rotary"
    for layer, head, query, key in ((0, 1, 10, 6), (c.n_layers - 1, c.n_heads - 1, 11, 1), (c.n_layers - 1, 0, 9, 9)):
        got = decompose_score(model, ids, layer, head, query, key)
        assert float(got["matrix"].sum()) == pytest.approx(got["score"], abs=1e-4)
        # the model's own scores of the query's row, from its hooked forward: the probabilities they give
        module = f"blocks.{layer}.attn"
        qn, kn = ("hook_rot_q", "hook_rot_k") if rotary else ("hook_q", "hook_k")
        hooks = Hooks(record={f"{module}.{qn}", f"{module}.{kn}", f"{module}.hook_pattern"})
        with torch.no_grad(), hooked(model, hooks):
            model(arch.clean[:, :query + 1])
        kv = head // (c.n_heads // c.kv_heads)
        q = hooks.captured[f"{module}.{qn}"][0, query, head].double()  # (D,)
        k = hooks.captured[f"{module}.{kn}"][0, :, kv].double()  # (S, D)
        scores = k @ q * model.blocks[layer].attn.scale  # (S,)
        assert float(scores[key]) == pytest.approx(got["score"], abs=1e-4)
        if c.attn_softcap is not None:
            assert got["softcap"] == c.attn_softcap
            scores = torch.tanh(scores / c.attn_softcap) * c.attn_softcap
            assert got["capped_score"] == pytest.approx(float(scores[key]), abs=1e-4)
        window = c.window_of(layer)
        if window is not None:
            scores[: max(0, query - window + 1)] = float("-inf")
        assert got["masked"] == (window is not None and key <= query - window)
        pattern = hooks.captured[f"{module}.hook_pattern"][0, head, query].double()
        torch.testing.assert_close(torch.softmax(scores, dim=0), pattern, atol=1e-5, rtol=0)

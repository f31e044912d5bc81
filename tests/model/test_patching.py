"""Activation patching (model/analysis/patching.py) and attribution patching (attribution_patching.py)
against TransformerLens's own functions on a random GPT-2-shaped model with our weights (its export,
booted as a TransformerBridge), against a loop of hooked whole forwards of transformers' own random
Llama, Qwen2 and Mistral (tests/arch_helpers.py, imported with import-hf), and on SmolLM2's IOI
pair (slow: the packaged model)."""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import sharp_checkpoint, small_config_model

from attnlens.model import ModelConfig, Transformer, load_checkpoint
from attnlens.model.analysis.attribution_patching import attribution_patch
from attnlens.model.analysis.operations import PatchCall, run_operation
from attnlens.model.analysis.patching import patch


@dataclass
class Task:
    """A prompt pair that differs at two positions, the answer and foil, and the metric's position."""

    clean: torch.Tensor  # (1, T)
    corrupted: torch.Tensor
    answer: int
    foil: int
    position: int

    @property
    def kwargs(self) -> dict:
        return dict(clean_ids=self.clean[0].tolist(), corrupted_ids=self.corrupted[0].tolist(),
                    answer_id=self.answer, foil_id=self.foil, position=self.position)

    def metric(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[0, self.position, self.answer] - logits[0, self.position, self.foil]


def task_for(vocab: int, length: int = 10, changes: tuple[int, ...] = (4, 7), position: int = 8, seed: int = 0) -> Task:
    clean = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    corrupted = clean.clone()
    for p in changes:
        corrupted[0, p] = (corrupted[0, p] + 7) % vocab
    return Task(clean, corrupted, 3, 4, position)


def assert_values(got, want: torch.Tensor, atol: float = 2e-5) -> None:
    """Nested lists (None: a cell with no measurement, TransformerLens's 0.0) equal a tensor."""
    got = torch.tensor([[0.0 if v is None else v for v in row] for row in got]) if want.dim() == 2 \
        else torch.tensor(got)
    torch.testing.assert_close(got, want.detach().float(), atol=atol, rtol=0)
    assert float(want.std()) > 1e-3  # the cells differ: the comparison is not vacuous


# --- TransformerLens's own functions on the same weights ---------------------------------------
@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(our sharp random GPT-2-shaped model, TransformerLens's bridge over its export)."""
    pytest.importorskip("transformer_lens.patching")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformer_lens.model_bridge import TransformerBridge

    from attnlens.model.interop.hf import export_hf

    root = tmp_path_factory.mktemp("patching")
    ours = sharp_checkpoint(root, seed=5, context_length=64)
    bridge = TransformerBridge.boot_transformers(str(export_hf(ours, root / "gpt2")), device="cpu")
    model = load_checkpoint(ours).model
    return SimpleNamespace(model=model, bridge=bridge, task=task_for(model.config.vocab_size))


TL_FUNCTIONS = {"heads": "get_act_patch_attn_head_out_all_pos",
                "heads_by_position": "get_act_patch_attn_head_out_by_pos",
                "residual": "get_act_patch_resid_pre"}


@pytest.mark.parametrize("component", ["heads", "heads_by_position", "residual", "layers"])
def test_every_component_equals_transformer_lens_patching(gpt2, component):
    import transformer_lens.patching as tl

    task, bridge = gpt2.task, gpt2.bridge
    _, clean_cache = bridge.run_with_cache(task.clean)
    got = patch(gpt2.model, component=component, **task.kwargs)
    with torch.no_grad():
        assert got.clean_metric == pytest.approx(float(task.metric(bridge(task.clean))), abs=1e-5)
        assert got.corrupted_metric == pytest.approx(float(task.metric(bridge(task.corrupted))), abs=1e-5)
    assert got.first_difference == 4 and got.position == 8
    if component == "layers":
        want = tl.get_act_patch_attn_out(bridge, task.corrupted, clean_cache, task.metric)
        assert_values(got.values["attention"], want)
        assert_values(got.values["mlp"], tl.get_act_patch_mlp_out(bridge, task.corrupted, clean_cache, task.metric))
    else:
        want = getattr(tl, TL_FUNCTIONS[component])(bridge, task.corrupted, clean_cache, task.metric)
        assert_values(got.values, want)


def test_paths_equal_transformer_lens_direct_path_patching(gpt2):
    import transformer_lens.patching as tl

    task, bridge = gpt2.task, gpt2.bridge
    _, clean_cache = bridge.run_with_cache(task.clean)
    _, corrupted_cache = bridge.run_with_cache(task.corrupted)
    got = patch(gpt2.model, component="paths", sender=(0, 1), **task.kwargs)
    assert got.sender == (0, 1)
    for kind in ("q", "k", "v"):
        assert got.values[kind][0] == [None] * 4  # no path into the sender's own layer
        want = tl.get_act_patch_direct_path(bridge, task.corrupted, clean_cache, corrupted_cache, task.metric, 0, 1,
                                            component=kind, verbose=False)
        assert_values(got.values[kind], want)


@pytest.mark.parametrize("component", ["heads", "heads_by_position", "residual", "layers"])
def test_attribution_equals_transformer_lens_gradient_times_difference(gpt2, component):
    """Under the engine's inference mode: autograd is enabled inside the call."""
    from transformer_lens.tools.analysis.attribution_patching import cache_activation_and_gradient

    task, bridge = gpt2.task, gpt2.bridge
    points = {"z": "attn.hook_z", "resid_pre": "hook_resid_pre", "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out"}
    names = [f"blocks.{layer}.{p}" for layer in range(2) for p in points.values()]
    clean = cache_activation_and_gradient(bridge, task.clean, task.metric, names_filter=names, compute_gradient=False)
    corrupted = cache_activation_and_gradient(bridge, task.corrupted, task.metric, names_filter=names)

    def theirs(point: str, dims: tuple[int, ...]) -> torch.Tensor:
        """[L][...] corrupted metric + (clean - corrupted) x gradient, summed over `dims` of [pos, ...]."""
        out = []
        for layer in range(2):
            name = f"blocks.{layer}.{points[point]}"
            effect = (clean.activations[name] - corrupted.activations[name]) * corrupted.gradients[name]
            out.append(corrupted.metric + effect[0].sum(dim=dims))
        return torch.stack(out)

    with torch.inference_mode():
        got = attribution_patch(gpt2.model, component=component, **task.kwargs)
    assert got.method == "attribution"
    assert got.corrupted_metric == pytest.approx(float(corrupted.metric), abs=1e-5)
    if component == "heads":
        assert_values(got.values, theirs("z", (0, 2)))
    elif component == "heads_by_position":
        assert_values(got.values, theirs("z", (-1,)))
    elif component == "residual":
        assert_values(got.values, theirs("resid_pre", (-1,)))
    else:
        assert_values(got.values["attention"], theirs("attn_out", (-1,)))
        assert_values(got.values["mlp"], theirs("mlp_out", (-1,)))


# --- a loop of hooked forwards of transformers' own Llama, Qwen2, Mistral ------------------------
class HookedLoop:
    """TransformerLens's patching written out on a transformers Llama-style model: each cell one whole
    forward of the corrupted prompt, one activation replaced through a forward hook by the clean run's."""

    def __init__(self, hf, task: Task):
        self.hf, self.task = hf, task
        c = hf.config
        self.D = c.head_dim if getattr(c, "head_dim", None) is not None else c.hidden_size // c.num_attention_heads
        self.clean = self.record(task.clean)
        self.corrupted = self.record(task.corrupted)

    def point(self, layer: int, kind: str, edit):
        """Hook `edit` (tensor -> tensor) on `kind` of block `layer`; the handle."""
        block = self.hf.model.layers[layer]
        if kind == "resid_pre":
            def pre(module, args, kwargs):
                if args:
                    return (edit(args[0]), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": edit(kwargs["hidden_states"])}
            return block.register_forward_pre_hook(pre, with_kwargs=True)
        if kind == "z":  # the output projection's input: each head's z side by side
            return block.self_attn.o_proj.register_forward_pre_hook(lambda m, args: (edit(args[0]),))
        if kind == "attn_out":
            return block.self_attn.register_forward_hook(lambda m, args, out: (edit(out[0]), *out[1:]))
        return block.mlp.register_forward_hook(lambda m, args, out: edit(out))

    def record(self, ids: torch.Tensor) -> dict:
        kept: dict = {}
        handles = []
        for layer in range(self.hf.config.num_hidden_layers):
            for kind in ("resid_pre", "z", "attn_out", "mlp_out"):
                def keep(t, key=(kind, layer)):
                    kept[key] = t.detach().clone()
                    return t
                handles.append(self.point(layer, kind, keep))
        try:
            with torch.no_grad():
                self.hf(ids)
        finally:
            for h in handles:
                h.remove()
        return kept

    def run(self, handles) -> float:
        try:
            with torch.no_grad():
                return float(self.task.metric(self.hf(self.task.corrupted).logits))
        finally:
            for h in handles:
                h.remove()

    def cell(self, layer: int, kind: str, position: int | None, head: int | None = None) -> float:
        """The metric with `kind` of block `layer` patched at `position` (None: every position), one head's
        slice of z when `head` is given."""
        where = slice(None) if position is None else position
        cols = slice(None) if head is None else slice(head * self.D, (head + 1) * self.D)
        clean = self.clean[(kind, layer)]

        def edit(t):
            t = t.clone()
            t[0, where, cols] = clean[0, where, cols]
            return t
        return self.run([self.point(layer, kind, edit)])

    def path_q(self, sender: tuple[int, int], layer: int, head: int) -> float:
        """The sender's clean-minus-corrupted write reaching only the query input of (layer, head)."""
        D, (sl, sh) = self.D, sender
        cols = slice(sh * D, (sh + 1) * D)
        w_o = self.hf.model.layers[sl].self_attn.o_proj.weight[:, cols]  # (C, D)
        delta = (self.clean[("z", sl)][0, :, cols] - self.corrupted[("z", sl)][0, :, cols]) @ w_o.t()  # (T, C)
        block = self.hf.model.layers[layer]
        seen = {}

        def keep_input(module, args, kwargs):
            seen["x"] = args[0] if args else kwargs["hidden_states"]

        def patch_q(module, args, out):
            mine = F.linear(block.input_layernorm(seen["x"] + delta), module.weight, module.bias)
            out = out.clone()
            out[..., head * D:(head + 1) * D] = mine[..., head * D:(head + 1) * D]
            return out
        return self.run([block.register_forward_pre_hook(keep_input, with_kwargs=True),
                         block.self_attn.q_proj.register_forward_hook(patch_q)])


@pytest.fixture(scope="module", params=["llama3", "qwen2", "mistral"])
def arch(request, tmp_path_factory):
    """Our import of a random transformers model (GQA or MQA; Mistral's window of 8 bites at 12 tokens)
    and a hooked loop over transformers' own."""
    pytest.importorskip("transformers")
    from arch_helpers import CASES, load_hf, write_hf_checkpoint

    from attnlens.model.interop.convert import import_checkpoint

    case = CASES[request.param]
    root = tmp_path_factory.mktemp(case.name)
    src, _ = write_hf_checkpoint(case, root / "hf")
    out, _ = import_checkpoint(src, root / "ours")
    model = load_checkpoint(out).model
    task = task_for(model.config.vocab_size, length=12, changes=(3, 7), position=10, seed=1)
    return SimpleNamespace(name=case.name, model=model, loop=HookedLoop(load_hf(src, case), task), task=task)


def test_components_equal_a_loop_of_hooked_transformers_forwards(arch):
    c = arch.model.config
    L, H, T = c.n_layers, c.n_heads, arch.task.clean.shape[1]
    loop, kw = arch.loop, arch.task.kwargs
    heads = patch(arch.model, component="heads", **kw).values
    assert_values(heads, torch.tensor([[loop.cell(l, "z", None, h) for h in range(H)] for l in range(L)]), 1e-4)
    by_position = patch(arch.model, component="heads_by_position", **kw).values
    at = [0, 3, 5, 10, 11]  # before the first difference, at it, between, the metric's position, after it
    want = [[[loop.cell(l, "z", p, h) for h in range(H)] for p in at] for l in range(L)]
    assert_values([[row[p] for p in at] for row in by_position], torch.tensor(want), 1e-4)
    residual = patch(arch.model, component="residual", **kw).values
    assert_values(residual, torch.tensor([[loop.cell(l, "resid_pre", p) for p in range(T)] for l in range(L)]), 1e-4)
    layers = patch(arch.model, component="layers", **kw).values
    for name, kind in (("attention", "attn_out"), ("mlp", "mlp_out")):
        assert_values(layers[name], torch.tensor([[loop.cell(l, kind, p) for p in range(T)] for l in range(L)]), 1e-4)


def test_path_patching_into_queries_equals_a_hooked_loop(arch):
    H = arch.model.config.n_heads
    got = patch(arch.model, component="paths", sender=(0, 2), **arch.task.kwargs).values["q"]
    assert got[0] == [None] * H
    want = [arch.loop.path_q((0, 2), 1, h) for h in range(H)]
    np.testing.assert_allclose(got[1], want, atol=1e-4)
    assert np.std(want) > 1e-3


def multi_head_copy(model) -> Transformer:
    """The same model with grouped-query attention written out: every query head its own copy of its
    key/value head (the same function, K = H)."""
    c = model.config
    H, K, D = c.n_heads, c.kv_heads, c.d_head
    mha = Transformer(ModelConfig.from_dict({**c.to_dict(), "n_kv_heads": None})).eval()
    state = dict(model.state_dict())
    for name in [n for n in state if n.endswith("attn.qkv.weight") or n.endswith("attn.qkv.bias")]:
        w = state[name]
        q, k, v = w[:H * D], w[H * D:(H + K) * D], w[(H + K) * D:]
        widen = lambda t: t.reshape(K, D, *t.shape[1:]).repeat_interleave(H // K, dim=0).reshape(H * D, *t.shape[1:])
        state[name] = torch.cat([q, widen(k), widen(v)])
    mha.load_state_dict(state)
    return mha


def test_a_grouped_query_receivers_keys_and_values_are_its_own(arch):
    """With grouped-query attention a receiver is a query head: its keys (values) are its own projection
    of the patched stream, as in the same model with each query head its own key/value head."""
    mha = multi_head_copy(arch.model)
    kw = arch.task.kwargs
    with torch.no_grad():
        assert torch.allclose(mha(arch.task.clean).logits, arch.model(arch.task.clean).logits, atol=1e-5)
    got = patch(arch.model, component="paths", sender=(0, 1), **kw).values
    want = patch(mha, component="paths", sender=(0, 1), **kw).values
    for kind in ("q", "k", "v"):
        np.testing.assert_allclose(got[kind][1], want[kind][1], atol=1e-5)
        assert np.std(want[kind][1]) > 1e-4


ROTARY = dict(positional="rotary", norm_type="rmsnorm", ffn="gated", activation="silu", bias=False)


@pytest.mark.parametrize("shape", [
    {}, dict(norm="post"), dict(positional="sinusoidal", scale_embeddings=True), dict(ROTARY, n_kv_heads=2),
    dict(ROTARY, qkv_bias=True, n_kv_heads=1), dict(ROTARY, n_kv_heads=2, qk_norm=True),
    dict(ROTARY, n_kv_heads=2, sliding_window=4),
    dict(positional="rotary", rotary_pct=0.25, parallel_residual=True, activation="gelu_exact", head_dim=16)])
@pytest.mark.parametrize("grad", [False, True])
def test_the_blocks_run_by_hand_are_the_models_forward(shape, grad):
    """block_runs on every decoder shape, with and without autograd: from block 0 the model's logits;
    from block 1 and position 7, with the keys and values before from the first run, the same."""
    from attnlens.model.analysis import block_runs as br

    model = small_config_model(seed=1, **shape)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(not grad), torch.set_grad_enabled(grad):
        want = model(ids).logits.detach()
        runs = br.Recorder({"keys", "values", "resid_pre"})
        x = model.embed(ids)
        final = br.run_rows(model, br.span(model, 0, 12), [0], lambda layer, n: x, runs, lambda: None, last_only=False)
        torch.testing.assert_close(model.lm_head(br.norm(model.ln_f, final)), want, atol=1e-6, rtol=0)
        later = br.run_rows(model, br.span(model, 7, 12, runs), [1], lambda layer, n: runs.got["resid_pre"][layer][:, 7:],
                            br.Tap(), lambda: None)
        got = float(br.metric(model, later[:, -1], br.readout(model, 3, 5)).detach())
        assert got == pytest.approx(float(want[0, -1, 3] - want[0, -1, 5]), abs=1e-6)


# --- the operation: by name, checked, stepped -----------------------------------------------------
@pytest.fixture(scope="module")
def small():
    """A random rotary, grouped-query decoder (Llama-style) and a task on it."""
    model = small_config_model(seed=2, positional="rotary", norm_type="rmsnorm", ffn="gated", activation="silu",
                               bias=False, n_kv_heads=2, n_layers=3)
    return model, task_for(model.config.vocab_size, length=9, changes=(2, 5), position=7)


def test_patch_call_runs_by_name_as_its_functions(small):
    model, task = small
    call = pickle.loads(pickle.dumps(PatchCall(**task.kwargs, component="heads_by_position")))
    got = run_operation(model, call)
    assert got == patch(model, component="heads_by_position", **task.kwargs)
    call = PatchCall(**task.kwargs, component="residual", method="attribution")
    assert run_operation(model, call) == attribution_patch(model, component="residual", **task.kwargs)
    call = PatchCall(**task.kwargs, component="paths", sender=(1, 3))
    assert run_operation(model, call).values["v"][2] == patch(model, component="paths", sender=(1, 3),
                                                            **task.kwargs).values["v"][2]


@pytest.mark.parametrize("change, words", [
    (dict(corrupted_ids=[1, 2, 3]), ["corrupted", "3", "9"]),
    (dict(component="paths", sender=(3, 0)), ["sender layer 3", "0..2"]),
    (dict(component="paths", sender=(0, 4)), ["sender head 4"]),
    (dict(component="paths"), ["sender"]),
    (dict(position=9), ["position 9", "0..8"]),
    (dict(answer_id=97), ["answer_id 97"]),
    (dict(component="paths", sender=(0, 0), method="attribution"), ["paths", "exact"]),
    (dict(component="neurons"), ["component"]),
    (dict(method="integrated"), ["method"]),
])
def test_the_call_is_checked_naming_the_field(small, change, words):
    model, task = small
    call = PatchCall(**{**task.kwargs, **change})
    with pytest.raises(ValueError) as checked:
        call.check(model.config)
    with pytest.raises(ValueError) as ran:
        run_operation(model, call)
    assert str(checked.value) == str(ran.value)
    for word in words:
        assert word in str(checked.value)


def test_paths_refuse_a_post_norm_model():
    model = small_config_model(norm="post")
    with pytest.raises(ValueError, match="pre-norm"):
        patch(model, [1, 2, 3], [1, 5, 3], 4, 5, component="paths", sender=(0, 0))


def test_report_is_called_after_every_block_and_a_raising_report_stops_the_call(small):
    """One pass over the blocks for the clean and corrupted runs and one for every head of every layer
    (the rows join at their blocks): no whole forward per cell."""
    model, task = small
    L = model.config.n_layers
    calls = []
    patch(model, component="heads", report=lambda: calls.append(1), **task.kwargs)
    assert len(calls) == 2 * L

    class Gone(Exception):
        pass

    def stop():
        if len(calls) > 3 * L:
            raise Gone
        calls.append(1)
    with pytest.raises(Gone):
        patch(model, component="heads_by_position", report=stop, **task.kwargs)


def test_a_byte_budget_of_one_row_gives_the_same_values(small):
    model, task = small
    whole = patch(model, component="heads", **task.kwargs)
    calls = []
    one = patch(model, component="heads", max_bytes=1, report=lambda: calls.append(1), **task.kwargs)
    np.testing.assert_allclose(one.values, whole.values, atol=1e-6)
    c = model.config
    assert len(calls) == c.n_layers + sum(c.n_layers - l for l in range(c.n_layers) for _ in range(c.n_heads))


def test_cells_the_difference_never_reaches_keep_the_corrupted_metric(small):
    model, task = small
    got = patch(model, component="heads_by_position", **task.kwargs)
    for layer in got.values:
        for p in (0, 1, 8):  # before the first difference (2) and after the metric's position (7)
            assert layer[p] == [got.corrupted_metric] * model.config.n_heads
    same = patch(model, task.kwargs["clean_ids"], task.kwargs["clean_ids"], 3, 4, component="heads")
    assert same.first_difference == 9 and same.clean_metric == pytest.approx(same.corrupted_metric, abs=1e-6)
    assert {v for row in same.values for v in row} == {same.corrupted_metric}


def test_attribution_with_inference_tensor_weights_under_inference_mode():
    """A model loaded under inference mode has inference-tensor parameters, which autograd cannot save:
    the call's products take plain copies."""
    task = task_for(97, length=8, changes=(3,), position=6)
    over = dict(positional="rotary", norm_type="rmsnorm", ffn="gated", activation="silu", bias=False, qk_norm=True,
                n_kv_heads=2)
    plain = small_config_model(seed=4, **over)
    with torch.inference_mode():
        frozen = small_config_model(seed=4, **over)
        assert next(frozen.parameters()).is_inference()
        got = attribution_patch(frozen, component="heads_by_position", **task.kwargs)
    want = attribution_patch(plain, component="heads_by_position", **task.kwargs)
    np.testing.assert_allclose(got.values, want.values, atol=1e-6)


def test_attribution_reports_in_the_callers_inference_mode(small):
    """The engine's decode steps run at a report point on the call's thread: never in its autograd."""
    model, task = small
    modes = []
    with torch.inference_mode():
        attribution_patch(model, component="heads", report=lambda: modes.append(
            (torch.is_inference_mode_enabled(), torch.is_grad_enabled())), **task.kwargs)
    assert len(modes) >= model.config.n_layers and set(modes) == {(True, False)}  # after each block of the pair


def test_attribution_stepped_by_the_engines_core_leaves_the_decode_steps_between_in_inference_mode(small):
    """As the engine runs it: a slice at a time on the core's thread, a decode step of a cache made under
    inference mode between slices (which an autograd mode left over would refuse to write)."""
    from attnlens.app.engine.core import SteppedCall

    model, task = small
    with torch.inference_mode():
        cache = model.new_kv_cache(1)
        model(torch.tensor([[1, 2]]), kv_cache=cache)
        call = SteppedCall(lambda report: run_operation(model, PatchCall(**task.kwargs, method="attribution"),
                                                        report=report))
        turns = 0
        while not call.advance():
            assert torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
            model(torch.tensor([[3]]), kv_cache=cache)
            turns += 1
    assert call.error is None and turns >= model.config.n_layers
    assert call.value == attribution_patch(model, **task.kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_every_causal_call_on_cuda_equals_the_cpus(small):
    import copy

    from attnlens.model.analysis.logit_attribution import logit_attribution
    from attnlens.model.analysis.score_decomposition import decompose_score

    model, task = small
    cuda = copy.deepcopy(model).to("cuda")
    for component in ("heads", "heads_by_position", "residual", "layers"):
        for method in ("exact", "attribution"):
            call = PatchCall(**task.kwargs, component=component, method=method)
            got, want = run_operation(cuda, call), run_operation(model, call)
            np.testing.assert_allclose(np.array(got.values if component != "layers" else list(got.values.values())),
                                       np.array(want.values if component != "layers" else list(want.values.values())),
                                       atol=1e-4)
    got = patch(cuda, component="paths", sender=(0, 1), **task.kwargs).values
    want = patch(model, component="paths", sender=(0, 1), **task.kwargs).values
    for kind in ("q", "k", "v"):
        np.testing.assert_allclose(got[kind][1:], want[kind][1:], atol=1e-4)
    ids = task.kwargs["clean_ids"]
    np.testing.assert_allclose(logit_attribution(cuda, ids, 3, 4)["heads"], logit_attribution(model, ids, 3, 4)["heads"],
                               atol=1e-4)
    np.testing.assert_allclose(decompose_score(cuda, ids, 2, 1, 8, 3)["matrix"],
                               decompose_score(model, ids, 2, 1, 8, 3)["matrix"], atol=1e-4)


# --- SmolLM2 ------------------------------------------------------------------------------------------
IOI_CLEAN = "When Mary and John went to the store, John gave a drink to"
IOI_CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


@pytest.mark.slow
def test_smollm2_finds_its_name_mover_heads_on_the_ioi_pair(smollm2):
    """The clean and corrupted logit differences (' Mary' - ' John') and the top heads by exact patching,
    as a hooked transformers loop measured them; each top head's value equal to a hooked whole forward
    of our model; attribution patching ranks the same heads first."""
    model, tok = smollm2.model, smollm2.tokenizer
    clean, corrupted = tok.encode(IOI_CLEAN), tok.encode(IOI_CORRUPTED)
    answer, foil = tok.encode(" Mary")[0], tok.encode(" John")[0]
    exact = patch(model, clean, corrupted, answer, foil, component="heads")
    assert exact.clean_metric == pytest.approx(6.12, abs=0.02)
    assert exact.corrupted_metric == pytest.approx(-5.49, abs=0.02)
    effect = np.array(exact.values) - exact.corrupted_metric  # (30, 9)
    H = model.config.n_heads
    top = [divmod(int(i), H) for i in np.argsort(-effect, axis=None)[:6]]
    assert top[:5] == [(23, 3), (29, 1), (20, 0), (17, 4), (19, 2)]
    assert effect[23, 3] == pytest.approx(6.8, abs=0.05)

    from attnlens.model.hooks import Hooks, hooked

    hooks = Hooks(record=lambda name: name.endswith("attn.hook_z"))
    with torch.inference_mode(), hooked(model, hooks):
        model(torch.tensor([clean]))
    D = model.config.d_head
    for layer, head in top[:5]:
        z = hooks.captured[f"blocks.{layer}.attn.hook_z"][0, :, head]  # (T, D)

        def pre(module, args):
            x = args[0].clone()
            x[0, :, head * D:(head + 1) * D] = z
            return (x,)
        handle = model.blocks[layer].attn.proj.register_forward_pre_hook(pre)
        try:
            with torch.inference_mode():
                logits = model(torch.tensor([corrupted])).logits[0, -1]
        finally:
            handle.remove()
        assert exact.values[layer][head] == pytest.approx(float(logits[answer] - logits[foil]), abs=1e-3)

    with torch.inference_mode():
        estimate = attribution_patch(model, clean, corrupted, answer, foil, component="heads")
    guess = np.array(estimate.values) - estimate.corrupted_metric
    assert {divmod(int(i), H) for i in np.argsort(-guess, axis=None)[:6]} == set(top)
    assert np.corrcoef(effect.ravel(), guess.ravel())[0, 1] > 0.95

"""Patching and logit attribution of an encoder-decoder (model/analysis/encoder_decoder_patching.py,
encoder_decoder_paths.py, encoder_decoder_attribution.py) against an independent reference: the model's
own forward with torch hooks on its modules, one whole forward per cell (each head's z set to the clean
run's at the output projection's input, a block's input, a sub-layer's output; path patching: two
forwards per receiver input, the sender run's and the receiver's), for every group of the bundled
translator (post-norm) and of a sharp random pre-norm one; attribution patching against its gradient definition
(autograd through that forward); direct logit attribution against the gradient of the logit difference
with every norm's scale frozen and every sub-layer's input cut from the graph (the direct path)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO_ROOT

from attnlens.model.analysis.encoder_decoder_attribution import encoder_decoder_logit_attribution
from attnlens.model.analysis.encoder_decoder_patching import attribution_patch_encoder_decoder, patch_encoder_decoder
from attnlens.model.analysis.encoder_decoder_runs import POINTS
from attnlens.model.analysis.operations import LogitAttributionCall, PatchCall, run_operation

GROUPS = ("encoder", "decoder", "cross")
LAYERS = {"encoder": {"attention": "encoder.attn_out", "mlp": "encoder.mlp_out"},
          "decoder": {"attention": "decoder.attn_out", "cross": "cross.attn_out", "mlp": "decoder.mlp_out"}}


class Loop:
    """TransformerLens's patching written out on the model's own forward (not the analysis' blocks): each
    cell one forward of the corrupted source, one activation replaced through a torch hook."""

    def __init__(self, model, clean, corrupted, target, answer, foil, position=None):
        self.model, self.answer, self.foil = model, answer, foil
        self.sources = {"clean": torch.tensor([clean]), "corrupted": torch.tensor([corrupted])}
        self.target = torch.tensor([[model.config.decoder_start_id, *target]])  # the whole target, never cut
        self.position = self.target.shape[1] - 1 if position is None else position
        self.D, self.L = model.config.d_head, model.config.n_layers
        self.clean = self.record("clean")

    def hook(self, point: str, layer: int, edit):
        group, kind = point.split(".")
        block = (self.model.encoder if group == "encoder" else self.model.decoder).blocks[layer]
        attn = block.cross_attn if group == "cross" else block.attn
        if kind == "z":  # the output projection's input: each head's z side by side (B, T, HD)
            return attn.proj.register_forward_pre_hook(lambda m, args: (edit(args[0]),))
        if kind == "resid_pre":
            return block.register_forward_pre_hook(lambda m, args: (edit(args[0]), *args[1:]))
        if kind == "attn_out":
            return attn.register_forward_hook(lambda m, args, out: (edit(out[0]), *out[1:]))
        return block.ffn.register_forward_hook(lambda m, args, out: edit(out))

    def forward(self, which: str, handles, grad: bool = False) -> torch.Tensor:
        try:
            with torch.set_grad_enabled(grad):
                logits = self.model(self.target, source=self.sources[which]).logits[0, self.position]
            return logits[self.answer] - logits[self.foil]
        finally:
            for h in handles:
                h.remove()

    def record(self, which: str, grad: bool = False) -> dict:
        kept: dict = {}

        def keeper(key):
            def keep(t):
                if grad:
                    t = t.clone()
                    t.retain_grad()
                kept[key] = t
                return t
            return keep
        value = self.forward(which, [self.hook(p, l, keeper((p, l))) for p in POINTS for l in range(self.L)], grad)
        if grad:
            value.backward()
        return kept

    def cell(self, point: str, layer: int, head: int = -1, position: int = -1) -> float:
        clean = self.clean[point, layer]
        where = slice(None) if position < 0 else position
        cols = slice(None) if head < 0 else slice(head * self.D, (head + 1) * self.D)

        def edit(t):
            t = t.clone()
            t[0, where, cols] = clean[0, where, cols]
            return t
        return float(self.forward("corrupted", [self.hook(point, layer, edit)]))


def sharp_translator(norm: str, seed: int = 0):
    """A random encoder-decoder whose heads attend sharply (query/key weights scaled up) and whose logits
    differ by units, not hundredths: what the comparisons need to be meaningful."""
    from attnlens.model import ModelConfig
    from attnlens.model.families.encoder_decoder import EncoderDecoder

    torch.manual_seed(seed)
    model = EncoderDecoder(ModelConfig(family="encoder-decoder", vocab_size=97, context_length=32, d_model=32,
                                       n_layers=2, n_heads=4, d_ff=64, norm=norm, activation="relu",
                                       positional="sinusoidal", scale_embeddings=True)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
        for stack in (model.encoder, model.decoder):
            for block in stack.blocks:
                for attn in (block.attn, block.cross_attn):
                    if attn is not None:
                        attn.qkv.weight.mul_(4)
                block.ffn.proj.weight.mul_(4)
        model.lm_head.weight.mul_(4)  # tied: the embeddings too
    return model


@pytest.fixture(scope="module", params=["translator", "pre-norm"])
def case(request):
    """The bundled translator on a dates pair (its answer ' mars', its foil ' mai'), or a sharp random
    pre-norm encoder-decoder on a random pair; and the hooked loop over each."""
    if request.param == "translator":
        from attnlens.model import load_checkpoint

        path = REPO_ROOT / "checkpoints" / "translator"
        if not (path / "model.safetensors").is_file():
            pytest.skip("the bundled translator is not in checkpoints/translator")
        ck = load_checkpoint(path)
        tok, model = ck.tokenizer, ck.model
        clean, corrupted = tok.encode("March 3, 2021"), tok.encode("May 3, 2021")
        target, answer, foil = tok.encode("3"), tok.encode(" mars")[0], tok.encode(" mai")[0]
    else:
        model = sharp_translator("pre")
        clean, target = [11, 40, 7, 63, 22], [5, 71, 30]
        corrupted, answer, foil = [11, 40, 52, 63, 22], 3, 4
    kwargs = dict(clean_ids=clean, corrupted_ids=corrupted, answer_id=answer, foil_id=foil, target_ids=target)
    return SimpleNamespace(model=model, kw=kwargs, loop=Loop(model, clean, corrupted, target, answer, foil),
                           S=len(clean), T=len(target) + 1)


def assert_close(got, want, atol=1e-4) -> float:
    got, want = np.array(got, dtype=np.float64), np.array(want, dtype=np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    return float(np.abs(got - want).max())


def test_the_metrics_are_the_models_own(case):
    got = patch_encoder_decoder(case.model, **case.kw)
    assert got.clean_metric == pytest.approx(float(case.loop.forward("clean", [])), abs=1e-4)
    assert got.corrupted_metric == pytest.approx(float(case.loop.forward("corrupted", [])), abs=1e-4)
    assert abs(got.clean_metric - got.corrupted_metric) > 0.1  # the source change moves the metric
    assert got.position == case.T - 1 and got.first_difference == (0 if case.S == 4 else 2)


def test_heads_equal_the_hooked_loop_in_every_group(case):
    c = case.model.config
    got = patch_encoder_decoder(case.model, component="heads", **case.kw).values
    assert set(got) == set(GROUPS)
    for group in GROUPS:
        want = [[case.loop.cell(f"{group}.z", l, h) for h in range(c.n_heads)] for l in range(c.n_layers)]
        assert_close(got[group], want)
        assert np.std(want) > 1e-3  # the cells differ: the comparison is not vacuous


def test_heads_by_position_equal_the_hooked_loop_in_every_group(case):
    c = case.model.config
    got = patch_encoder_decoder(case.model, component="heads_by_position", **case.kw).values
    for group in GROUPS:
        n = case.S if group == "encoder" else case.T
        want = [[[case.loop.cell(f"{group}.z", l, h, p) for h in range(c.n_heads)] for p in range(n)]
                for l in range(c.n_layers)]
        assert_close(got[group], want)
        assert np.std(want) > 1e-3


def test_residual_and_layers_equal_the_hooked_loop(case):
    L = case.model.config.n_layers
    residual = patch_encoder_decoder(case.model, component="residual", **case.kw).values
    layers = patch_encoder_decoder(case.model, component="layers", **case.kw).values
    assert set(residual) == {"encoder", "decoder"} and {k: set(v) for k, v in layers.items()} == \
        {k: set(v) for k, v in LAYERS.items()}
    for stack in ("encoder", "decoder"):
        n = case.S if stack == "encoder" else case.T
        want = [[case.loop.cell(f"{stack}.resid_pre", l, -1, p) for p in range(n)] for l in range(L)]
        assert_close(residual[stack], want)
        for name, point in LAYERS[stack].items():
            assert_close(layers[stack][name], [[case.loop.cell(point, l, -1, p) for p in range(n)] for l in range(L)])


def test_a_metric_before_the_last_target_position(case):
    """The metric at target position 1: cells at later positions keep the corrupted metric."""
    c = case.model.config
    kw = {**case.kw, "position": 1}
    loop = Loop(case.model, kw["clean_ids"], kw["corrupted_ids"], kw["target_ids"], kw["answer_id"], kw["foil_id"], 1)
    got = patch_encoder_decoder(case.model, component="heads_by_position", **kw)
    assert got.position == 1
    want = [[[loop.cell("cross.z", l, h, p) for h in range(c.n_heads)] for p in range(case.T)] for l in range(c.n_layers)]
    assert_close(got.values["cross"], want)
    assert all(row[p] == [got.corrupted_metric] * c.n_heads for row in got.values["cross"] for p in range(2, case.T))


@pytest.mark.parametrize("component", ["heads", "heads_by_position", "residual", "layers"])
def test_attribution_is_the_gradient_times_the_difference(case, component):
    """Under the engine's inference mode: autograd is enabled inside the call."""
    loop, L, H = case.loop, case.model.config.n_layers, case.model.config.n_heads
    acts = loop.record("corrupted", grad=True)  # autograd through the model's own forward

    def effect(point: str, layer: int, head: int = -1, position: int = -1) -> float:
        a = acts[point, layer]
        e = ((loop.clean[point, layer] - a.detach()) * a.grad)[0]  # (T, HD or C)
        e = e if position < 0 else e[position:position + 1]
        e = e if head < 0 else e[:, head * loop.D:(head + 1) * loop.D]
        return float(e.sum())
    with torch.inference_mode():
        got = attribution_patch_encoder_decoder(case.model, component=component, **case.kw)
    base = got.corrupted_metric
    assert got.method == "attribution" and base == pytest.approx(float(loop.forward("corrupted", [])), abs=1e-4)
    n = {"encoder": case.S, "decoder": case.T, "cross": case.T}
    if component == "heads":
        for group in GROUPS:
            assert_close(got.values[group], [[base + effect(f"{group}.z", l, h) for h in range(H)] for l in range(L)])
    elif component == "heads_by_position":
        for group in GROUPS:
            assert_close(got.values[group], [[[base + effect(f"{group}.z", l, h, p) for h in range(H)]
                                              for p in range(n[group])] for l in range(L)])
    else:
        leaves = [(s, None, f"{s}.resid_pre") for s in ("encoder", "decoder")] if component == "residual" else \
            [(s, name, point) for s, names in LAYERS.items() for name, point in names.items()]
        for stack, name, point in leaves:
            grid = got.values[stack] if name is None else got.values[stack][name]
            assert_close(grid, [[base + effect(point, l, -1, p) for p in range(n[stack])] for l in range(L)])


def test_attribution_ranks_the_translators_cross_heads_as_exact_patching_does(case):
    exact = patch_encoder_decoder(case.model, component="heads", **case.kw)
    with torch.inference_mode():
        guess = attribution_patch_encoder_decoder(case.model, component="heads", **case.kw)
    e = np.array(exact.values["cross"]) - exact.corrupted_metric
    g = np.array(guess.values["cross"]) - guess.corrupted_metric
    assert np.corrcoef(e.ravel(), g.ravel())[0, 1] > 0.8


# --- path patching ----------------------------------------------------------------------------------
class PathLoop:
    """Path patching written out on the model's own forward, the slow obvious way: torch forward hooks on
    its hook points (live under an empty Hooks) replace what they pass on. Per receiver input, two whole
    forwards of the corrupted source: the sender run (every head's z and every MLP's output the corrupted
    run's, the sender head's z the clean run's), which gives the receiver's input; then the corrupted run
    with that one head's q, k or v replaced."""

    def __init__(self, loop: Loop):
        self.loop, self.model = loop, loop.model
        self.kept = {which: self.forward(which, {}, keep=("hook_z", "hook_mlp_out"))[1] for which in ("clean", "corrupted")}

    def points(self):
        """(name, hook point module) of every attention's z, q, k, v and every block's MLP output."""
        return [(n, m) for n, m in self.model.named_modules()
                if n.rsplit(".", 1)[-1] in ("hook_z", "hook_q", "hook_k", "hook_v", "hook_mlp_out")]

    def forward(self, which: str, edits: dict, keep: tuple[str, ...] = ()) -> tuple[torch.Tensor, dict]:
        """The metric of `which` source and the tensors of the hook points whose names end with `keep`,
        edits[name](t) replacing what hook point `name` passes on."""
        from attnlens.model.hooks import Hooks, hooked

        kept: dict = {}

        def hook(name):
            def run(module, args, out):
                out = edits[name](out) if name in edits else out
                if name.endswith(keep):
                    kept[name] = out
                return out
            return run
        handles = [m.register_forward_hook(hook(n)) for n, m in self.points()]
        try:
            with torch.no_grad(), hooked(self.model, Hooks()):
                logits = self.model(self.loop.target, source=self.loop.sources[which]).logits[0, self.loop.position]
        finally:
            for h in handles:
                h.remove()
        return logits[self.loop.answer] - logits[self.loop.foil], kept

    def sender_inputs(self, sender: tuple[str, int, int]) -> dict:
        group, layer, head = sender
        module = lambda g, l: f"{'encoder' if g == 'encoder' else 'decoder'}.blocks.{l}.{'cross_attn' if g == 'cross' else 'attn'}"
        clean, corrupted = self.kept["clean"], self.kept["corrupted"]
        edits = {name: (lambda t, name=name: corrupted[name]) for name in corrupted}
        sender_z = f"{module(group, layer)}.hook_z"

        def mixed(t):
            t = corrupted[sender_z].clone()
            t[:, :, head] = clean[sender_z][:, :, head]  # [B, T, H, D]
            return t
        edits[sender_z] = mixed
        return self.forward("corrupted", edits, keep=("hook_q", "hook_k", "hook_v"))[1]

    def cell(self, sent: dict, group: str, kind: str, layer: int, head: int) -> float:
        stack = "encoder" if group == "encoder" else "decoder"
        name = f"{stack}.blocks.{layer}.{'cross_attn' if group == 'cross' else 'attn'}.hook_{kind}"

        def receive(t):
            t = t.clone()
            t[:, :, head] = sent[name][:, :, head]  # [B, T, H, D]
            return t
        return float(self.forward("corrupted", {name: receive})[0])


@pytest.fixture(scope="module")
def path_loop(case):
    return PathLoop(case.loop)


SENDERS = [("encoder", 0, 1), ("encoder", 1, 3), ("decoder", 0, 2), ("decoder", 1, 0), ("cross", 0, 3), ("cross", 1, 1)]


@pytest.mark.parametrize("sender", SENDERS)
def test_paths_equal_a_hooked_loop_in_every_group(case, path_loop, sender):
    """Every receiver input a sender reaches, against the loop of hooked forwards; None where no direct path
    runs (an encoder head reaches the decoder's stream only through the frozen cross heads)."""
    L, H = case.model.config.n_layers, case.model.config.n_heads
    got = patch_encoder_decoder(case.model, component="paths", sender=sender, **case.kw)
    assert (got.sender_group, got.sender) == (sender[0], sender[1:])
    assert set(got.values) == set(GROUPS) and all(set(v) == {"q", "k", "v"} for v in got.values.values())
    group, layer, _ = sender
    later = range(layer + 1, L)
    reach = {("encoder", k): later if group == "encoder" else () for k in "qkv"}
    reach |= {("decoder", k): () if group == "encoder" else later for k in "qkv"}
    reach |= {("cross", "q"): () if group == "encoder" else range(layer, L) if group == "decoder" else later,
              ("cross", "k"): range(L) if group == "encoder" else (), ("cross", "v"): range(L) if group == "encoder" else ()}
    sent = path_loop.sender_inputs(sender)
    moved = []
    for (g, kind), layers in reach.items():
        grid = got.values[g][kind]
        for l in range(L):
            if l not in layers:
                assert grid[l] == [None] * H, (g, kind, l)
                continue
            want = [path_loop.cell(sent, g, kind, l, h) for h in range(H)]
            assert_close(grid[l], want, atol=2e-5)  # float32 at |metric| ~ 20
            moved += want
    if sender[:2] == ("decoder", 0):  # block 0's self-attention reads the same target in both runs: no run
        reached = {v for g in got.values.values() for grid in g.values() for row in grid for v in row} - {None}
        assert reached == {got.corrupted_metric}
    elif moved:  # (none after the last layer's cross heads)
        assert np.ptp(moved) > 2e-4  # the receivers differ by 10x the tolerance: the comparison is not vacuous


def test_a_pre_norm_path_is_the_corrupted_stream_plus_the_senders_write(small):
    """Pre-norm, the sender run's stream is the corrupted one plus the sender's clean-minus-corrupted write,
    as a decoder's paths define it; so a receiver's query equals ln1(corrupted stream + delta) projected."""
    from attnlens.model.analysis import encoder_decoder_runs as runs
    from attnlens.model.analysis.encoder_decoder_paths import FROZEN, SenderRun
    from attnlens.model.analysis.encoder_decoder_runs import Pair

    model = sharp_translator("pre", seed=4)
    _, kw = small
    pair = Pair(model, kw["clean_ids"], kw["corrupted_ids"], kw["target_ids"], kw["answer_id"], kw["foil_id"], None)
    with torch.no_grad():
        pair.run(model, set(FROZEN) | {"encoder.resid_pre"}, lambda: None)
        sent = SenderRun(pair.got.got, ("encoder", 0, 2))
        runs.run_rows(model, [0], pair.start(), sent, lambda: None)
        attn, D = model.encoder.blocks[1].attn, model.config.d_head
        z = pair.got.got["encoder.z"][0][:, :, 2]  # (2, S, D)
        delta = (z[0] - z[1]) @ model.encoder.blocks[0].attn.proj.weight[:, 2 * D:3 * D].t()  # (S, C)
        x = pair.got.got["encoder.resid_pre"][1][1] + delta  # (S, C)
        q = F.linear(model.encoder.blocks[1].ln1(x), attn.qkv.weight[:4 * D], attn.qkv.bias[:4 * D])  # (S, HD)
    torch.testing.assert_close(sent.got["encoder.q"][1][0].transpose(0, 1).reshape(-1, 4 * D), q, atol=1e-5, rtol=0)


def test_paths_are_checked_naming_the_sender(small):
    model, kw = small
    for change, words in [(dict(sender=(0, 0)), "sender group None"),
                          (dict(sender=(0, 0), sender_group="self"), "sender group 'self'"),
                          (dict(sender=(2, 0), sender_group="cross"), "sender layer 2 out of range 0..1"),
                          (dict(sender=(0, 4), sender_group="encoder"), "sender head 4 out of range 0..3"),
                          (dict(), "needs a sender"),
                          (dict(sender=(0, 0), sender_group="cross", method="attribution"), "exactly only")]:
        call = PatchCall(**kw, component="paths", **change)
        with pytest.raises(ValueError, match=words):
            call.check(model.config)
        with pytest.raises(ValueError, match=words):
            run_operation(model, call)
    with pytest.raises(ValueError, match="sender is for component paths only"):
        PatchCall(**kw, sender_group="cross").check(model.config)


def test_the_paths_call_runs_by_name_batched_or_not(small):
    model, kw = small
    call = pickle.loads(pickle.dumps(PatchCall(**kw, component="paths", sender=(0, 1), sender_group="encoder")))
    got = run_operation(model, call)
    one = patch_encoder_decoder(model, component="paths", sender=("encoder", 0, 1), max_bytes=1, **kw)
    assert got.sender == (0, 1) and got.sender_group == "encoder"
    for group in GROUPS:
        for kind in "qkv":
            np.testing.assert_allclose(np.array(one.values[group][kind], dtype=float),
                                       np.array(got.values[group][kind], dtype=float), atol=2e-5)


# --- direct logit attribution -----------------------------------------------------------------------
def direct_gradients(model, source: list[int], target: list[int], answer: int, foil: int, position: int) -> dict:
    """d logit difference / d (each sub-layer's output, each head's z, the target's embedding) at `position`
    along the direct path only: every LayerNorm's scale frozen (detached) and every sub-layer's input cut
    from the graph, by torch hooks on the model's own forward."""
    import torch.nn as nn

    kept, handles = {}, []

    def frozen(m, args, out):
        u = args[0]
        sigma = torch.sqrt(u.var(-1, unbiased=False, keepdim=True) + m.eps).detach()
        return (u - u.mean(-1, keepdim=True)) / sigma * m.weight + m.bias
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            handles.append(m.register_forward_hook(frozen))
    for l, block in enumerate(model.decoder.blocks):
        for attn, name in ((block.attn, "decoder"), (block.cross_attn, "cross")):
            handles.append(attn.register_forward_pre_hook(  # the sub-layer reads a cut copy of the stream
                lambda m, args, kwargs: ((args[0].detach(), *args[1:]), kwargs), with_kwargs=True))

            def keep_z(m, args, key=(name, l)):
                z = args[0].detach().requires_grad_()
                kept[key] = z
                return (z,)
            handles.append(attn.proj.register_forward_pre_hook(keep_z))

        def keep_mlp(m, args, out, key=("mlp", l)):
            out = out.detach().requires_grad_()
            kept[key] = out
            return out
        handles.append(block.ffn.register_forward_pre_hook(lambda m, args: (args[0].detach(),)))
        handles.append(block.ffn.register_forward_hook(keep_mlp))

    def keep_embedding(m, args):
        x = args[0].detach().requires_grad_()
        kept["embedding"] = x
        return (x, *args[1:])
    handles.append(model.decoder.blocks[0].register_forward_pre_hook(keep_embedding))
    try:
        with torch.enable_grad():
            logits = model(torch.tensor([[model.config.decoder_start_id, *target]]),
                           source=torch.tensor([source])).logits[0, position]
            (logits[answer] - logits[foil]).backward()
    finally:
        for h in handles:
            h.remove()
    return kept


def test_logit_attribution_parts_sum_and_equal_the_direct_gradients(case):
    model, kw = case.model, case.kw
    c = model.config
    for position in (None, 1):
        got = encoder_decoder_logit_attribution(model, kw["clean_ids"], kw["target_ids"], kw["answer_id"],
                                                kw["foil_id"], position)
        pos = case.T - 1 if position is None else position
        assert got["position"] == pos
        total = np.sum(got["heads"]["decoder"]) + np.sum(got["heads"]["cross"]) + np.sum(got["mlps"]) + \
            got["embedding"] + got["other"]
        assert total == pytest.approx(got["logit_difference"], abs=1e-4)
        assert sum(got["other_parts"].values()) == pytest.approx(got["other"], abs=1e-9)
        assert got["logit_difference"] == pytest.approx(got["answer_logit"] - got["foil_logit"], abs=1e-5)
        grads = direct_gradients(model, kw["clean_ids"], kw["target_ids"], kw["answer_id"], kw["foil_id"], pos)
        D, H = c.d_head, c.n_heads
        for l in range(c.n_layers):
            assert got["mlps"][l] == pytest.approx(float((grads["mlp", l] * grads["mlp", l].grad)[0, pos].sum().detach()),
                                                   abs=1e-4)
            for group in ("decoder", "cross"):
                z = grads[group, l]  # a head's part is (z - c) . grad: its constant value c counts with the biases
                per_head = (z * z.grad)[0, pos].view(H, D).sum(-1).detach().tolist()
                constant = grad_constant(model, group, l, z.grad[0, pos])
                assert_close(got["heads"][group][l], np.array(per_head) - constant)
        assert got["embedding"] + got["other_parts"]["positions"] == pytest.approx(
            float((grads["embedding"] * grads["embedding"].grad)[0, pos].sum().detach()), abs=1e-4)


def grad_constant(model, group: str, layer: int, grad_z: torch.Tensor) -> np.ndarray:
    """Each head's constant value c (its value bias plus W_V times the bias of the norm its values read)
    dotted with d metric / d z: the part of z . grad a head's logit attribution leaves to the biases."""
    block = model.decoder.blocks[layer]
    attn = block.attn if group == "decoder" else block.cross_attn
    H, D = attn.n_heads, attn.d_head
    if group == "cross":
        norm = model.encoder_norm
    elif block.pre_norm:
        norm = block.ln1
    else:
        norm = model.decoder.blocks[layer - 1].ln2 if layer else None
    c = attn.qkv.bias.detach()[2 * H * D:].clone() if attn.qkv.bias is not None else torch.zeros(H * D)
    if norm is not None and norm.bias is not None:
        c = c + attn.qkv.weight.detach()[2 * H * D:] @ norm.bias.detach()
    return (c * grad_z).view(H, D).sum(-1).detach().numpy()


# --- the operation: by name, checked, stepped --------------------------------------------------------
def test_the_calls_run_by_name_as_their_functions(case):
    kw = case.kw
    call = pickle.loads(pickle.dumps(PatchCall(**kw, component="layers")))
    assert run_operation(case.model, call) == patch_encoder_decoder(case.model, component="layers", **kw)
    call = PatchCall(**kw, component="heads_by_position", method="attribution")
    assert run_operation(case.model, call) == attribution_patch_encoder_decoder(case.model, component="heads_by_position",
                                                                               **kw)
    call = LogitAttributionCall(kw["clean_ids"], None, None, 0, kw["target_ids"])
    want = encoder_decoder_logit_attribution(case.model, kw["clean_ids"], kw["target_ids"], position=0)
    assert run_operation(case.model, call) == want


@pytest.fixture(scope="module")
def small():
    model = sharp_translator("post", seed=1)
    return model, dict(clean_ids=[1, 2, 3, 4, 5, 6], corrupted_ids=[1, 2, 9, 4, 5, 6], answer_id=3, foil_id=4,
                       target_ids=[7, 8, 10])


@pytest.mark.parametrize("change, words", [
    (dict(corrupted_ids=[1, 2, 3]), ["corrupted_ids has 3 tokens and clean_ids 6"]),
    (dict(position=4), ["position 4 out of range 0..3", "start token"]),
    (dict(target_ids=[7, 97]), ["target_ids: token id 97"]),
    (dict(target_ids=list(range(40))), ["target_ids has 40 tokens", "context length 32"]),
    (dict(answer_id=97), ["answer_id 97"]),
    (dict(component="paths", sender=(0, 0)), ["sender group None", "encoder, decoder, cross"]),
    (dict(sender=(0, 0)), ["sender is for component paths only"]),
    (dict(component="neurons"), ["component"]),
    (dict(method="integrated"), ["method"]),
])
def test_the_call_is_checked_naming_the_field(small, change, words):
    model, kw = small
    call = PatchCall(**{**kw, **change})
    with pytest.raises(ValueError) as checked:
        call.check(model.config)
    with pytest.raises(ValueError) as ran:
        run_operation(model, call)
    assert str(checked.value) == str(ran.value)
    for word in words:
        assert word in str(checked.value)


def test_a_decoders_call_refuses_a_target(small):
    from helpers import small_config_model

    model = small_config_model()
    with pytest.raises(ValueError, match="^target_ids is an encoder-decoder's target; this model is an decoder"):
        PatchCall([1, 2], [1, 3], 3, 4, target_ids=[5]).check(model.config)
    with pytest.raises(ValueError, match="^target_ids"):
        LogitAttributionCall([1, 2], target_ids=[5]).check(model.config)


def test_report_after_every_block_and_a_raising_report_stops_the_call(small):
    """One pass of 2L blocks for the pair, then a pass from each batch's first block."""
    model, kw = small
    L = model.config.n_layers
    calls = []
    got = patch_encoder_decoder(model, component="heads", report=lambda: calls.append(1), **kw)
    assert len(calls) == 2 * L + 2 * L  # the pair; every head's row in one batch from the encoder's first block

    class Gone(Exception):
        pass

    def stop():
        if len(calls) > 4 * L + 3:
            raise Gone
        calls.append(1)
    with pytest.raises(Gone):
        patch_encoder_decoder(model, component="heads_by_position", report=stop, **kw)
    one = patch_encoder_decoder(model, component="heads", max_bytes=1, **kw)  # a row a batch: the same values
    for group in GROUPS:
        np.testing.assert_allclose(one.values[group], got.values[group], atol=1e-6)


def test_cells_that_change_nothing_are_not_run(small):
    """The same target in both runs: the decoder's input stream and its first self-attention are the
    clean run's already, so they keep the corrupted metric (without a row); identical sources change
    nothing anywhere."""
    model, kw = small
    got = patch_encoder_decoder(model, component="layers", **kw)
    assert got.values["decoder"]["attention"][0] == [got.corrupted_metric] * 4
    got = patch_encoder_decoder(model, component="residual", **kw)
    assert got.values["decoder"][0] == [got.corrupted_metric] * 4
    assert got.values["encoder"][0][0] == got.corrupted_metric  # the sources differ at position 2 only
    calls = []
    same = patch_encoder_decoder(model, **{**kw, "corrupted_ids": kw["clean_ids"]}, component="heads_by_position",
                                 report=lambda: calls.append(1))
    assert len(calls) == 2 * model.config.n_layers and same.first_difference == 6
    assert {v for g in GROUPS for row in same.values[g] for cell in row for v in cell} == {same.corrupted_metric}


def test_attribution_reports_in_the_callers_inference_mode(small):
    model, kw = small
    modes = []
    with torch.inference_mode():
        attribution_patch_encoder_decoder(model, component="heads", report=lambda: modes.append(
            (torch.is_inference_mode_enabled(), torch.is_grad_enabled())), **kw)
    assert len(modes) >= 2 * model.config.n_layers and set(modes) == {(True, False)}


def test_attribution_with_inference_tensor_weights():
    """A model made under inference mode has inference-tensor parameters, which autograd cannot save."""
    kw = dict(clean_ids=[1, 2, 3, 4], corrupted_ids=[1, 5, 3, 4], answer_id=3, foil_id=4, target_ids=[6])
    plain = sharp_translator("pre", seed=2)
    with torch.inference_mode():
        frozen = sharp_translator("pre", seed=2)
        assert next(frozen.parameters()).is_inference()
        got = attribution_patch_encoder_decoder(frozen, component="heads_by_position", **kw)
    want = attribution_patch_encoder_decoder(plain, component="heads_by_position", **kw)
    for group in GROUPS:
        np.testing.assert_allclose(got.values[group], want.values[group], atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_the_translators_calls_on_cuda_equal_the_cpus(small):
    import copy

    model, kw = small
    cuda = copy.deepcopy(model).to("cuda")
    for component in ("heads", "heads_by_position", "residual", "layers"):
        for method in ("exact", "attribution"):
            call = PatchCall(**kw, component=component, method=method)
            got, want = run_operation(cuda, call).values, run_operation(model, call).values
            flat = lambda v: np.concatenate([np.ravel(x) for x in _leaves(v)])
            np.testing.assert_allclose(flat(got), flat(want), atol=1e-4)
    for sender in SENDERS:
        call = PatchCall(**kw, component="paths", sender=sender[1:], sender_group=sender[0])
        got, want = run_operation(cuda, call).values, run_operation(model, call).values
        for group in GROUPS:
            for kind in "qkv":
                np.testing.assert_allclose(np.array(got[group][kind], dtype=float),
                                           np.array(want[group][kind], dtype=float), atol=1e-4)
    call = LogitAttributionCall(kw["clean_ids"], 3, 4, None, kw["target_ids"])
    got, want = run_operation(cuda, call), run_operation(model, call)
    np.testing.assert_allclose(got["heads"]["cross"], want["heads"]["cross"], atol=1e-4)


def _leaves(tree):
    return [tree] if not isinstance(tree, dict) else [x for v in tree.values() for x in _leaves(v)]

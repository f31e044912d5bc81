"""The fused decode step (model/fused_decode.py: every block of a decode step in one C call)
against the modular path (model/parts/block.py), which the rest of the suite proves against
transformers and TransformerLens: the same logits, maps and cache, for every part the C step
computes (grouped-query heads, Qwen2's biases, Qwen3's q/k norm, partial rotary, float32 and
each packed block format), rows of different lengths across block boundaries; and the calls it
must leave to the modular path (hooks, a sliding window, autograd, training).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlens.model import SamplingParams, fused_decode, generate_tokens
from attnlens.model import hooks as model_hooks
from attnlens.model.config import ModelConfig
from attnlens.model.families.decoder import Transformer
from attnlens.model.fused_decode import FusedDecode, forget, modular_decode
from attnlens.model.native import library as native
from attnlens.model.packed.loading import pack_model

pytestmark = pytest.mark.skipif(not native.available()[0], reason=f"C kernels: {native.available()[1]}")

LLAMA = dict(vocab_size=97, context_length=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96,
             positional="rotary", activation="silu", bias=False, norm_type="rmsnorm", ffn="gated",
             tie_embeddings=False, layer_norm_eps=1e-6)
VARIANTS = {
    "llama-gqa": {},
    "multi-head": {"n_kv_heads": None},
    "qwen2-biases": {"qkv_bias": True},
    "qwen3-qk-norm": {"qk_norm": True, "head_dim": 32},
    "partial-rotary": {"rotary_pct": 0.5},
    "every-bias": {"bias": True, "norm_type": "rmsnorm"},
}
LOGIT_BOUND = 1e-4  # float32 sums in another order (the few-row products); measured ~1e-6 here
MAP_BOUND = 1e-6


def model_of(overrides: dict, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    net = Transformer(ModelConfig(**{**LLAMA, **overrides})).eval()
    with torch.no_grad():  # norms away from 1, so a wrong weight would show
        for name, p in net.named_parameters():
            if "ln" in name or "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return net


def packed(net: Transformer, fmt: str) -> Transformer:
    """`net` with every block's products in block format `fmt` (quantized by gguf)."""
    gguf = pytest.importorskip("gguf")
    qt = gguf.GGMLQuantizationType[fmt]
    state = {}
    for name, module in net.named_modules():
        if name.startswith("blocks.") and isinstance(module, torch.nn.Linear):
            blocks = gguf.quants.quantize(module.weight.detach().numpy().astype(np.float32), qt)
            state[f"{name}.weight"] = (torch.from_numpy(np.ascontiguousarray(blocks)), fmt)
    pack_model(net, state, tied=False)
    return net


class Spy:
    """Counts FusedDecode.run calls."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = FusedDecode.run

        def run(plan, *args, **kwargs):
            self.calls += 1
            return real(plan, *args, **kwargs)

        monkeypatch.setattr(FusedDecode, "run", run)


def decode(net: Transformer, steps: int = 6, maps_at: tuple[int, ...] = (1, 4)):
    """Two rows prefilled to 9 and 70 positions (the second across a 64-position block), then `steps`
    decode steps of both: every step's logits, the maps asked for, and the cache's keys at the end."""
    cache = net.new_kv_cache(3, paged=True)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        net(torch.randint(0, 97, (1, 9), generator=g), kv_cache=cache, rows=slice(0, 1))
        net(torch.randint(0, 97, (1, 70), generator=g), kv_cache=cache, rows=slice(1, 2))
        ids, logits, maps = torch.tensor([[3], [5]]), [], []
        for step in range(steps):
            out = net(ids, kv_cache=cache, rows=slice(0, 2), return_attention=step in maps_at)
            logits.append(out.logits)
            if out.attentions is not None:
                maps.append(out.attentions)
            ids = out.logits[:, -1:].argmax(-1)
    keys = [cache._gathered(cache.keys[i], cache.begin(slice(0, 2), 2, 0)) for i in range(net.config.n_layers)]
    return logits, maps, keys


def assert_same(fused, modular):
    (lf, mf, kf), (lm, mm, km) = fused, modular
    for a, b in zip(lf, lm):
        assert (a - b).abs().max().item() <= LOGIT_BOUND * max(1.0, b.abs().max().item())
    assert len(mf) == len(mm) == 2
    for step_f, step_m in zip(mf, mm):
        for a, b in zip(step_f, step_m):
            assert a.shape == b.shape
            assert (a - b).abs().max().item() <= MAP_BOUND
    for a, b in zip(kf, km):
        assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_steps_are_the_modular_ones(variant, monkeypatch):
    net = model_of(VARIANTS[variant])
    with modular_decode():
        modular = decode(net)
    spy = Spy(monkeypatch)
    fused = decode(net)
    assert spy.calls == 6  # every decode step fused, none of the prefills
    assert_same(fused, modular)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-biases"])
def test_fused_steps_with_packed_weights_are_the_modular_ones(fmt, variant, monkeypatch):
    net = packed(model_of(VARIANTS[variant]), fmt)
    with modular_decode():
        modular = decode(net)
    spy = Spy(monkeypatch)
    fused = decode(net)
    assert spy.calls == 6
    assert_same(fused, modular)


def test_greedy_text_is_the_same_fused_or_not():
    net = model_of({})
    prompt = [1, 5, 9, 22, 40]
    with modular_decode():
        want = [t.id for t in generate_tokens(net, prompt, 40, SamplingParams(temperature=0.0))]
    assert [t.id for t in generate_tokens(net, prompt, 40, SamplingParams(temperature=0.0))] == want


def test_hooks_a_window_autograd_or_training_take_the_modular_path(monkeypatch):
    spy = Spy(monkeypatch)
    net = model_of({})
    cache = net.new_kv_cache(1, paged=True)
    with torch.inference_mode():
        net(torch.tensor([[1, 2, 3]]), kv_cache=cache, rows=slice(0, 1))
        hooks = model_hooks.Hooks(record={"blocks.0.hook_resid_post"})
        with model_hooks.hooked(net, hooks):
            net(torch.tensor([[4]]), kv_cache=cache, rows=slice(0, 1))
        assert spy.calls == 0 and hooks.captured["blocks.0.hook_resid_post"].shape == (1, 1, 64)
        net(torch.tensor([[5]]), kv_cache=cache, rows=slice(0, 1))
        assert spy.calls == 1
    with torch.no_grad():
        net.train()
        net(torch.tensor([[6]]), kv_cache=cache, rows=slice(0, 1))
        net.eval()
    net(torch.tensor([[7]]), kv_cache=cache, rows=slice(0, 1))  # autograd on
    assert spy.calls == 1

    windowed = model_of({"sliding_window": 8})
    cache = windowed.new_kv_cache(1, paged=True)
    with torch.inference_mode():
        windowed(torch.tensor([[1, 2, 3]]), kv_cache=cache, rows=slice(0, 1))
        windowed(torch.tensor([[4]]), kv_cache=cache, rows=slice(0, 1))  # 4 keys: the window is all of them
        assert spy.calls == 2
        windowed(torch.randint(0, 97, (1, 10)), kv_cache=cache, rows=slice(0, 1))
        windowed(torch.tensor([[4]]), kv_cache=cache, rows=slice(0, 1))  # 15 keys, 8 seen: the mask narrows
        assert spy.calls == 2


def test_models_the_step_does_not_compute_are_left_alone():
    for overrides in ({"norm_type": "layernorm"}, {"ffn": "plain"}, {"activation": "gelu"},
                      {"parallel_residual": True}, {"norm": "post"}):
        assert FusedDecode.build(model_of(overrides)) is None, overrides
    assert FusedDecode.build(model_of({})) is not None


def test_weights_moved_after_the_first_step_are_followed(monkeypatch):
    net = model_of({})
    decode(net, steps=1, maps_at=())
    net.double().float()  # new storage for every parameter
    with torch.no_grad():
        net.blocks[1].ffn.proj.weight.mul_(3.0)  # and a change in place
    with modular_decode():
        modular = decode(net)
    spy = Spy(monkeypatch)
    assert_same(decode(net), modular)
    assert spy.calls == 6
    net.blocks[0].ln2.weight = torch.nn.Parameter(torch.full((64,), 0.7))  # another Parameter object
    forget(net)
    with modular_decode():
        modular = decode(net)
    assert_same(decode(net), modular)


@pytest.mark.slow
def test_smollm2_greedy_text_and_maps_fused_or_not(smollm2):
    net, tok = smollm2.model, smollm2.tokenizer
    prompt = tok.encode("The capital of France is Paris. The capital of Germany is")
    with modular_decode():
        want = [t.id for t in generate_tokens(net, prompt, 32, SamplingParams(temperature=0.0))]
    assert [t.id for t in generate_tokens(net, prompt, 32, SamplingParams(temperature=0.0))] == want


def test_two_threads_decoding_one_model_each_get_their_own_answer():
    """Each call points the shared layer descriptions at its own cache: one call at a time."""
    import threading

    net = model_of({})
    want = decode(net, maps_at=(1, 2))
    results: list = []

    def run():
        results.append(decode(net, maps_at=(1, 2)))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for got in results:
        for a, b in zip(got[0], want[0]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [2, 40])
@pytest.mark.parametrize("fmt", [None, "Q4_0", "Q4_1", "Q8_0"])
def test_a_rows_decode_step_is_the_same_bits_alone_or_batched(fmt, rows, monkeypatch):
    """Rows decoded in one fused step (up to MAX_ROWS) get exactly the logits each gets decoded alone
    (float32: the one-row kernel and the few-row tiles sum each pair in one order; packed: each
    block widened to float32 and summed the same way): a stream's tokens do not depend on the
    streams beside it in a step. The head here is float32 (from 9 rows oneDNN's product in the
    service): this test gives it our few-row kernel at every row count."""
    from attnlens.model.parts import linear

    monkeypatch.setattr(linear, "FEW_ROWS", fused_decode.MAX_ROWS)
    monkeypatch.setattr(linear, "ONEDNN_MIN_ROWS", fused_decode.MAX_ROWS + 1)
    net = model_of({}) if fmt is None else packed(model_of({}), fmt)
    caches = [net.new_kv_cache(rows, paged=True) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (1, int(n)), generator=g) for n in torch.randint(1, 80, (rows,), generator=g)]
    with torch.inference_mode():
        for cache in caches:
            for row, prompt in enumerate(prompts):
                net(prompt, kv_cache=cache, rows=slice(row, row + 1))
        ids = torch.randint(0, 97, (rows, 1), generator=g)
        for _ in range(3):
            batched = net(ids, kv_cache=caches[0], rows=slice(0, rows)).logits
            alone = torch.cat([net(ids[r:r + 1], kv_cache=caches[1], rows=slice(r, r + 1)).logits
                               for r in range(rows)])
            assert torch.equal(batched, alone)
            ids = batched[:, -1:].argmax(-1)

"""Direct logit attribution (model/analysis/logit_attribution.py) and a head's score split into pairs of
parts (score_decomposition.py): on every decoder shape (GPT-2, Llama, Qwen2, Qwen3, Mistral, GPT-NeoX,
sinusoidal positions, the bundled decoder) the parts sum to the model's logit difference and to its
score within 1e-4; the heads' direct effects equal TransformerLens's on a GPT-2 with the same weights;
a part that writes nothing gets nothing; SmolLM2's name movers (slow)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from helpers import sharp_checkpoint, small_config_model

from attnlens.model import ModelConfig, load_checkpoint
from attnlens.model.analysis.explain import explain_head
from attnlens.model.analysis.logit_attribution import logit_attribution
from attnlens.model.analysis.operations import LogitAttributionCall, ScoreDecompositionCall, run_operation
from attnlens.model.analysis.score_decomposition import decompose_score

ROTARY = dict(positional="rotary", norm_type="rmsnorm", ffn="gated", activation="silu", bias=False)
SHAPES = {
    "gpt2": {},
    "llama": dict(ROTARY, n_kv_heads=2, tie_embeddings=False),
    "qwen2": dict(ROTARY, qkv_bias=True, n_kv_heads=1),
    "qwen3": dict(ROTARY, n_kv_heads=2, qk_norm=True, head_dim=16),
    "mistral": dict(ROTARY, n_kv_heads=2, sliding_window=4),
    "neox": dict(positional="rotary", rotary_pct=0.25, parallel_residual=True, activation="gelu_exact", head_dim=16),
    "sinusoidal": dict(positional="sinusoidal", scale_embeddings=True),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request):
    """A small random decoder of each shape, its weights moved off the init (biases and norms too)."""
    model = small_config_model(seed=3, n_layers=3, **SHAPES[request.param])
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    ids = torch.randint(0, model.config.vocab_size, (12,), generator=g).tolist()
    return request.param, model, ids


def dla_total(r) -> float:
    return sum(map(sum, r["heads"])) + sum(r["mlps"]) + r["embedding"] + r["other"]


def test_the_parts_sum_to_the_models_logit_difference(shaped):
    name, model, ids = shaped
    with torch.no_grad():
        logits = model(torch.tensor([ids[:10]])).logits[0, -1]
    r = logit_attribution(model, ids, 5, 6, position=9)
    assert r["logit_difference"] == pytest.approx(float(logits[5] - logits[6]), abs=1e-5)
    assert dla_total(r) == pytest.approx(r["logit_difference"], abs=1e-4)
    assert r["other"] == pytest.approx(sum(r["other_parts"].values()))
    assert np.array(r["heads"]).shape == (3, 4) and len(r["mlps"]) == 3
    assert np.std(r["heads"]) > 1e-3
    if name != "sinusoidal" and model.config.positional == "rotary":
        assert r["other_parts"]["positions"] == 0.0
    default = logit_attribution(model, ids, position=9)
    assert [default["answer_id"], default["foil_id"]] == torch.topk(logits, 2).indices.tolist()
    assert default["logit_difference"] > 0


def test_a_head_that_writes_nothing_gets_nothing(shaped):
    """Head 2 of block 1 with its output projection zeroed: its direct effect and its rows and columns of
    every later score are exactly 0, the rest still summing to the totals."""
    _, model, ids = shaped
    import copy

    silent = copy.deepcopy(model)
    D = model.config.d_head
    with torch.no_grad():
        silent.blocks[1].attn.proj.weight[:, 2 * D:3 * D] = 0
    r = logit_attribution(silent, ids, 5, 6)
    assert r["heads"][1][2] == 0.0
    assert dla_total(r) == pytest.approx(r["logit_difference"], abs=1e-4)
    s = decompose_score(silent, ids, 2, 1, 10, 4)
    i = s["parts"].index("L1H2")
    assert not s["matrix"][i].any() and not s["matrix"][:, i].any()
    assert s["matrix"].sum() == pytest.approx(s["score"], abs=1e-4)


@pytest.mark.parametrize("layer, head, query, key", [(0, 1, 9, 3), (1, 3, 11, 11), (2, 0, 10, 0), (2, 2, 7, 6)])
def test_the_pairs_sum_to_the_heads_score(shaped, layer, head, query, key):
    name, model, ids = shaped
    s = decompose_score(model, ids, layer, head, query, key, top_k=7)
    step = explain_head(model, ids, None, "self", layer, head, query, ())  # the explain view's own q . k
    assert s["score"] == pytest.approx(step["scaled"][key], abs=1e-5)
    assert s["probability"] == pytest.approx(step["pattern_row"][key], abs=1e-6)
    assert s["matrix"].sum() == pytest.approx(s["score"], abs=1e-4)
    P = len(s["parts"])
    assert s["matrix"].shape == (P, P) and P == 2 + (name in ("gpt2", "sinusoidal")) + layer * 5
    assert s["parts"][0] == "embedding" and s["parts"][-1] == "biases"
    np.testing.assert_allclose(s["query_totals"], s["matrix"].sum(axis=1))
    magnitudes = [abs(p["value"]) for p in s["top"]]
    assert magnitudes == sorted(magnitudes, reverse=True) and len(magnitudes) == min(7, P * P)
    assert magnitudes[0] == pytest.approx(np.abs(s["matrix"]).max())
    assert s["rest"] + sum(p["value"] for p in s["top"]) == pytest.approx(s["score"])
    assert s["masked"] == (name == "mistral" and key <= query - 4)
    assert s["kv_head"] == head // (model.config.n_heads // model.config.kv_heads)


def test_the_bundled_decoder(default_checkpoint):
    ck = load_checkpoint(default_checkpoint)
    ids = ck.tokenizer.encode("To be, or not to be, that is the question")
    r = logit_attribution(ck.model, ids)
    assert dla_total(r) == pytest.approx(r["logit_difference"], abs=1e-4)
    s = decompose_score(ck.model, ids, 3, 5, len(ids) - 1, 2)
    assert s["matrix"].sum() == pytest.approx(s["score"], abs=1e-4)


def test_heads_equal_transformer_lens_direct_logit_attribution(tmp_path):
    """TransformerLens's DLA by head on the bridge over our export (compatibility mode: the norms
    folded, value biases into the output bias), and its components."""
    pytest.importorskip("transformer_lens.tools.analysis.direct_logit_attribution")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.tools.analysis.direct_logit_attribution import direct_logit_attribution

    from attnlens.model.interop.hf import export_hf

    ours = sharp_checkpoint(tmp_path, seed=5, context_length=64)
    bridge = TransformerBridge.boot_transformers(str(export_hf(ours, tmp_path / "gpt2")), device="cpu")
    bridge.enable_compatibility_mode()
    model = load_checkpoint(ours).model
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    mine = logit_attribution(model, ids[0].tolist(), 3, 4)
    with torch.no_grad():
        heads = direct_logit_attribution(bridge, ids, 3, 4, unit="head").attribution[:, 0]
        parts = direct_logit_attribution(bridge, ids, 3, 4, unit="component").attribution[:, 0]
    torch.testing.assert_close(torch.tensor(mine["heads"]).flatten().float(), heads[:-1], atol=1e-5, rtol=0)
    # embed, pos_embed, 0_attn_out, 0_mlp_out, 1_attn_out, 1_mlp_out (their bias b_U: the final norm's bias)
    want = [mine["embedding"], mine["other_parts"]["positions"], mine["mlps"][0], mine["mlps"][1]]
    torch.testing.assert_close(torch.tensor(want).float(), parts[[0, 1, 3, 5]], atol=1e-5, rtol=0)
    rest = mine["logit_difference"] - mine["other_parts"]["final_norm_bias"]
    assert float(parts.sum()) == pytest.approx(rest, abs=1e-4)


def test_the_calls_run_by_name_and_are_checked_naming_the_field():
    model = small_config_model(seed=1, **SHAPES["llama"])
    ids = list(range(5, 15))
    call = pickle.loads(pickle.dumps(LogitAttributionCall(ids, position=6)))
    assert run_operation(model, call) == logit_attribution(model, ids, position=6)
    call = pickle.loads(pickle.dumps(ScoreDecompositionCall(ids, 1, 2, 8, 3, top_k=4)))
    got, want = run_operation(model, call), decompose_score(model, ids, 1, 2, 8, 3, top_k=4)
    np.testing.assert_array_equal(got.pop("matrix"), want.pop("matrix"))
    assert got == want
    bad = [(ScoreDecompositionCall(ids, 1, 2, 5, 6), "key 6 out of range 0..5"),
           (ScoreDecompositionCall(ids, 2, 0, 5, 1), "layer 2 out of range 0..1"),
           (ScoreDecompositionCall(ids, 0, 4, 5, 1), "head 4 out of range 0..3"),
           (ScoreDecompositionCall(ids, 0, 0, 10, 1), "query 10 out of range 0..9"),
           (LogitAttributionCall(ids, position=10), "position 10 out of range 0..9"),
           (LogitAttributionCall(ids, foil_id=97), "foil_id 97")]
    for call, words in bad:
        with pytest.raises(ValueError, match=words):
            call.check(model.config)
        with pytest.raises(ValueError, match=words):
            run_operation(model, call)
    post = ModelConfig(norm="post")
    for call in (LogitAttributionCall(ids), ScoreDecompositionCall(ids, 0, 0, 5, 1)):
        with pytest.raises(ValueError, match="pre-norm decoder"):
            call.check(post)
        with pytest.raises(ValueError, match="pre-norm"):
            run_operation(small_config_model(norm="post"), call)
    with pytest.raises(ValueError, match="pre-norm decoder"):
        LogitAttributionCall(ids).check(ModelConfig(family="encoder", norm="post"))


@pytest.mark.slow
def test_smollm2_name_movers_write_the_answer(smollm2):
    """On the IOI prompt, L23H3 writes ' Mary' - ' John' most directly (2.9 of 6.1) while it attends from
    the last position to the repeated ' John' (position 9: it suppresses that name), and that score
    splits into pairs that sum to it."""
    model, tok = smollm2.model, smollm2.tokenizer
    ids = tok.encode("When Mary and John went to the store, John gave a drink to")
    answer, foil = tok.encode(" Mary")[0], tok.encode(" John")[0]
    r = logit_attribution(model, ids, answer, foil)
    assert r["logit_difference"] == pytest.approx(6.12, abs=0.02)
    assert dla_total(r) == pytest.approx(r["logit_difference"], abs=1e-4)
    heads = np.array(r["heads"])
    assert divmod(int(heads.argmax()), model.config.n_heads) == (23, 3) and heads[23, 3] > 2
    s = decompose_score(model, ids, 23, 3, len(ids) - 1, 9)
    assert s["matrix"].sum() == pytest.approx(s["score"], abs=1e-4)
    assert s["probability"] > 0.5

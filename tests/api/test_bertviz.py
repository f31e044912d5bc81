"""Attention.to_bertviz(): what bertviz's head_view and model_view take, with the layers and heads
of a subset labelled by their own numbers. bertviz renders it (html_action="return") and the
parameters it writes into its page are checked against the maps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnlens import Attention, Token
from attnlens.answers import GroupSpec

bertviz = pytest.importorskip("bertviz")


def rendered_params(html) -> dict:
    """The parameters bertviz wrote into its page's script (`const params = {...};`)."""
    text = html.data
    start = text.index("const params = ") + len("const params = ")
    params, _ = json.JSONDecoder().raw_decode(text[start:])
    return params


def stochastic(shape, rng, causal=False) -> np.ndarray:
    a = rng.random(shape, dtype=np.float32)
    if causal:
        a = np.tril(a)
    return a / a.sum(-1, keepdims=True)


def decoder_answer(layers, heads, n_layers=4, n_heads=3, T=5, seed=0) -> Attention:
    rng = np.random.default_rng(seed)
    tokens = [Token(i, t) for i, t in enumerate(["To", " be", ",", " or", " not"][:T])]
    return Attention.from_arrays(model="m", family="decoder", direction="causal", tokens=tokens, n_layers=n_layers,
                                 n_heads=n_heads, layers=layers, heads=heads, format="json",
                                 specs=[GroupSpec("self", "tokens", "tokens", True)],
                                 maps={"self": stochastic((len(layers), len(heads), T, T), rng, causal=True)})


def test_a_full_answer_renders_in_head_view_and_model_view():
    a = decoder_answer([0, 1, 2, 3], [0, 1, 2])
    params = rendered_params(bertviz.head_view(**a.to_bertviz(), html_action="return"))
    assert params["include_layers"] == [0, 1, 2, 3] and params["heads"] is None
    attn = np.array(params["attention"][0]["attn"])
    np.testing.assert_allclose(attn, a.maps, atol=1e-7)
    assert params["attention"][0]["left_text"] == ["To", " be", ",", " or", " not"]
    params = rendered_params(bertviz.model_view(**a.to_bertviz("model"), html_action="return"))
    assert params["include_heads"] == [0, 1, 2] and params["total_heads"] == 3
    np.testing.assert_allclose(np.array(params["attention"][0]["attn"]), a.maps, atol=1e-7)


def test_a_subset_keeps_its_own_layer_and_head_numbers():
    a = decoder_answer([1, 3], [0, 2])
    head = rendered_params(bertviz.head_view(**a.to_bertviz(), html_action="return"))
    # head_view lists layers 1 and 3 by their numbers, shows every head, starts with the held ones
    assert head["include_layers"] == [1, 3] and head["heads"] == [0, 2]
    attn = np.array(head["attention"][0]["attn"])  # (2 layers, 3 heads, T, T)
    assert attn.shape == (2, 3, 5, 5)
    np.testing.assert_allclose(attn[:, [0, 2]], a.maps, atol=1e-7)
    assert not attn[:, 1].any()  # head 1 is not in the answer
    model = rendered_params(bertviz.model_view(**a.to_bertviz("model"), html_action="return"))
    assert model["include_layers"] == [1, 3] and model["include_heads"] == [0, 2] and model["total_heads"] == 3
    np.testing.assert_allclose(np.array(model["attention"][0]["attn"]), a.maps, atol=1e-7)  # layer 1 head 0 first
    assert head["layer"] is None  # bertviz opens on the first included layer, 1
    bertviz.head_view(**a.to_bertviz(), layer=3, html_action="return")  # layer 3 is there
    with pytest.raises(ValueError, match="not in include_layers"):
        bertviz.head_view(**a.to_bertviz(), layer=0, html_action="return")


def test_the_translator_gives_bertviz_its_three_groups():
    rng = np.random.default_rng(1)
    S, T = 3, 4
    source = [Token(i, t) for i, t in enumerate(["ninety", "-", "seven"])]
    target = [Token(0, "<|endoftext|>"), Token(5, "quatre"), Token(6, "-vingt"), Token(7, "-dix-sept")]
    a = Attention.from_arrays(model="translator", family="encoder-decoder", direction="encoder-decoder",
                              tokens=source, n_layers=3, n_heads=4, layers=[2], heads=[1, 3], format="f16",
                              specs=[GroupSpec("encoder", "source", "source", False),
                                     GroupSpec("decoder", "target", "target", True),
                                     GroupSpec("cross", "target", "source", False)],
                              maps={"encoder": stochastic((1, 2, S, S), rng),
                                    "decoder": stochastic((1, 2, T, T), rng, causal=True),
                                    "cross": stochastic((1, 2, T, S), rng)}, target_tokens=target, generated=True)
    params = rendered_params(bertviz.head_view(**a.to_bertviz(), html_action="return"))
    groups = {d["name"]: d for d in params["attention"]}
    assert list(groups) == ["Encoder", "Decoder", "Cross"] and params["include_layers"] == [2]
    for name, group in (("Encoder", a.encoder), ("Decoder", a.decoder), ("Cross", a.cross)):
        attn = np.array(groups[name]["attn"])  # (1 layer, 4 heads, rows, cols)
        np.testing.assert_allclose(attn[:, [1, 3]], group.maps, atol=1e-7)
    assert groups["Cross"]["left_text"] == [t.text for t in target]
    assert groups["Cross"]["right_text"] == ["ninety", "-", "seven"]
    model = rendered_params(bertviz.model_view(**a.to_bertviz("model"), html_action="return"))
    assert model["include_heads"] == [1, 3]
    np.testing.assert_allclose(np.array([d["attn"] for d in model["attention"]][2]), a.cross.maps, atol=1e-7)


def test_only_bertviz_views_are_offered():
    with pytest.raises(ValueError, match="head_view and model_view"):
        decoder_answer([0], [0]).to_bertviz("neuron")

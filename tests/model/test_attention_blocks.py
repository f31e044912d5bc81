"""Maps made in blocks of query rows and reduced at once (model/analysis/attention_maps.py), against the
full maps of the family's explicit forward (`analyse`), reduced here the plain way: every family
and group (decoder plain, rotary, sliding window, grouped-query, q/k norm; encoder; translator's
encoder, decoder and cross, with and without q/k norm), odd lengths, bins that do not divide T,
windows, ablation, blocks of a few rows."""

from __future__ import annotations

import pytest
import torch

from attnlens.model import ModelConfig
from attnlens.model.analysis.attention_maps import Pool, TopK, Window, bin_edges, blocked_maps
from attnlens.model.families import FAMILY_CLASSES, family_of
from attnlens.model.hooks import Hooks, ZEdit, hooked

BASE = dict(vocab_size=64, context_length=48, d_model=32, n_layers=3, n_heads=4, d_ff=32)
MODELS = {  # name -> (family, config extras)
    "decoder": ("decoder", {}),
    "rotary": ("decoder", dict(positional="rotary")),
    "sliding_window": ("decoder", dict(positional="rotary", sliding_window=5)),
    "grouped_query": ("decoder", dict(positional="rotary", n_kv_heads=2)),
    "encoder": ("encoder", dict(labels=["a", "b"])),
    "translator": ("encoder-decoder", {}),
    # the per-head q/k norm (Qwen3's): the blocks' q and k must be the normalised ones
    "qk_norm": ("decoder", dict(positional="rotary", n_kv_heads=2, qk_norm=True)),
    "translator_qk_norm": ("encoder-decoder", dict(qk_norm=True)),
}
LAYERS, HEADS = [2, 0], [3, 1]
TINY_BLOCKS = 4 * 2 * 48 * 3  # three rows of two heads' scores over 48 keys: many blocks per map


def build(name: str) -> torch.nn.Module:
    family, extra = MODELS[name]
    torch.manual_seed(0)
    return FAMILY_CLASSES[family](ModelConfig(family=family, **BASE, **extra)).eval()


def sequence(model) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 64, (37,), generator=g).tolist()  # odd T
    target = torch.randint(4, 64, (22,), generator=g).tolist() if family_of(model).takes_target else None
    return model.sequence(ids, target)[0]


def full_maps(model, tokens, ablate=()) -> dict[str, torch.Tensor]:
    family = family_of(model)
    target = tokens["target"][1:] if family.takes_target else None
    with hooked(model, Hooks(ablate=ablate) if ablate else None):
        maps = model.analyse(tokens[family.primary.queries], target).maps
    return {name: m[LAYERS][:, HEADS] for name, m in maps.items()}  # (L', H', Q, K)


def pooled(maps: torch.Tensor, row_edges: list[int], col_edges: list[int]) -> torch.Tensor:
    """The definition: cell (i, j) = mean over row bin i's queries of their summed weight on bin j's keys."""
    out = torch.zeros(*maps.shape[:2], len(row_edges) - 1, len(col_edges) - 1)
    for i in range(len(row_edges) - 1):
        for j in range(len(col_edges) - 1):
            cell = maps[..., row_edges[i]:row_edges[i + 1], col_edges[j]:col_edges[j + 1]]
            out[..., i, j] = cell.sum(-1).mean(-1)
    return out


def run(model, tokens, make, **kw) -> dict:
    family = family_of(model)
    reductions = {g.name: make(len(tokens[g.queries]), len(tokens[g.keys])) for g in family.groups}
    blocked_maps(model, tokens, LAYERS, HEADS, reductions, block_bytes=TINY_BLOCKS, **kw)
    return {name: r.result() for name, r in reductions.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_whole_maps_and_windows_equal_the_full_maps(name):
    model = build(name)
    tokens = sequence(model)
    full = full_maps(model, tokens)
    whole = run(model, tokens, lambda Q, K: Window(2, 2, (0, Q), (0, K)))
    windows = run(model, tokens, lambda Q, K: Window(2, 2, (min(3, Q), min(20, Q)), (min(2, K), min(13, K))))
    for g, maps in full.items():
        torch.testing.assert_close(whole[g]["maps"], maps, atol=1e-6, rtol=0)
        a, b = min(3, maps.shape[2]), min(20, maps.shape[2])
        torch.testing.assert_close(windows[g]["maps"], maps[..., a:b, 2:13], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("bins", [5, 16, 64])
def test_pooled_maps_equal_the_full_maps_pooled(name, bins):
    model = build(name)
    tokens = sequence(model)
    full = full_maps(model, tokens)
    grids = run(model, tokens, lambda Q, K: Pool(2, 2, (0, Q), (0, K), bins))
    for g, maps in full.items():
        Q, K = maps.shape[2:]
        result = grids[g]
        assert result["row_edges"] == bin_edges(Q, bins) and result["col_edges"] == bin_edges(K, bins)
        assert len(result["row_edges"]) == min(bins, Q) + 1  # never more bins than positions
        torch.testing.assert_close(result["maps"], pooled(maps, result["row_edges"], result["col_edges"]),
                                   atol=1e-6, rtol=0)
        torch.testing.assert_close(result["maps"].sum(-1), torch.ones(result["maps"].shape[:-1]))  # rows sum to 1
        if model.family.group(g).causal:  # the upper cells no query of the bin sees are exactly 0
            n = result["maps"].shape[-1]
            assert (result["maps"][..., torch.triu(torch.ones(n, n, dtype=torch.bool), 1)] == 0).all()


def test_a_pooled_window_pools_the_window():
    model = build("rotary")
    tokens = sequence(model)
    maps = full_maps(model, tokens)["self"]
    result = run(model, tokens, lambda Q, K: Pool(2, 2, (10, 31), (4, 29), 6))["self"]
    assert result["row_edges"][0] == 10 and result["row_edges"][-1] == 31 and result["col_edges"][-1] == 29
    torch.testing.assert_close(result["maps"], pooled(maps, result["row_edges"], result["col_edges"]),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_top_k_is_each_rows_heaviest_keys_in_order(name):
    model = build(name)
    tokens = sequence(model)
    full = full_maps(model, tokens)
    tops = run(model, tokens, lambda Q, K: TopK(2, 2, (0, Q), (0, K), 6))
    for g, maps in full.items():
        weights, positions = tops[g]["maps"], tops[g]["positions"]
        expected, index = maps.topk(min(6, maps.shape[-1]), dim=-1)
        torch.testing.assert_close(weights[..., :expected.shape[-1]], expected, atol=1e-6, rtol=0)
        real = expected > 0
        assert (positions[..., :expected.shape[-1]][real] == index[real]).all()
        assert (positions[..., :expected.shape[-1]][~real] == -1).all()  # a causal row's first rows have few keys
        assert (weights[..., :-1] >= weights[..., 1:]).all()  # heaviest first
        got = torch.gather(maps, -1, positions.clamp(min=0).long())  # each weight is its position's
        torch.testing.assert_close(torch.where(positions >= 0, got, 0), weights, atol=1e-6, rtol=0)


def test_top_k_within_a_column_window():
    model = build("decoder")
    tokens = sequence(model)
    maps = full_maps(model, tokens)["self"]
    result = run(model, tokens, lambda Q, K: TopK(2, 2, (20, 37), (5, 15), 3))["self"]
    expected, index = maps[..., 20:37, 5:15].topk(3, dim=-1)
    torch.testing.assert_close(result["maps"], expected, atol=1e-6, rtol=0)
    assert (result["positions"] == index + 5).all()


@pytest.mark.parametrize("name", ["grouped_query", "translator"])
def test_ablated_maps_are_the_ablated_models(name):
    model = build(name)
    family = family_of(model)
    tokens = sequence(model)
    edits = (ZEdit(family.group(family.ablation_group).hook.format(layer=0), 2, "zero"),)
    clean, ablated = full_maps(model, tokens), full_maps(model, tokens, edits)
    got = run(model, tokens, lambda Q, K: Window(2, 2, (0, Q), (0, K)), ablate=edits)
    changed = False
    for g in clean:
        torch.testing.assert_close(got[g]["maps"], ablated[g], atol=1e-6, rtol=0)
        changed |= not torch.allclose(ablated[g], clean[g])
    assert changed


def test_progress_after_each_attention_and_block_of_the_forward_and_each_block_of_rows():
    model = build("rotary")
    tokens = sequence(model)
    beats = []
    run(model, tokens, lambda Q, K: Window(2, 2, (0, Q), (0, K)), progress=lambda: beats.append(1))
    rows_per_block = TINY_BLOCKS // (4 * 2 * 37)
    blocks = -(-37 // rows_per_block)
    assert len(beats) == 3 * 2 + 2 * blocks  # 3 blocks, each after its attention and at its end


def test_under_a_callers_hooks_the_full_maps_are_reduced():
    """A caller's own hooks (which this path's would replace) still see their forward, and the
    answer is the same."""
    model = build("rotary")
    tokens = sequence(model)
    expected = run(model, tokens, lambda Q, K: Pool(2, 2, (0, Q), (0, K), 7))["self"]["maps"]
    with hooked(model, Hooks(record={"blocks.1.hook_resid_post"})) as hooks:
        got = run(model, tokens, lambda Q, K: Pool(2, 2, (0, Q), (0, K), 7))["self"]["maps"]
    assert "blocks.1.hook_resid_post" in hooks.captured
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("store", [torch.float16, torch.uint8])
def test_whole_maps_kept_in_the_wires_type(store):
    model = build("decoder")
    tokens = sequence(model)
    maps = full_maps(model, tokens)["self"]
    got = run(model, tokens, lambda Q, K: Window(2, 2, (0, Q), (0, K), store, 1 / 255))["self"]["maps"]
    assert got.dtype == store
    if store == torch.uint8:
        assert (got.float() - maps * 255).abs().max() <= 0.5 + 1e-4
    else:
        torch.testing.assert_close(got.float(), maps, atol=2.5e-4, rtol=0)


def test_a_layer_kept_needs_no_forward_for_another_window():
    """KeptQK: the queries and keys of an analysed layer make another window (a zoom) without a
    forward, equal to a fresh one; another sequence or an ablation runs one; the oldest go first."""
    from attnlens.model.analysis.attention_maps import KeptQK

    model = build("grouped_query")
    tokens = sequence(model)
    forwards = []
    real = model.run_sequence
    model.run_sequence = lambda t: (forwards.append(1), real(t))
    kept = KeptQK(10**8)
    run(model, tokens, lambda Q, K: Pool(2, 2, (0, Q), (0, K), 4), kept=kept)
    assert len(forwards) == 1 and len(kept) == 2
    zoomed = run(model, tokens, lambda Q, K: Window(2, 2, (10, 20), (3, 15)), kept=kept)["self"]["maps"]
    assert len(forwards) == 1  # made from the kept queries and keys
    torch.testing.assert_close(zoomed, full_maps(model, tokens)["self"][..., 10:20, 3:15], atol=1e-6, rtol=0)
    edits = (ZEdit("blocks.0.attn", 1, "zero"),)
    ablated = run(model, tokens, lambda Q, K: Window(2, 2, (0, Q), (0, K)), kept=kept, ablate=edits)["self"]["maps"]
    assert len(forwards) == 2  # an ablated run is another sequence's
    torch.testing.assert_close(ablated, full_maps(model, tokens, edits)["self"], atol=1e-6, rtol=0)
    small = KeptQK(kept.bytes // 4 * 3)  # room for three of the four pairs
    for key in range(4):
        small.put(key, torch.ones(37, 4, 8), torch.ones(37, 2, 8))
    assert small.get(0) is None and small.get(3) is not None and len(small) == 3

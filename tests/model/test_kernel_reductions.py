"""Attention maps reduced inside the forward's C kernel (causal_attention_reduced through
model/parts/causal_attention.py's Emit): each row's bin sums, top k and a window, against today's
blocked reductions (Pool, TopK, Window by reduce_layer) and a float64 recompute, at odd sizes
(T not a multiple of 64, a later piece S > T, grouped-query heads, bins that do not divide the
columns); then blocked_maps end to end on a tiny Llama-shaped model, fused against recomputed."""

from __future__ import annotations

import pytest
import torch
from helpers import small_config_model

from attnlens.model.analysis import attention_maps as ab
from attnlens.model.analysis.attention_maps import (
    KeptQK,
    MapRequest,
    Pool,
    TopK,
    Window,
    analyse_attention,
    blocked_maps,
    reduce_layer,
)
from attnlens.model.hooks import ZEdit
from attnlens.model.native import library as native
from attnlens.model.parts import causal_attention as ca

pytestmark = pytest.mark.skipif(not native.available()[0], reason=f"no C kernels here: {native.available()[1]}")

# (H, K, T, S, D): SmolLM2's heads over several tiles; multi-head; a later piece after 20 cached
# positions; multi-query with D = 48; fewer queries than a tile
SHAPES = [(9, 3, 300, 300, 64), (4, 4, 129, 129, 32), (6, 2, 150, 170, 32), (3, 1, 130, 130, 48), (2, 2, 37, 37, 16)]
HEADS = {9: [8, 0, 4], 4: [1, 2], 6: [5, 0, 3], 3: [2], 2: [0, 1]}


def inputs(H, K, T, S, D, spread=2.0):
    torch.manual_seed(H * 1000 + T + S)
    q, k, v = torch.randn(1, H, T, D) * spread, torch.randn(1, K, S, D) * spread, torch.randn(1, K, S, D)
    return q, k, v, D ** -0.5


def exact(q, k, scale, heads):
    """float64 probabilities of the asked heads, (H', S, S): query rows as positions (the first
    S - T rows, before the piece, are left zero)."""
    H, K, T, S = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    kk = k.double().repeat_interleave(H // K, dim=1)[0, heads]  # (H', S, D)
    scores = (q.double()[0, heads] @ kk.transpose(-1, -2)) * scale  # (H', T, S)
    sees = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    probs = torch.zeros(len(heads), S, S, dtype=torch.float64)
    probs[:, S - T:] = scores.masked_fill(~sees, float("-inf")).softmax(-1)
    return probs


def fused(reduction, q, k, v, scale, heads):
    """The reduction's layer 0 made by the kernel; the attention's output too (B, H, T, D)."""
    emit = reduction.emit(0, heads)
    with torch.no_grad():
        y = ca.causal_attention(q, k, v, scale, emit)
    assert y is not None and emit.done
    reduction.take(0, emit)
    return reduction.result(), y


def blocked(reduction, q, k, scale, heads):
    """Today's path: reduce_layer from q (Q, H, D) and k (S, K, D), in blocks of a few rows."""
    H, K = q.shape[1], k.shape[1]
    reduce_layer(reduction, 0, q[0].transpose(0, 1), k[0].transpose(0, 1), heads, H // K, scale, True, None,
                 block_bytes=4 * len(heads) * k.shape[2] * 7)
    return reduction.result()


def pooled(probs, row_edges, col_edges):
    """The definition: cell (i, j) = mean over row bin i of the rows' summed weight on column bin j."""
    out = torch.zeros(probs.shape[0], len(row_edges) - 1, len(col_edges) - 1, dtype=torch.float64)
    for i in range(len(row_edges) - 1):
        for j in range(len(col_edges) - 1):
            out[:, i, j] = probs[:, row_edges[i]:row_edges[i + 1], col_edges[j]:col_edges[j + 1]].sum(-1).mean(-1)
    return out


def ties_in_order(weights, positions):
    """positions with equal weights in a row ordered earliest first (the kernel's order; torch.topk
    leaves the order of ties unspecified: here, weights rounded to float32's least subnormal)."""
    by_position = positions.where(positions >= 0, torch.iinfo(torch.int32).max).sort(dim=-1, stable=True)
    w = weights.gather(-1, by_position.indices)
    order = w.sort(dim=-1, descending=True, stable=True).indices
    return positions.gather(-1, by_position.indices.gather(-1, order))


def windows_of(T, S):
    """(rows, cols) windows, rows within the piece's positions S - T .. S: all; an odd middle."""
    a = S - T
    return [((a, S), (0, S)), ((a + 3, S - 5), (2, S - 11))]


@pytest.mark.parametrize("H,K,T,S,D", SHAPES)
@pytest.mark.parametrize("bins", [7, 64])
def test_bin_sums_pool_as_the_blocked_pool_and_float64(H, K, T, S, D, bins):
    q, k, v, scale = inputs(H, K, T, S, D)
    heads = HEADS[H]
    probs = exact(q, k, scale, heads)
    for rows, cols in windows_of(T, S):
        got, _ = fused(Pool(1, len(heads), rows, cols, bins), q, k, v, scale, heads)
        want = pooled(probs, got["row_edges"], got["col_edges"]).float()
        torch.testing.assert_close(got["maps"][0], want, atol=2e-6, rtol=0)
        if rows == (0, S) and cols[0] == 0:  # rows sum to 1; a causal grid's upper cells are exactly 0
            torch.testing.assert_close(got["maps"][0].sum(-1), torch.ones(got["maps"].shape[1:-1]))
            n = got["maps"].shape[-1]
            assert (got["maps"][0][:, torch.triu(torch.ones(n, n, dtype=torch.bool), 1)] == 0).all()
        if S == T:
            before = blocked(Pool(1, len(heads), rows, cols, bins), q, k, scale, heads)
            torch.testing.assert_close(got["maps"], before["maps"], atol=2e-6, rtol=0)


@pytest.mark.parametrize("H,K,T,S,D", SHAPES)
@pytest.mark.parametrize("top", [1, 8, 20])  # 20: over the vector width, the kernel's other way
def test_top_k_as_the_blocked_top_k_and_float64(H, K, T, S, D, top):
    q, k, v, scale = inputs(H, K, T, S, D)
    heads = HEADS[H]
    probs = exact(q, k, scale, heads)
    for rows, cols in windows_of(T, S):
        got, _ = fused(TopK(1, len(heads), rows, cols, top), q, k, v, scale, heads)
        weights, positions = got["maps"][0], got["positions"][0]  # (H', R, k)
        part = probs[:, rows[0]:rows[1], cols[0]:cols[1]]
        want, index = part.topk(min(top, part.shape[-1]), dim=-1)
        torch.testing.assert_close(weights[..., :want.shape[-1]], want.float(), atol=2e-6, rtol=0)
        real = want > 0
        assert (positions[..., :want.shape[-1]][real] == index[real] + cols[0]).all()
        assert (positions[..., :want.shape[-1]][~real] == -1).all()  # a row's first keys: fewer than k
        assert (weights[positions < 0] == 0).all()
        if S == T:
            before = blocked(TopK(1, len(heads), rows, cols, top), q, k, scale, heads)
            torch.testing.assert_close(got["maps"], before["maps"], atol=2e-6, rtol=0)
            assert (got["positions"] == before["positions"]).all()


@pytest.mark.parametrize("H,K,T,S,D", SHAPES)
def test_windows_as_the_blocked_windows_and_float64(H, K, T, S, D):
    q, k, v, scale = inputs(H, K, T, S, D)
    heads = HEADS[H]
    probs = exact(q, k, scale, heads)
    for rows, cols in windows_of(T, S):
        got, _ = fused(Window(1, len(heads), rows, cols), q, k, v, scale, heads)
        want = probs[:, rows[0]:rows[1], cols[0]:cols[1]].float()
        torch.testing.assert_close(got["maps"][0], want, atol=2e-6, rtol=0)
        assert (got["maps"][0][want == 0] == 0).all()  # keys a row does not see: exactly 0
        for store, scale_u8 in ((torch.float16, 1.0), (torch.uint8, 1 / 255)):
            kept, _ = fused(Window(1, len(heads), rows, cols, store, scale_u8), q, k, v, scale, heads)
            if store == torch.float16:
                torch.testing.assert_close(kept["maps"][0].float(), want.half().float(), atol=1e-3, rtol=0)
            else:  # the same steps but where float32 rounding falls on a step's half: one step apart
                steps = (want / scale_u8).round().clamp(0, 255)
                diff = (kept["maps"][0].float() - steps).abs()
                assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
            if S == T:
                before = blocked(Window(1, len(heads), rows, cols, store, scale_u8), q, k, scale, heads)
                diff = (kept["maps"].float() - before["maps"].float()).abs()
                assert diff.max() <= (1e-3 if store == torch.float16 else 1)
                assert (diff > 0).float().mean() < 1e-3


def test_every_output_at_once_and_the_attention_unchanged():
    """One call making bin sums, top k and a window together; its attention output is the plain
    call's bit for bit (the reductions read the scores, they change nothing of the forward)."""
    q, k, v, scale = inputs(6, 2, 150, 170, 32)
    heads = [5, 0, 3]
    rows, cols = (40, 170), (3, 160)
    R = rows[1] - rows[0]
    emit = ca.Emit(heads, rows, cols, col_edges=[3, 50, 51, 90, 160], top_weights=torch.zeros(3, R, 4),
                   top_positions=torch.full((3, R, 4), -1, dtype=torch.int32), window=torch.zeros(3, R, 157))
    with torch.no_grad():
        y = ca.causal_attention(q, k, v, scale, emit)
        plain = ca.causal_attention(q, k, v, scale)
    assert emit.done and emit.bin_sums is not None
    assert torch.equal(y, plain)
    probs = exact(q, k, scale, heads)[:, rows[0]:rows[1]]
    window = probs[..., cols[0]:cols[1]]
    torch.testing.assert_close(emit.window, window.float(), atol=2e-6, rtol=0)
    sums = torch.stack([probs[..., a:b].sum(-1) for a, b in [(3, 50), (50, 51), (51, 90), (90, 160)]], -1)
    torch.testing.assert_close(emit.bin_sums, sums.float(), atol=2e-6, rtol=0)
    torch.testing.assert_close(emit.top_weights, window.topk(4, -1).values.float(), atol=2e-6, rtol=0)


def test_scores_far_below_the_maximum_weigh_0_at_position_minus_1():
    """Scores in the hundreds: most of a row's probabilities underflow to 0 in float32; top k
    gives them position -1 as TopK does, and the window and bins hold exact zeros there too."""
    q, k, v, _ = inputs(2, 2, 200, 200, 32, spread=6.0)
    heads = [0, 1]
    got, _ = fused(TopK(1, 2, (0, 200), (0, 200), 8), q, k, v, 1.0, heads)
    before = blocked(TopK(1, 2, (0, 200), (0, 200), 8), q, k, 1.0, heads)
    assert (got["positions"] == -1).float().mean() > 0.3  # many rows have fewer than 8 links left
    assert (got["positions"] == ties_in_order(before["maps"], before["positions"])).all()
    torch.testing.assert_close(got["maps"], before["maps"], atol=2e-6, rtol=0)
    window, _ = fused(Window(1, 2, (0, 200), (0, 200)), q, k, v, 1.0, heads)
    assert ((window["maps"] == 0) == (blocked(Window(1, 2, (0, 200), (0, 200)), q, k, 1.0, heads)["maps"] == 0)).all()


@pytest.mark.parametrize("top", [2, 20])
def test_equal_scores_give_the_earlier_keys_first(top):
    """Keys equal in every dim at positions in different tiles score equally for every query: of
    those the earlier come first, and at the k-th place the earlier is kept."""
    q, k, v, scale = inputs(2, 2, 300, 300, 32)
    same = [250, 10, 130, 70, 190]
    k[0, :, same] = k[0, :, [5]] * 3  # one loud key, five times
    got, _ = fused(TopK(1, 2, (260, 300), (0, 300), top), q, k, v, scale, [0, 1])
    positions, weights = got["positions"][0], got["maps"][0]
    loudest = torch.isin(positions[..., 0], torch.tensor(same, dtype=torch.int32))  # rows the repeated key leads
    assert loudest.sum() > 10
    n = min(top, 5)
    assert (positions[loudest][:, :n] == torch.tensor(sorted(same)[:n], dtype=torch.int32)).all()
    assert (weights[loudest][:, :n] == weights[loudest][:, :1]).all()


def test_a_pool_over_its_bytes_is_recomputed(monkeypatch):
    """A Pool whose per-row bin sums would pass EMIT_BYTES asks nothing of the kernel."""
    monkeypatch.setattr(ab, "EMIT_BYTES", 4 * 2 * 100 * 8 - 1)
    assert Pool(1, 2, (0, 100), (0, 100), 8).emit(0, [0, 1]) is None
    monkeypatch.undo()
    assert Pool(1, 2, (0, 100), (0, 100), 8).emit(0, [0, 1]) is not None


# --- blocked_maps end to end -------------------------------------------------------------------
LLAMA = dict(positional="rotary", norm_type="rmsnorm", ffn="gated", activation="silu", n_kv_heads=2, d_model=128, n_heads=4, n_layers=3,
             context_length=256, vocab_size=97, d_ff=96)
LAYERS, MAP_HEADS = [2, 0], [3, 1]


@pytest.fixture(scope="module")
def llama():
    return small_config_model(seed=5, **LLAMA)


def run_maps(model, ids, make, monkeypatch, fused_path: bool, **kw):
    """blocked_maps' results, the fused path on or off; with it on, reduce_layer must never run."""
    monkeypatch.setattr(ab, "FUSED", fused_path)
    if fused_path:
        monkeypatch.setattr(ab, "reduce_layer", lambda *a, **k: pytest.fail("recomputed a fused layer"))
    tokens = model.sequence(ids)[0]
    reductions = {"self": make(len(ids))}
    blocked_maps(model, tokens, LAYERS, MAP_HEADS, reductions, **kw)
    monkeypatch.undo()
    return reductions["self"].result()


REQUESTS = {
    "pool": lambda T: Pool(2, 2, (0, T), (0, T), 16),
    "pool window": lambda T: Pool(2, 2, (11, T - 4), (3, T - 20), 9),
    "top_k": lambda T: TopK(2, 2, (0, T), (0, T), 5),
    "top_k window": lambda T: TopK(2, 2, (30, T), (10, 90), 3),
    "window f32": lambda T: Window(2, 2, (5, T - 1), (0, T - 7)),
    "whole u8": lambda T: Window(2, 2, (0, T), (0, T), torch.uint8, 1 / 255),
    "whole f16": lambda T: Window(2, 2, (0, T), (0, T), torch.float16),
}


@pytest.mark.parametrize("request_name", list(REQUESTS))
def test_blocked_maps_fused_equals_recomputed(llama, request_name, monkeypatch):
    ids = torch.randint(0, 97, (157,), generator=torch.Generator().manual_seed(2)).tolist()
    make = REQUESTS[request_name]
    for ablate in ((), (ZEdit("blocks.0.attn", 1, "zero"), ZEdit("blocks.1.attn", 2, "mean"))):
        got = run_maps(llama, ids, make, monkeypatch, True, ablate=ablate)
        want = run_maps(llama, ids, make, monkeypatch, False, ablate=ablate)
        maps, before = got["maps"].float(), want["maps"].float()
        if want["maps"].dtype == torch.uint8:
            diff = (maps - before).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
        else:
            torch.testing.assert_close(maps, before, atol=1e-3 if want["maps"].dtype == torch.float16 else 2e-6,
                                       rtol=0)
        if "positions" in want:
            assert (got["positions"] == want["positions"]).all()


def test_progress_points_and_kept_queries_as_before(llama, monkeypatch):
    """The forward's progress points still call `progress` (after each attention and block), and
    the fused layers' queries and keys are kept for a zoom, which then runs no forward."""
    ids = torch.randint(0, 97, (140,), generator=torch.Generator().manual_seed(3)).tolist()
    calls = []
    kept = KeptQK(64 << 20)
    got = run_maps(llama, ids, REQUESTS["pool"], monkeypatch, True, progress=lambda: calls.append(1), kept=kept)
    assert len(calls) >= 2 * LLAMA["n_layers"] and len(kept) == len(LAYERS)
    monkeypatch.setattr(type(llama), "run_sequence", lambda *a: pytest.fail("a zoom ran a forward"))
    zoom = Window(2, 2, (100, 140), (0, 140))
    blocked_maps(llama, llama.sequence(ids)[0], LAYERS, MAP_HEADS, {"self": zoom}, kept=kept)
    monkeypatch.undo()
    whole = run_maps(llama, ids, lambda T: Window(2, 2, (0, T), (0, T)), monkeypatch, True)
    torch.testing.assert_close(zoom.result()["maps"], whole["maps"][:, :, 100:140], atol=2e-6, rtol=0)
    torch.testing.assert_close(got["maps"].sum(-1), torch.ones(2, 2, 16))


def test_sliding_window_layers_take_the_recompute(monkeypatch):
    """A model whose forward masks a sliding window: no Emit is asked, the maps are recomputed."""
    model = small_config_model(seed=1, **{**LLAMA, "sliding_window": 40})
    ids = torch.randint(0, 97, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    calls = []
    recompute = ab.reduce_layer
    monkeypatch.setattr(ab, "reduce_layer", lambda *a, **k: (calls.append(1), recompute(*a, **k)))
    result = analyse_attention(model, ids, LAYERS, MAP_HEADS, want=MapRequest(pool=8))
    assert len(calls) == len(LAYERS)
    assert result.maps["self"].shape == (2, 2, 8, 8)


@pytest.mark.parametrize("request_name", ["pool window", "top_k window", "whole u8"])
def test_fused_maps_made_in_pieces_as_in_one(llama, request_name, monkeypatch):
    """Under a reporting call a long prompt's attention runs in pieces of query rows (hooks.row_pieces),
    each piece's kernel making its rows of the maps: the same maps as the recompute, with no layer
    recomputed, and progress between the pieces."""
    from attnlens.model import hooks as model_hooks

    ids = torch.randint(0, 97, (157,), generator=torch.Generator().manual_seed(4)).tolist()
    make = REQUESTS[request_name]
    want = run_maps(llama, ids, make, monkeypatch, False)
    calls = []
    monkeypatch.setattr(model_hooks, "PIECE_MACS", 100_000)  # each layer's attention in several pieces
    pieces = model_hooks.row_pieces
    monkeypatch.setattr(model_hooks, "row_pieces", lambda *a: calls.append("pieces") or pieces(*a))
    got = run_maps(llama, ids, make, monkeypatch, True, progress=lambda: calls.append(1))
    assert calls.count("pieces") >= LLAMA["n_layers"] and calls.count(1) > 4 * LLAMA["n_layers"]
    if want["maps"].dtype == torch.uint8:
        assert ((got["maps"].float() - want["maps"].float()).abs() <= 1).all()
    else:
        torch.testing.assert_close(got["maps"], want["maps"], atol=2e-6, rtol=0)
    if "positions" in want:
        assert (got["positions"] == want["positions"]).all()

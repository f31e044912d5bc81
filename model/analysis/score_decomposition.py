"""Why a head attends: one attention score q_i . k_j * scale split into pairs of what wrote the
query's and the key's residual streams (a decoder's, pre-norm).

The stream entering block l at a position is a sum of parts (logit_attribution.stream_parts: the
token embedding, positions, each earlier head's output, each earlier MLP's, the biases). With the
block's norm frozen at each position's scale, the query and the key are linear in those parts:

    q_i = sum over parts a of Q_i(a)     Q_i(a) = rot_i(g_q * W_Q,h norm_i(a))   (+ the biases' row:
    k_j = sum over parts b of K_j(b)     K_j(b) = rot_j(g_k * W_K,h' norm_j(b))    the norm's and the
                                                                                  projection's bias)

rot_i: the rotary rotation at position i (linear, applied to each part's projection); g_q, g_k:
the per-head q/k norm's gain over its frozen root mean square (Qwen3; 1 elsewhere); h' the key/value
head query head h reads. So the score is a sum over pairs,

    score = scale * q_i . k_j = sum over (a, b) of scale * Q_i(a) . K_j(b)

a matrix (query parts x key parts) that sums to the model's score (the pre-softmax logit, before the
mask) within float rounding. The top pairs by magnitude come first.

Every architecture's steps are followed: the block's input norm (none: OLMo 2), the q/k norm over a
head's D dims (Qwen3, Gemma 3), over every head's values at once (OLMo 2) or a LayerNorm of the head's
own weights (StableLM 2), each frozen at the run's value; the layer's own rotary base (Gemma 3); the
stream's parts as logit_attribution.stream_parts makes them (post-norms, multipliers). Gemma 2's
attention soft-cap (cap * tanh(score / cap)) is no sum: the parts sum to the score before it, and the
answer gives the capped score beside it (`softcap`, `capped_score`).

encoder_decoder_scores.py does the same for an encoder-decoder's encoder, decoder and cross heads.
"""

from __future__ import annotations

import math
from typing import TypedDict

import numpy as np
import torch

from attnlens.model.analysis.block_runs import Report
from attnlens.model.analysis.logit_attribution import check_pre_norm, frozen_norm, stream_names, stream_parts, through
from attnlens.model.hooks import Hooks, hooked
from attnlens.model.parts.norms import HeadLayerNorm
from attnlens.model.parts.positions import apply_rotary


def _no_report() -> None:
    pass


class Pair(TypedDict):
    query: str  # the part on the query's side
    key: str  # the part on the key's side
    value: float


class ScoreDecomposition(TypedDict):
    group: str  # the head's attention group (a decoder's: self)
    layer: int
    head: int
    kv_head: int
    query: int
    key: int
    scale: float
    score: float  # the model's scaled score q . k * scale (hook_q / hook_k, rotated where rotary), before a soft-cap
    softcap: float | None  # Gemma 2's attention soft-cap: the parts sum to `score`, before it
    capped_score: float | None  # with softcap: cap * tanh(score / cap), what the softmax reads
    probability: float  # the head's attention from the query to the key
    masked: bool  # the key is outside the query's sliding window (its probability is 0)
    parts: list[str]  # the rows' names (the query side's parts)
    key_parts: list[str]  # the columns' names (a self-attention head's: parts; a cross head's: the encoder's)
    matrix: np.ndarray  # (P, P') float64 [query part, key part]; sums to score
    query_totals: list[float]  # each query part against the whole key (row sums)
    key_totals: list[float]  # each key part against the whole query (column sums)
    top: list[Pair]  # the top_k pairs by magnitude, largest first
    rest: float  # score minus the listed pairs


def check_score(config, ids: list[int], layer: int, head: int, query: int, key: int) -> None:
    """A ValueError naming the field that is out of range."""
    if config.family != "decoder" or config.norm != "pre":
        raise ValueError("score decomposition needs a pre-norm decoder (a causal language model whose residual "
                         "stream is the sum of what its parts wrote)")
    check_input_and_head(config, ids, [("ids", ids)], layer, head)
    if not 0 <= query < len(ids):
        raise ValueError(f"query {query} out of range 0..{len(ids) - 1}")
    if not 0 <= key <= query:
        raise ValueError(f"key {key} out of range 0..{query}: a causal head's query sees itself and the positions "
                         "before it")


def check_input_and_head(config, ids: list[int], named_ids: list[tuple[str, list[int]]], layer: int,
                         head: int) -> None:
    """What every score decomposition checks: `ids` is given and fits, each of `named_ids` is in the
    vocabulary, and the head exists."""
    if not ids:
        raise ValueError("ids is empty")
    if len(ids) > config.context_length:
        raise ValueError(f"ids has {len(ids)} tokens, over the context length {config.context_length}")
    for name, seq in named_ids:
        bad = [i for i in seq if not 0 <= i < config.vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} out of range 0..{config.vocab_size - 1}")
    if not 0 <= layer < config.n_layers:
        raise ValueError(f"layer {layer} out of range 0..{config.n_layers - 1}")
    if not 0 <= head < config.n_heads:
        raise ValueError(f"head {head} out of range 0..{config.n_heads - 1}")


def side(model, captured: dict[str, torch.Tensor], ids: list[int], layer: int, position: int, rows: slice,
         head: int) -> tuple[list[str], torch.Tensor]:
    """The parts' names and their contributions (P, D) float64 to the query (rows: the q rows of the fused
    projection) or the key of `head` at `position` of block `layer`, q/k-normed and rotated as the model."""
    block = model.blocks[layer]
    attn = block.attn
    D = attn.d_head
    names, parts = stream_parts(model, captured, ids, layer, position).stacked()  # (P, C)
    gain, beta, centred, _ = frozen_norm(block.ln1, captured[f"blocks.{layer}.hook_resid_pre"][0, position])
    normed = through(parts, gain, centred)
    normed[-1] += beta  # the norm's bias joins the biases' row
    w = attn.qkv.weight.detach()[rows].double()  # (N D, C) every head's rows of q (or k)
    every = normed @ w.t()  # (P, N D)
    b = attn.qkv.bias
    if b is not None:
        every[-1] += b.detach()[rows].double()
    out = every[:, head * D:(head + 1) * D]  # (P, D)
    q_norm = attn.q_norm if rows.start == 0 else attn.k_norm
    if q_norm is not None:  # the q/k norm, its scale frozen at this q (or k)
        if attn.qk_norm_all:  # OLMo 2: one RMSNorm over every head's values of the position
            g, _, _, _ = frozen_norm(q_norm, every.sum(dim=0))  # (N D,)
            out = out * g[head * D:(head + 1) * D]
        elif isinstance(q_norm, HeadLayerNorm):  # StableLM 2: a LayerNorm of the head's own weights
            total = out.sum(dim=0)  # (D,)
            std = torch.sqrt(total.var(unbiased=False) + q_norm.eps)
            out = (out - out.mean(dim=-1, keepdim=True)) * (q_norm.weight.detach()[head].double() / std)
        else:  # Qwen3, Gemma 3: an RMSNorm over the head's D dims
            g, _, _, _ = frozen_norm(q_norm, out.sum(dim=0))
            out = out * g
    angles = model.layer_rotary_angles(1, start=position)[layer]  # Gemma 3: the layer's own base
    if angles is not None:  # each part rotated by the position's angles: (P, D) -> (1, P, 1, D) and back
        as_double = angles._replace(cos=angles.cos.double(), sin=angles.sin.double(),
                                    signed_sin=None if angles.signed_sin is None else angles.signed_sin.double())
        out = apply_rotary(out[None, :, None], as_double)[0, :, 0]
    return names, out


def ranked(matrix: np.ndarray, names: list[str], key_names: list[str], top_k: int) -> list[Pair]:
    """The top_k pairs of matrix (query parts x key parts) by magnitude, largest first."""
    order = np.argsort(-np.abs(matrix), axis=None)[:top_k]
    return [{"query": names[i // len(key_names)], "key": key_names[i % len(key_names)], "value": float(matrix.flat[i])}
            for i in order]


@torch.inference_mode()
def decompose_score(model, ids: list[int], layer: int, head: int, query: int, key: int, top_k: int = 20,
                    report: Report = _no_report) -> ScoreDecomposition:
    """The score of `head` of block `layer` from `query` to `key`, split into pairs of parts (module docstring)."""
    check_pre_norm(model, "score decomposition")
    check_score(model.config, ids, layer, head, query, key)
    attn = model.blocks[layer].attn
    H, K, D = attn.n_heads, attn.n_kv_heads, attn.d_head
    kv = head // (H // K)
    rotary = model.config.positional == "rotary"
    qn, kn = ("hook_rot_q", "hook_rot_k") if rotary else ("hook_q", "hook_k")
    module = f"blocks.{layer}.attn"
    record = stream_names(model, layer) | {f"blocks.{layer}.hook_resid_pre", f"{module}.{qn}", f"{module}.{kn}",
                                           f"{module}.hook_pattern"}
    hooks = Hooks(record=record, progress=report)
    with hooked(model, hooks):
        model(torch.tensor([ids[:query + 1]], device=model.device), last_only=True)
    got = hooks.captured
    names, qs = side(model, got, ids, layer, query, slice(0, H * D), head)  # (P, D)
    _, ks = side(model, got, ids, layer, key, slice(H * D, (H + K) * D), kv)
    matrix = (qs @ ks.t() * attn.scale).cpu().numpy()  # (P, P)
    q, k = got[f"{module}.{qn}"][0, query, head].double(), got[f"{module}.{kn}"][0, key, kv].double()  # (D,)
    score = float(q @ k) * attn.scale
    top = ranked(matrix, names, names, top_k)
    window = model.config.window_of(layer)
    cap = attn.softcap
    report()
    return {"group": "self", "layer": layer, "head": head, "kv_head": kv, "query": query, "key": key,
            "scale": attn.scale, "score": score, "probability": float(got[f"{module}.hook_pattern"][0, head, query, key]),
            "masked": window is not None and key <= query - window, "softcap": cap,
            "capped_score": None if cap is None else cap * math.tanh(score / cap), "parts": names, "key_parts": names,
            "matrix": matrix, "query_totals": matrix.sum(axis=1).tolist(), "key_totals": matrix.sum(axis=0).tolist(),
            "top": top, "rest": score - sum(p["value"] for p in top)}

"""Why a head of an encoder-decoder (the translator) attends: one score q_i . k_j * scale of an encoder
self-attention, decoder self-attention or cross-attention head, split into pairs of what wrote the
query's and the key's streams (score_decomposition.py's, for a decoder).

A stream is a sum of parts: the token embedding, positions, each earlier head's (z - c) W_O (c its
constant value, as encoder_decoder_attribution.py folds it), each earlier MLP's output, and the
biases (c W_O + b_O, and every norm's bias). With every norm's scale frozen at this run's value at
the position, each norm is affine (centre, times gain / scale, plus its bias), so the stream stays a
sum of parts through the norms:

    post-norm (x = norm(x + sub-layer), the translator)   after each sub-layer every part goes through
                                                           the frozen norm, its bias joins the biases
    pre-norm                                               the sub-layer reads norm(x): the parts go
                                                           through the reading norm only

and the query (key) is linear in the parts: Q_i(a) = W_Q,h read_i(a) (the biases' row gets b_Q).
Which streams, by group (S source positions, T target positions, L layers a side):

    group    query side (position i)                        key side (position j)
    encoder  the encoder stream entering block l            the same stream at j
             (encoder parts of blocks < l)
    decoder  the decoder stream entering block l            the same stream at j <= i
             (decoder self, cross heads and MLPs of blocks < l)
    cross    the decoder stream after block l's self-       the memory: the encoder's last stream
             attention (its self heads too), read by the    through the encoder norm (every encoder
             cross-attention                                 part), at source position j

    score = scale * q_i . k_j = sum over (a, b) of scale * Q_i(a) . K_j(b)

a matrix (query parts x key parts) summing to the model's score within float rounding. The parts are
named by group: "encoder L0H1", "decoder L0H1" (self-attention), "cross L0H1", "encoder L0 MLP",
"decoder L0 MLP", and "embedding", "positions" (sinusoidal) and "biases" of the side's stream.
"""

from __future__ import annotations

import math
from typing import TypedDict

import torch
import torch.nn as nn

from attnlens.model.analysis.block_runs import Report
from attnlens.model.analysis.encoder_decoder_runs import check_blocks
from attnlens.model.analysis.explain import sequence_of
from attnlens.model.analysis.logit_attribution import frozen_norm, through
from attnlens.model.analysis.score_decomposition import ScoreDecomposition, check_input_and_head, ranked
from attnlens.model.hooks import Hooks, hooked
from attnlens.model.parts.norms import RMSNorm

GROUPS = ("encoder", "decoder", "cross")


def _no_report() -> None:
    pass


class Unreached(TypedDict):
    """A query past the end of a generated target (its length known only once the model made it)."""

    error: str


def check_encoder_decoder_score(config, ids: list[int], target_ids: list[int] | None, group: str | None, layer: int,
                                head: int, query: int, key: int) -> None:
    """A ValueError naming the field that is out of range (a generated target's length is checked by the call)."""
    check_blocks(config)
    if group not in GROUPS:
        raise ValueError(f"group {group!r}: an encoder-decoder's heads are in {', '.join(GROUPS)}")
    if target_ids is not None and len(target_ids) + 1 > config.context_length:
        raise ValueError(f"target_ids has {len(target_ids)} tokens; with the start token over the context length "
                         f"{config.context_length}")
    check_input_and_head(config, ids, [("ids", ids), ("target_ids", target_ids or [])], layer, head)
    S = len(ids)
    if group == "encoder" and not 0 <= query < S:
        raise ValueError(f"query {query} out of range 0..{S - 1}: the encoder's queries are the source's positions")
    if group != "encoder" and (query < 0 or target_ids is not None and query > len(target_ids)):
        T = "" if target_ids is None else str(len(target_ids))
        raise ValueError(f"query {query} out of range 0..{T}: the {group} heads' queries are the target's positions, "
                         "the start token first")
    if group == "decoder" and not 0 <= key <= query:
        raise ValueError(f"key {key} out of range 0..{query}: a causal head's query sees itself and the positions "
                         "before it")
    if group != "decoder" and not 0 <= key < S:
        raise ValueError(f"key {key} out of range 0..{S - 1}: the {group} heads' keys are the source's positions")


class Stream:
    """The parts of one stream at one position, float64: names and rows (C,), the biases apart."""

    def __init__(self, token: torch.Tensor, embedded: torch.Tensor, positions: bool):
        self.names, self.rows = ["embedding"], [token]
        if positions:  # learned or sinusoidal positions added to the embedding
            self.names.append("positions")
            self.rows.append(embedded - token)
        self.bias = torch.zeros_like(token)

    def total(self) -> torch.Tensor:
        return torch.stack(self.rows).sum(dim=0) + self.bias

    def add(self, name: str, row: torch.Tensor) -> None:
        self.names.append(name)
        self.rows.append(row)

    def heads(self, attn, z: torch.Tensor, beta: torch.Tensor | None, prefix: str) -> None:
        """Each head's write (z_h - c_h) W_O,h for z (H, D), c its value bias plus W_V times beta, the bias of
        the norm whose output its values read (None: no norm); c W_O + b_O to the biases."""
        H, D = attn.n_heads, attn.d_head
        C = attn.proj.weight.shape[0]
        c = torch.zeros(H * D, dtype=torch.float64, device=z.device)
        if beta is not None:
            c = c + attn.qkv.weight.detach()[2 * H * D:].double() @ beta  # (HD, C) @ (C,)
        if attn.qkv.bias is not None:
            c = c + attn.qkv.bias.detach()[2 * H * D:].double()
        w_o = attn.proj.weight.detach().double().view(C, H, D)  # (C, HD) -> (C, H, D)
        writes = torch.einsum("chd,hd->hc", w_o, z.double() - c.view(H, D))  # (H, C)
        for h in range(H):
            self.add(f"{prefix}H{h}", writes[h])
        self.bias = self.bias + torch.einsum("chd,hd->c", w_o, c.view(H, D))
        if attn.proj.bias is not None:
            self.bias = self.bias + attn.proj.bias.detach().double()

    def norm(self, module: nn.Module) -> None:
        """Every part through `module` frozen at the parts' total (the stream it normalises)."""
        assert isinstance(module, (nn.LayerNorm, RMSNorm)), f"no frozen form of {type(module).__name__}"
        gain, beta, centred, _ = frozen_norm(module, self.total())
        self.rows = list(through(torch.stack(self.rows), gain, centred))
        self.bias = through(self.bias, gain, centred) + beta

    def project(self, attn, rows: slice, head: int) -> tuple[list[str], torch.Tensor]:
        """The parts' names and their contributions (P, D) to the q (rows 0..HD) or k (HD..2HD) of `head`."""
        D = attn.d_head
        w = attn.qkv.weight.detach()[rows].double()[head * D:(head + 1) * D]  # (D, C)
        out = torch.cat([torch.stack(self.rows), self.bias[None]]) @ w.t()  # (P, D)
        b = attn.qkv.bias
        if b is not None:
            out[-1] += b.detach()[rows].double()[head * D:(head + 1) * D]
        return [*self.names, "biases"], out


def _bias(module: nn.Module | None) -> torch.Tensor | None:
    b = getattr(module, "bias", None)
    return None if b is None else b.detach().double()


def _start(model, got: dict, stack: str, token_id: int, position: int) -> Stream:
    c = model.config
    token = model.tok_emb(torch.tensor([token_id], device=model.device))[0].double()  # (C,)
    if c.scale_embeddings:
        token = token * math.sqrt(c.d_model)
    return Stream(token, got[f"{stack}.blocks.0.hook_resid_pre"][0, position].double(), c.positional != "rotary")


def encoder_stream(model, got: dict, ids: list[int], upto: int, position: int) -> Stream:
    """The encoder stream entering block `upto` (upto = L: its last) at a source position."""
    s = _start(model, got, "encoder", ids[position], position)
    for i in range(upto):
        block = model.encoder.blocks[i]
        at = lambda name: got[f"encoder.blocks.{i}.{name}"][0, position]
        # the values read ln1(x) (pre-norm) or x, the previous block's last norm's output (post-norm)
        beta = _bias(block.ln1) if block.pre_norm else _bias(model.encoder.blocks[i - 1].ln2) if i else None
        s.heads(block.attn, at("attn.hook_z"), beta, f"encoder L{i}")
        if not block.pre_norm:
            s.norm(block.ln1)
        s.add(f"encoder L{i} MLP", at("hook_mlp_out").double())
        if not block.pre_norm:
            s.norm(block.ln2)
    return s


def decoder_stream(model, got: dict, target: list[int], upto: int, position: int, cross: bool) -> Stream:
    """The decoder stream entering block `upto` at a target position; with `cross`, after block upto's
    self-attention (what its cross-attention reads)."""
    s = _start(model, got, "decoder", target[position], position)
    memory_beta = _bias(model.encoder_norm)  # the cross values read the memory: the encoder norm's output
    for i in range(upto + 1 if cross else upto):
        block = model.decoder.blocks[i]
        at = lambda name: got[f"decoder.blocks.{i}.{name}"][0, position]
        beta = _bias(block.ln1) if block.pre_norm else _bias(model.decoder.blocks[i - 1].ln2) if i else None
        s.heads(block.attn, at("attn.hook_z"), beta, f"decoder L{i}")
        if not block.pre_norm:
            s.norm(block.ln1)
        if i == upto:  # cross: what block upto's cross-attention reads
            break
        s.heads(block.cross_attn, at("cross_attn.hook_z"), memory_beta, f"cross L{i}")
        if not block.pre_norm:
            s.norm(block.ln_cross)
        s.add(f"decoder L{i} MLP", at("hook_mlp_out").double())
        if not block.pre_norm:
            s.norm(block.ln2)
    return s


def _recorded(model, group: str, layer: int) -> set[str]:
    """The hook points the streams read, and the receiver's q, k and pattern."""
    L = model.config.n_layers
    module = {"encoder": f"encoder.blocks.{layer}.attn", "decoder": f"decoder.blocks.{layer}.attn",
              "cross": f"decoder.blocks.{layer}.cross_attn"}[group]
    names = {f"{module}.{n}" for n in ("hook_q", "hook_k", "hook_pattern")}
    encoder = layer if group == "encoder" else L if group == "cross" else 0
    names |= {"encoder.blocks.0.hook_resid_pre"} | {f"encoder.blocks.{i}.{n}" for i in range(encoder)
                                                     for n in ("attn.hook_z", "hook_mlp_out")}
    if group != "encoder":
        names |= {"decoder.blocks.0.hook_resid_pre"} | {f"decoder.blocks.{i}.{n}" for i in range(layer + 1)
                                                        for n in ("attn.hook_z", "cross_attn.hook_z", "hook_mlp_out")}
    return names


@torch.inference_mode()
def decompose_encoder_decoder_score(model, ids: list[int], target_ids: list[int] | None, group: str, layer: int,
                                    head: int, query: int, key: int, top_k: int = 20, report: Report = _no_report
                                    ) -> ScoreDecomposition | Unreached:
    """The score of `head` of `group`'s block `layer` from `query` to `key`, split into pairs of parts (module
    docstring). Without a target, the model's greedy translation (as /attention/explain reads it)."""
    check_encoder_decoder_score(model.config, ids, target_ids, group, layer, head, query, key)
    target = sequence_of(model, ids, target_ids).tokens["target"] if group != "encoder" else []
    if group != "encoder" and query >= len(target):
        return {"error": f"query {query} out of range: the target has {len(target)} positions (0..{len(target) - 1})"}
    hooks = Hooks(record=_recorded(model, group, layer), progress=report)
    source = torch.tensor([ids], device=model.device)
    with hooked(model, hooks):
        if group == "encoder":
            model.encode(source)
        else:  # the decoder is causal: the target up to the query
            model(torch.tensor([target[:query + 1]], device=model.device), source=source, last_only=True)
    got = hooks.captured
    if group == "encoder":
        block = model.encoder.blocks[layer]
        attn, module = block.attn, f"encoder.blocks.{layer}.attn"
        q_side, k_side = (encoder_stream(model, got, ids, layer, p) for p in (query, key))
        for s in (q_side, k_side):
            if block.pre_norm:
                s.norm(block.ln1)
    elif group == "decoder":
        block = model.decoder.blocks[layer]
        attn, module = block.attn, f"decoder.blocks.{layer}.attn"
        q_side, k_side = (decoder_stream(model, got, target, layer, p, cross=False) for p in (query, key))
        for s in (q_side, k_side):
            if block.pre_norm:
                s.norm(block.ln1)
    else:
        block = model.decoder.blocks[layer]
        attn, module = block.cross_attn, f"decoder.blocks.{layer}.cross_attn"
        q_side = decoder_stream(model, got, target, layer, query, cross=True)
        if block.pre_norm:
            q_side.norm(block.ln_cross)
        k_side = encoder_stream(model, got, ids, model.config.n_layers, key)
        k_side.norm(model.encoder_norm)  # the memory
    HD = attn.n_heads * attn.d_head
    names, qs = q_side.project(attn, slice(0, HD), head)  # (Pq, D)
    key_names, ks = k_side.project(attn, slice(HD, 2 * HD), head)  # (Pk, D)
    matrix = (qs @ ks.t() * attn.scale).cpu().numpy()  # (Pq, Pk)
    q, k = got[f"{module}.hook_q"][0, query, head].double(), got[f"{module}.hook_k"][0, key, head].double()  # (D,)
    score = float(q @ k) * attn.scale
    top = ranked(matrix, names, key_names, top_k)
    report()
    return {"layer": layer, "head": head, "kv_head": head, "query": query, "key": key, "scale": attn.scale,
            "score": score, "probability": float(got[f"{module}.hook_pattern"][0, head, query, key]), "masked": False,
            "softcap": None, "capped_score": None,
            "parts": names, "key_parts": key_names, "matrix": matrix, "query_totals": matrix.sum(axis=1).tolist(),
            "key_totals": matrix.sum(axis=0).tolist(), "top": top, "rest": score - sum(p["value"] for p in top),
            "group": group}

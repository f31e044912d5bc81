"""Direct logit attribution of a decoder: how much each head, each MLP, the embedding and the rest
write directly into logit(answer) - logit(foil) at one position (TransformerLens's
ActivationCache.stack_head_results + apply_ln_to_stack + logit_attrs).

The final residual stream of a pre-norm decoder is a sum of what its parts wrote (block_runs'
blocks add, never normalise, the stream):

    x = token embedding + positions + sum over layers (each head's z_h W_O,h  +  b_O  +  MLP output)

A head's z includes a constant whatever it attends to (its probabilities sum to 1): its value bias
b_V and W_V times the norm's bias. As TransformerLens folds them (fold_ln, fold_value_biases),
that constant times W_O counts with the biases, not the head.

and the logit difference is ln_f(x) . (W_U[answer] - W_U[foil]). With the final norm's scale
frozen at this run's value (LayerNorm: x's standard deviation, each part centred; RMSNorm: x's
root mean square), ln_f is linear in the parts, so each part's direct effect is its normalised
write dotted with the direction, and the parts sum to the logit difference:

    heads [L][H] + mlps [L] + embedding + other  =  logit_difference

The architectures' own linear steps are in the parts: a norm of each attention output before it
joins the stream (Gemma 2/3, OLMo 2: ln1_post) frozen at the run's value as the final norm is, so
each head's write goes through it linearly; Granite's residual multiplier (each write times it),
embedding multiplier (in the embedding) and logits divisor (every part divided by it). The MLP's
part is its output as it joins the stream (after its post-norm and multiplier: hook_mlp_out).
Gemma 2's final soft-cap (cap * tanh(logit / cap)) is no sum: the parts sum to the logits before
it, and the answer says so (`softcap`, `capped_logit_difference`: the model's own output).

`other` is the rest: learned or sinusoidal positions, the attention output biases, the final
norm's bias and the LM head's (`other_parts` names each). A post-norm model normalises the stream
after every sub-layer, so its stream is no such sum: refused.

    stream_parts   the parts of the stream entering a block (or the final one) at one position,
                   from a recorded forward: shared with score_decomposition.py
    frozen_norm    a norm as the linear map it is at one position's frozen scale
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn as nn

from attnlens.model.analysis.block_runs import Report, check_decoder, norm, readout, unembed_direction
from attnlens.model.hooks import Hooks, hooked
from attnlens.model.parts.norms import RMSNorm


def _no_report() -> None:
    pass


class LogitAttribution(TypedDict):
    position: int
    answer_id: int
    foil_id: int
    answer_logit: float
    foil_logit: float
    logit_difference: float  # the model's own, what the parts sum to (before the soft-cap where `softcap`)
    heads: list[list[float]] | dict[str, list[list[float]]]  # [L][H] each head's (z - b_V) W_O through the frozen
    # final norm (an encoder-decoder's: {"decoder", "cross": [L][H]}, encoder_decoder_attribution.py)
    mlps: list[float]  # [L]
    embedding: float  # the token embedding
    other: float  # sum of other_parts
    other_parts: dict[str, float]  # positions, attention_biases (b_O and b_V W_O), final_norm_bias, head_bias
    norm_scale: float  # the final norm's frozen divisor (standard deviation or root mean square)
    softcap: float | None  # Gemma 2's final soft-cap: answer_logit, foil_logit and logit_difference are before it
    capped_logit_difference: float | None  # with softcap: the model's own output difference, after the cap


def check_pre_norm(model, what: str) -> None:
    check_decoder(model, what)
    if model.config.norm != "pre":
        raise ValueError(f"{what} needs a pre-norm model: a post-norm block normalises the residual stream after "
                         "each sub-layer, so the stream is no sum of what the parts wrote")


def check_attribution(config, ids: list[int], answer_id: int | None, foil_id: int | None, position: int | None
                      ) -> None:
    """A ValueError naming the field that a model of `config` cannot attribute."""
    if config.family != "decoder" or config.norm != "pre":
        raise ValueError("direct logit attribution needs a pre-norm decoder (a causal language model whose residual "
                         "stream is the sum of what its parts wrote) or an encoder-decoder")
    if not ids:
        raise ValueError("ids is empty")
    if len(ids) > config.context_length:
        raise ValueError(f"ids has {len(ids)} tokens, over the context length {config.context_length}")
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise ValueError(f"ids: token id {bad[0]} out of range 0..{config.vocab_size - 1}")
    for name, i in (("answer_id", answer_id), ("foil_id", foil_id)):
        if i is not None and not 0 <= i < config.vocab_size:
            raise ValueError(f"{name} {i} out of range 0..{config.vocab_size - 1}")
    if position is not None and not 0 <= position < len(ids):
        raise ValueError(f"position {position} out of range 0..{len(ids) - 1}")


def stream_names(model, layer: int) -> set[str]:
    """The hook points stream_parts reads for the stream entering block `layer` (layer = L: the final)."""
    names = {"blocks.0.hook_resid_pre"}
    for i in range(layer):
        names |= {f"blocks.{i}.attn.hook_z", f"blocks.{i}.hook_mlp_out"}
    return names


@dataclass
class StreamParts:
    """What wrote the residual stream entering a block at one position, float64 (C,) each."""

    embedding: torch.Tensor  # the token embedding (times sqrt(C) where the config scales it)
    positions: torch.Tensor  # learned or sinusoidal positions (zero for rotary models)
    heads: torch.Tensor  # (l, H, C) each head's (z - b_V) W_O
    mlps: torch.Tensor  # (l, C)
    biases: torch.Tensor  # the attention output biases of the blocks below, and the heads' b_V W_O
    added_positions: bool = True  # positions are added to the stream (learned, sinusoidal), not rotary

    def stacked(self) -> tuple[list[str], torch.Tensor]:
        """The parts as named rows (n, C): embedding, positions (if any), L{l}H{h}, L{l} MLP, biases."""
        l, H, C = self.heads.shape
        names = ["embedding"] + (["positions"] if self.added_positions else [])
        rows = [self.embedding[None]] + ([self.positions[None]] if self.added_positions else [])
        for i in range(l):
            names += [f"L{i}H{h}" for h in range(H)] + [f"L{i} MLP"]
            rows += [self.heads[i], self.mlps[i][None]]
        names.append("biases")
        rows.append(self.biases[None])
        return names, torch.cat(rows)

    def total(self) -> torch.Tensor:
        return self.embedding + self.positions + self.heads.sum(dim=(0, 1)) + self.mlps.sum(dim=0) + self.biases


def value_bias(block) -> torch.Tensor:
    """(H, D) float64 each query head's constant value: its key/value head's bias plus W_V times the
    norm's bias (what every value holds whatever the token; zeros without either)."""
    attn = block.attn
    H, K, D = attn.n_heads, attn.n_kv_heads, attn.d_head
    qkv = attn.qkv
    out = torch.zeros(K * D, dtype=torch.float64, device=qkv.weight.device)
    if qkv.bias is not None:
        out = out + qkv.bias.detach()[(H + K) * D:].double()
    beta = getattr(block.ln1, "bias", None)
    if beta is not None:
        out = out + qkv.weight.detach()[(H + K) * D:].double() @ beta.detach().double()  # (KD, C) @ (C,)
    return out.view(K, D).repeat_interleave(H // K, dim=0)  # (KD,) -> (K, D) -> (H, D)


def stream_parts(model, captured: dict[str, torch.Tensor], ids: list[int], layer: int, position: int) -> StreamParts:
    """The parts of the stream entering block `layer` (the final stream for layer = L) at `position`, from
    the hook points of stream_names (batch row 0). A block's attention output, as it joins the stream,
    is linear in its heads' writes once its post-norm (ln1_post) is frozen at the run's value; times the
    residual multiplier."""
    c = model.config
    C, H, D = c.d_model, c.n_heads, c.d_head
    device = model.device
    token = model.tok_emb(torch.tensor([ids[position]], device=device))[0].double()  # (C,)
    if c.scale_embeddings:
        token = token * math.sqrt(C)
    token = token * c.embedding_multiplier  # Granite
    embedded = captured["blocks.0.hook_resid_pre"][0, position].double()
    heads, mlps = [], []
    biases = torch.zeros(C, dtype=torch.float64, device=device)
    for i in range(layer):
        block = model.blocks[i]
        attn = block.attn
        w_o = attn.proj.weight.detach().double().view(C, H, D)  # (C, HD) -> (C, H, D)
        z = captured[f"blocks.{i}.attn.hook_z"][0, position].double()  # (H, D)
        b_v = value_bias(block)  # (H, D): a head's constant part (its probabilities sum to 1)
        written = torch.einsum("chd,hd->hc", w_o, z - b_v)  # (H, C)
        bias = torch.einsum("chd,hd->c", w_o, b_v)  # (C,)
        if attn.proj.bias is not None:
            bias = bias + attn.proj.bias.detach().double()
        if block.ln1_post is not None:  # frozen at the attention's output (C,): its parts through it linearly
            gain, beta, centred, _ = frozen_norm(block.ln1_post, written.sum(dim=0) + bias)
            written, bias = through(written, gain, centred), through(bias, gain, centred) + beta
        m = block.residual_multiplier
        heads.append(written * m)
        biases = biases + bias * m
        mlps.append(captured[f"blocks.{i}.hook_mlp_out"][0, position].double())
    return StreamParts(token, embedded - token,
                       torch.stack(heads) if heads else torch.zeros(0, H, C, dtype=torch.float64, device=device),
                       torch.stack(mlps) if mlps else torch.zeros(0, C, dtype=torch.float64, device=device), biases,
                       c.positional != "rotary")


def frozen_norm(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool, float]:
    """A norm at x (N,) as a linear map with its scale frozen: (gain (N,), bias (N,), centred,
    divisor). module(y) = ((y - mean(y) if centred else y) * gain) + bias at y = x; each part p of x
    maps to (p - mean(p) if centred else p) * gain, and the bias is a part of its own. LayerNorm,
    RMSNorm, or the Identity (no norm: OLMo 2's sub-layer inputs)."""
    x = x.double()
    if isinstance(module, nn.Identity):
        ones = torch.ones(x.shape[-1], dtype=torch.float64, device=x.device)
        return ones, torch.zeros_like(ones), False, 1.0
    assert isinstance(module, (nn.LayerNorm, RMSNorm)), f"no frozen form of {type(module).__name__}"
    w = module.weight.detach().double()
    if isinstance(module, nn.LayerNorm):
        scale = math.sqrt(float(x.var(unbiased=False)) + module.eps)
        b = module.bias.detach().double() if module.bias is not None else torch.zeros_like(w)
        return w / scale, b, True, scale
    scale = math.sqrt(float(x.pow(2).mean()) + module.eps)
    return w / scale, torch.zeros_like(w), False, scale


def through(parts: torch.Tensor, gain: torch.Tensor, centred: bool) -> torch.Tensor:
    """(..., C) parts through a frozen norm's linear map (frozen_norm), its bias left out."""
    if centred:
        parts = parts - parts.mean(dim=-1, keepdim=True)
    return parts * gain


@torch.inference_mode()
def logit_attribution(model, ids: list[int], answer_id: int | None = None, foil_id: int | None = None,
                      position: int | None = None, report: Report = _no_report) -> LogitAttribution:
    """Each part's direct effect on logit(answer) - logit(foil) at `position` (default the last);
    answer and foil default to the top two predictions there (module docstring)."""
    check_pre_norm(model, "direct logit attribution")
    check_attribution(model.config, ids, answer_id, foil_id, position)
    pos = len(ids) - 1 if position is None else position
    L = model.config.n_layers
    final = f"blocks.{L - 1}.hook_resid_post"
    hooks = Hooks(record=stream_names(model, L) | {final}, progress=report)
    with hooked(model, hooks):
        logits = model(torch.tensor([ids[:pos + 1]], device=model.device), last_only=True).logits[0, -1].float()
    if answer_id is None or foil_id is None:
        top = torch.topk(logits, 2).indices.tolist()
        answer_id = top[0] if answer_id is None else answer_id
        foil_id = (top[1] if top[0] == answer_id else top[0]) if foil_id is None else foil_id
    parts = stream_parts(model, hooks.captured, ids, L, pos)
    x = hooks.captured[final][0, pos]  # (C,) the final stream
    gain, bias, centred, scale = frozen_norm(model.ln_f, x)
    direction, head_bias = unembed_direction(model, answer_id, foil_id)
    r = readout(model, answer_id, foil_id)
    d = direction.double() / r.divisor  # Granite: every logit divided
    effect = lambda p: through(p, gain, centred) @ d  # (..., C) -> (...)
    other = {"positions": float(effect(parts.positions)), "attention_biases": float(effect(parts.biases)),
             "final_norm_bias": float(bias @ d), "head_bias": head_bias / r.divisor}
    capped = None
    if r.cap is not None:  # the parts sum to the logits before the cap: the answer gives those
        capped = float(logits[answer_id] - logits[foil_id])
        uncapped = (norm(model.ln_f, x[None]).float() @ r.rows.t() + r.biases)[0] / r.divisor  # (2,)
        answer_logit, foil_logit = float(uncapped[0]), float(uncapped[1])
    else:
        answer_logit, foil_logit = float(logits[answer_id]), float(logits[foil_id])
    report()
    return {"position": pos, "answer_id": answer_id, "foil_id": foil_id,
            "answer_logit": answer_logit, "foil_logit": foil_logit, "logit_difference": answer_logit - foil_logit,
            "heads": effect(parts.heads).tolist(), "mlps": effect(parts.mlps).tolist(),
            "embedding": float(effect(parts.embedding)), "other": sum(other.values()), "other_parts": other,
            "norm_scale": scale, "softcap": r.cap, "capped_logit_difference": capped}

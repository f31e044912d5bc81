"""Direct logit attribution of an encoder-decoder (the translator): how much each decoder
self-attention head, each cross-attention head, each decoder MLP, the target token's embedding and
the rest write into logit(answer) - logit(foil) at one target position, along the decoder's
residual stream (logit_attribution.py's, for a decoder).

Pre-norm: the decoder's stream is the sum of what its parts wrote, and the decoder norm, frozen at
its scale there, is linear in them (as for a decoder).
Post-norm (the translator, Vaswani et al.): every sub-layer's sum goes through a norm,
x = ln(x + out). With each norm's scale frozen at this run's value at the position, each norm is
affine (centre, times gain / scale, plus its bias), so the final stream is still a sum of parts: a
write carried through the norms after it (the post-LN treatment of Kobayashi et al. 2021), each
norm's bias a part of its own. So the direction is carried back through the norms: a part's
effect is its write . r, r the direction as the norms after the part see it,

    r <- centre(gain * r)     through a frozen LayerNorm (the centring is symmetric)

Either way the parts sum to the logit difference:

    heads["decoder"] [L][H] + heads["cross"] [L][H] + mlps [L] + embedding + other = logit_difference

A head's part is (z - c) W_O, c the constant each of its values holds whatever the token (its value
bias plus W_V times the bias of the norm whose output its values read: the previous block's last
norm or the decoder's input norm, the encoder norm for cross-attention), as logit_attribution.py
folds b_V: c W_O counts with b_O in `attention_biases`. `other` is positions, attention_biases,
norm_biases (the decoder norm's; post-norm: every norm's on the way) and head_bias.

The encoder's heads write no logit directly: they reach it through the cross heads' keys and
values (ask /patch for their effect).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from attnlens.model.analysis.block_runs import Report, unembed_direction
from attnlens.model.analysis.encoder_decoder_runs import check_blocks
from attnlens.model.analysis.logit_attribution import LogitAttribution, frozen_norm
from attnlens.model.hooks import Hooks, hooked


def _no_report() -> None:
    pass


def check_encoder_decoder_attribution(config, ids: list[int], target_ids: list[int] | None, answer_id: int | None,
                                      foil_id: int | None, position: int | None) -> None:
    """A ValueError naming the field an encoder-decoder of `config` cannot attribute."""
    check_blocks(config)
    target = target_ids or []
    if not ids:
        raise ValueError("ids is empty")
    if len(ids) > config.context_length:
        raise ValueError(f"ids has {len(ids)} tokens, over the context length {config.context_length}")
    if len(target) + 1 > config.context_length:
        raise ValueError(f"target_ids has {len(target)} tokens; with the start token over the context length "
                         f"{config.context_length}")
    for name, seq in (("ids", ids), ("target_ids", target)):
        bad = [i for i in seq if not 0 <= i < config.vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} out of range 0..{config.vocab_size - 1}")
    for name, i in (("answer_id", answer_id), ("foil_id", foil_id)):
        if i is not None and not 0 <= i < config.vocab_size:
            raise ValueError(f"{name} {i} out of range 0..{config.vocab_size - 1}")
    if position is not None and not 0 <= position <= len(target):
        raise ValueError(f"position {position} out of range 0..{len(target)}: the target has {len(target) + 1} "
                         "positions, the start token first")


def _bias(module: nn.Module | None, C: int, device) -> torch.Tensor:
    """A norm's bias (C,) float64 (zeros without one)."""
    b = getattr(module, "bias", None)
    return torch.zeros(C, dtype=torch.float64, device=device) if b is None else b.detach().double()


def _back(gain: torch.Tensor, centred: bool, r: torch.Tensor) -> torch.Tensor:
    """The direction r (C,) read at a frozen norm's output, as its input sees it."""
    r = gain * r
    return r - r.mean() if centred else r


def _heads(attn, z: torch.Tensor, beta: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Each head's (z - c) W_O . r (H,) and the constant part's (c W_O + b_O) . r, for z (H, D) at the
    position and the bias beta (C,) of the norm the values read."""
    H, D = attn.n_heads, attn.d_head
    C = attn.proj.weight.shape[0]
    w, b = attn.qkv.weight.detach().double(), attn.qkv.bias
    c = w[2 * H * D:] @ beta  # (HD, C) @ (C,): W_V beta
    if b is not None:
        c = c + b.detach().double()[2 * H * D:]
    c = c.view(H, D)  # each head's constant value
    w_o = attn.proj.weight.detach().double().view(C, H, D)  # (C, HD) -> (C, H, D)
    heads = torch.einsum("chd,hd,c->h", w_o, z.double() - c, r)
    constant = torch.einsum("chd,hd,c->", w_o, c, r)
    if attn.proj.bias is not None:
        constant = constant + attn.proj.bias.detach().double() @ r
    return heads, float(constant)


@torch.inference_mode()
def encoder_decoder_logit_attribution(model, ids: list[int], target_ids: list[int] | None = None,
                                      answer_id: int | None = None, foil_id: int | None = None,
                                      position: int | None = None, report: Report = _no_report) -> LogitAttribution:
    """Each part's direct effect on logit(answer) - logit(foil) at target position `position` (default the
    last) of source `ids` and its target (module docstring); answer and foil default to the top two
    predictions there."""
    config = model.config
    check_encoder_decoder_attribution(config, ids, target_ids, answer_id, foil_id, position)
    target = [config.decoder_start_id, *(target_ids or [])]
    pos = len(target) - 1 if position is None else position
    L, C, device = config.n_layers, config.d_model, model.device
    at = lambda l, name: f"decoder.blocks.{l}.{name}"
    points = ("hook_resid_pre", "attn.hook_z", "cross_attn.hook_z", "hook_attn_out", "hook_cross_out", "hook_mlp_out")
    final = at(L - 1, "hook_resid_post")
    hooks = Hooks(record={at(l, p) for l in range(L) for p in points} | {final}, progress=report)
    source = torch.tensor([ids], device=device)
    with hooked(model, hooks):
        logits = model(torch.tensor([target[:pos + 1]], device=device), source=source,
                       last_only=True).logits[0, -1].float()
    if answer_id is None or foil_id is None:
        top = torch.topk(logits, 2).indices.tolist()
        answer_id = top[0] if answer_id is None else answer_id
        foil_id = (top[1] if top[0] == answer_id else top[0]) if foil_id is None else foil_id
    got = lambda name: hooks.captured[name][0, pos].double()  # (C,) or (H, D) at the position
    direction, head_bias = unembed_direction(model, answer_id, foil_id)
    gain, beta, centred, scale = frozen_norm(model.decoder_norm, got(final))
    r = _back(gain, centred, direction.double())  # the direction as the final stream sees it
    norm_biases, attention_biases = float(beta @ direction.double()), 0.0
    heads: dict[str, list[list[float]]] = {"decoder": [[]] * L, "cross": [[]] * L}
    mlps = [0.0] * L
    memory_beta = _bias(model.encoder_norm, C, device)  # what the cross values read: the encoder norm's output
    for l in reversed(range(L)):
        block = model.decoder.blocks[l]
        x0 = got(at(l, "hook_resid_pre"))
        u1 = x0 + got(at(l, "hook_attn_out"))  # the sums the post-norm blocks normalise
        x1 = block.ln1(u1.to(model.dtype)).double() if not block.pre_norm else u1
        u2 = x1 + got(at(l, "hook_cross_out"))
        x2 = block.ln_cross(u2.to(model.dtype)).double() if not block.pre_norm else u2
        u3 = x2 + got(at(l, "hook_mlp_out"))

        def through(ln: nn.Module, u: torch.Tensor) -> None:
            """r carried back through a post-norm block's norm at its input u; its bias a part."""
            nonlocal r, norm_biases
            if not block.pre_norm:
                assert isinstance(ln, nn.LayerNorm)  # the family's norms
                g, b, c, _ = frozen_norm(ln, u)
                norm_biases += float(b @ r)
                r = _back(g, c, r)
        through(block.ln2, u3)
        mlps[l] = float(got(at(l, "hook_mlp_out")) @ r)
        through(block.ln_cross, u2)
        cross, constant = _heads(block.cross_attn, got(at(l, "cross_attn.hook_z")), memory_beta, r)
        heads["cross"][l], attention_biases = cross.tolist(), attention_biases + constant
        through(block.ln1, u1)
        if block.pre_norm:  # the values read ln1's output; post-norm: the stream, the last norm's output
            values_beta = _bias(block.ln1, C, device)
        else:
            values_beta = _bias(model.decoder.blocks[l - 1].ln2, C, device) if l else torch.zeros_like(memory_beta)
        own, constant = _heads(block.attn, got(at(l, "attn.hook_z")), values_beta, r)
        heads["decoder"][l], attention_biases = own.tolist(), attention_biases + constant
    token = model.tok_emb(torch.tensor([target[pos]], device=device))[0].double()
    if config.scale_embeddings:
        token = token * math.sqrt(C)
    embedded = got(at(0, "hook_resid_pre"))
    other = {"positions": float((embedded - token) @ r), "attention_biases": attention_biases,
             "norm_biases": norm_biases, "head_bias": head_bias}
    report()
    return {"position": pos, "answer_id": answer_id, "foil_id": foil_id,
            "answer_logit": float(logits[answer_id]), "foil_logit": float(logits[foil_id]),
            "logit_difference": float(logits[answer_id] - logits[foil_id]), "heads": heads, "mlps": mlps,
            "embedding": float(token @ r), "other": sum(other.values()), "other_parts": other, "norm_scale": scale,
            "softcap": None, "capped_logit_difference": None}

"""Where a token is: fixed sinusoids added to the embedding, or rotary angles applied to
queries and keys (learned positions are an nn.Embedding, see embeddings.py).

Shapes: T = positions in this call, B = batch, C = d_model, D = d_head, R = rotary dims
(the first R of each head's D; R = D for Llama, D / 4 for Pythia).

    sinusoidal_table   (P, C) PE(pos, 2i) = sin(pos / 10000^(2i/C)), PE(pos, 2i+1) = cos(...)
    rotary_inv_freq    (R/2,) the rotary frequencies: base^(-2i/R), scaled as the config names
                       ("linear": / factor; "llama3": Llama 3.1's per-band rescaling)
    RotaryEmbedding    positions (T,) or (B, T) -> RotaryAngles(cos, sin, signed_sin), each (T, R) or
                       (B, T, R)
    apply_rotary       (B, H, T, D) queries or keys, rotated by their positions' angles (in
                       float32 inference on the CPU in one C pass: model/native/rotary.c)

Rotary positions (Su et al. 2021) rotate each pair of dims (i, i + R/2) of a query or key by
the angle pos * inv_freq[i] (GPT-NeoX's "rotate half" pairing, which Llama's transformers
checkpoints use too; GPT-J's pairs are (2i, 2i + 1): config.rotary_interleaved), so q . k
depends only on the distance between the two positions. Keys go into the KV cache already
rotated: a cached key never needs its position again.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn

from attnlens.model.config import ModelConfig
from attnlens.model.native import library as native


def sinusoidal_table(n_positions: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)). Computed on
    the CPU whatever the default device (a model built on the meta device for its shapes alone
    would otherwise run these through torch's Python references, 1.5 s of imports)."""
    pos = torch.arange(n_positions, dtype=torch.float64, device="cpu").unsqueeze(1)  # (P, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device="cpu")  # (C/2,)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (P, C/2)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64, device="cpu")
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


def rotary_inv_freq(rotary_dims: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """(R/2,) float32 frequencies base^(-2i/R), with the config's scaling applied.

    "linear" divides every frequency by `factor` (positions stretched by factor). "llama3"
    (Llama 3.1) keeps wavelengths shorter than original_max_position_embeddings /
    high_freq_factor, divides those longer than original / low_freq_factor by `factor`, and
    interpolates smoothly in between. Computed in float32 as transformers computes them, on the
    CPU whatever the default device (as sinusoidal_table).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dims, 2, dtype=torch.int64, device="cpu").float() / rotary_dims))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)  # long waves: / factor
        smooth = (original / wavelen - low) / (high - low)  # 0 at the long end of the band, 1 at the short
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling rope_type {kind!r} is not supported (supported: linear, llama3)")


class RotaryAngles(NamedTuple):
    """cos and sin of every (position, rotary dim): (T, R) shared by the batch, or (B, T, R).

    signed_sin is sin with its first half negated (-sin | sin), made once per forward for every
    layer: rotate_half(x) * sin = roll(x, R/2) * signed_sin, exactly (a negation is exact), in
    one operator instead of three (chunk, neg, cat). None: apply_rotary takes rotate_half."""

    cos: torch.Tensor
    sin: torch.Tensor
    signed_sin: torch.Tensor | None = None
    interleaved: bool = False  # GPT-J: dims (2i, 2i + 1) share angle i (cos and sin laid out so)


class RotaryEmbedding(nn.Module):
    """The angles of rotary positions, computed per call from the positions (no table of the
    whole context: Llama 3.1's 131072 positions would be 64 MB of cos and sin per device).

    inv_freq stays float32 whatever dtype the model is cast to (as transformers keeps it), so a
    bf16 model rotates by the same angles; cos and sin are cast to the queries' dtype.
    """

    def __init__(self, config: ModelConfig, *, theta: float | None = None, scaling: bool = True):
        """The config's angles, or with `theta` another base (Gemma 3's local layers), with or
        without the config's rope_scaling."""
        super().__init__()
        self.rotary_dims = config.rotary_dims
        self._spec = (config.rotary_dims, float(theta if theta is not None else config.rope_theta),
                      config.rope_scaling if scaling else None)
        self.register_buffer("inv_freq", rotary_inv_freq(*self._spec), persistent=False)  # (R/2,)
        self.interleaved = config.rotary_interleaved

    def _apply(self, fn, recurse=True):
        """model.to(dtype) casts every floating buffer: put inv_freq back in float32 (recomputed,
        not rounded through the other dtype) on whatever device it moved to."""
        super()._apply(fn, recurse)
        self.inv_freq = rotary_inv_freq(*self._spec).to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        """positions (T,) or (B, T) int -> RotaryAngles with cos, sin (T, R) or (B, T, R)."""
        freqs = positions[..., None].float() * self.inv_freq  # (..., T, R/2)
        if self.interleaved:  # (..., T, R): dims 2i and 2i + 1 share an angle (GPT-J)
            angles = freqs.repeat_interleave(2, dim=-1)
            return RotaryAngles(angles.cos().to(dtype), angles.sin().to(dtype), None, True)
        angles = torch.cat((freqs, freqs), dim=-1)  # (..., T, R): dims i and i + R/2 share an angle
        sin = angles.sin().to(dtype)
        return RotaryAngles(angles.cos().to(dtype), sin, signed(sin))


def signed(sin: torch.Tensor) -> torch.Tensor:
    """(..., R) sin -> (..., R) -sin | sin: RotaryAngles.signed_sin."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(..., R) -> (..., R): (x1, x2) -> (-x2, x1), the halves being the two dims of each pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """(..., R) -> (..., R): each pair (x_2i, x_2i+1) -> (-x_2i+1, x_2i) (GPT-J's pairing)."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, angles: RotaryAngles) -> torch.Tensor:
    """Rotate the first R dims of (B, H, T, D) queries or keys; the other D - R pass unchanged."""
    cos, sin, signed_sin = angles.cos, angles.sin, angles.signed_sin
    if cos.dim() == 3:  # (B, T, R): each row its own positions -> (B, 1, T, R), the same for every head
        cos, sin = cos[:, None], sin[:, None]
        signed_sin = signed_sin[:, None] if signed_sin is not None else None
    R = cos.shape[-1]
    if angles.interleaved:  # GPT-J: pairs (2i, 2i + 1)
        rot = x[..., :R] * cos + rotate_every_two(x[..., :R]) * sin
        return rot if R == x.shape[-1] else torch.cat((rot, x[..., R:]), dim=-1)
    if R == x.shape[-1]:
        if signed_sin is not None and cos.dim() == 2 and native_rotary(x, cos, signed_sin):
            return rotary_in_c(x, cos, signed_sin)
        if signed_sin is not None:  # (x1, x2) -> (x2, x1) in one operator, signs from signed_sin
            return x * cos + x.roll(R // 2, dims=-1) * signed_sin
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :R], x[..., R:]  # partial rotary (GPT-NeoX's rotary_pct)
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def native_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> bool:
    """Whether apply_rotary takes model/native/rotary.c: float32 inference on the CPU, dims contiguous,
    angles (T, D) contiguous, and the kernels built here."""
    return (x.device.type == "cpu" and x.dtype == cos.dtype == signed_sin.dtype == torch.float32
            and not torch.is_grad_enabled() and x.stride(-1) == 1 and cos.is_contiguous()
            and signed_sin.is_contiguous() and native.available()[0])


def rotary_in_c(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + x.roll(D / 2) * signed_sin in one pass (the same floats): x (B, H, T, D), angles
    (T, D) -> (B, H, T, D), a view of a (B, T, H, D) tensor (the layout torch's operators give the
    fused projection's view)."""
    B, H, T, D = x.shape
    out = torch.empty(B, T, H, D, dtype=x.dtype)  # (B, T, H, D)
    lib = native.load()
    for b in range(B):
        xb = x[b]  # (H, T, D)
        lib.rotary(xb.data_ptr(), xb.stride(0), xb.stride(1), H, T, D, cos.data_ptr(), signed_sin.data_ptr(),
                   out[b].data_ptr())
    return out.transpose(1, 2)  # (B, H, T, D)

"""Compute full attention maps and pack them compactly for the browser.

`json` is nested lists. `f16` and `u8` are the same [layers][heads][T][T] array, row-major,
as base64 of little-endian float16, or of bytes with value = byte * scale (scale = 1/255).
With packing="tril" each T x T matrix keeps only the cells on or below the diagonal (row
i has i + 1 values), since causal attention is zero above it: about half the bytes.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

U8_SCALE = 1.0 / 255.0


def attention_maps(model, ids: list[int], layers: list[int], heads: list[int]) -> np.ndarray:
    """(len(layers), len(heads), T, T) float32 probabilities; runs on the engine thread."""
    device = model.tok_emb.weight.device
    inputs = torch.tensor([ids], dtype=torch.long, device=device)
    attn = model(inputs, return_attention=True, last_only=True).attentions
    stacked = torch.stack([attn[i][0] for i in layers])  # (L', H, T, T)
    return stacked[:, heads].float().cpu().numpy()


def tril_pack(a: np.ndarray) -> np.ndarray:
    """Keep the lower triangle (diagonal included) of every T x T matrix, row by row."""
    T = a.shape[-1]
    rows, cols = np.tril_indices(T)
    return a[..., rows, cols]


def encode(a: np.ndarray, fmt: str, packing: str = "full") -> dict:
    """Fields of AttentionResponse for the array in the requested format."""
    shape = list(a.shape)
    if fmt == "json":
        return {"shape": shape, "attention": np.round(a, 6).tolist()}
    flat = tril_pack(a) if packing == "tril" else a
    if fmt == "f16":
        raw = np.ascontiguousarray(flat, dtype="<f2").tobytes()
        return {"shape": shape, "data": base64.b64encode(raw).decode("ascii"), "dtype": "float16",
                "packing": packing}
    q = np.clip(np.rint(flat / U8_SCALE), 0, 255).astype(np.uint8)
    return {"shape": shape, "data": base64.b64encode(q.tobytes()).decode("ascii"), "dtype": "uint8",
            "packing": packing, "scale": U8_SCALE}


def decode(fields: dict) -> np.ndarray:
    """The inverse of encode (for tests and Python clients): a float32 array of `shape`."""
    shape = fields["shape"]
    if fields.get("attention") is not None:
        return np.asarray(fields["attention"], dtype=np.float32)
    raw = base64.b64decode(fields["data"])
    if fields["dtype"] == "float16":
        flat = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    else:
        flat = np.frombuffer(raw, dtype=np.uint8).astype(np.float32) * float(fields["scale"])
    if fields.get("packing") == "tril":
        T = shape[-1]
        out = np.zeros(shape, dtype=np.float32)
        rows, cols = np.tril_indices(T)
        out[..., rows, cols] = flat.reshape(*shape[:-2], len(rows))
        return out
    return flat.reshape(shape)

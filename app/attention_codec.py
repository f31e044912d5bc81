"""Compute full attention maps and pack them compactly for the browser.

`json` is nested lists (with packing="tril", rows of growing length). `f16` and `u8` are
the same [layers][heads][T][T] array, row-major, as base64 of little-endian float16, or of
bytes with value = byte * scale (scale = 1/255). With packing="tril" each T x T matrix
keeps only the cells on or below the diagonal (row i has i + 1 values), since causal
attention is zero above it: about half the bytes.
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
    if fmt == "json":  # numpy arrays, written as nested lists by app.answers.encode_json
        rounded = np.round(a.astype(np.float32, copy=False), 6)
        if packing == "tril":  # row i of each matrix keeps its first i + 1 values
            nested = [[[row[: i + 1] for i, row in enumerate(m)] for m in layer] for layer in rounded]
            return {"shape": shape, "attention": nested, "packing": packing}
        return {"shape": shape, "attention": rounded, "packing": packing}
    flat = tril_pack(a) if packing == "tril" else a
    if fmt == "f16":
        raw = np.ascontiguousarray(flat, dtype="<f2").tobytes()
        return {"shape": shape, "data": base64.b64encode(raw).decode("ascii"), "dtype": "float16",
                "packing": packing}
    q = np.clip(np.rint(flat / U8_SCALE), 0, 255).astype(np.uint8)
    return {"shape": shape, "data": base64.b64encode(q.tobytes()).decode("ascii"), "dtype": "uint8",
            "packing": packing, "scale": U8_SCALE}


def encoded_bytes(shape: list[int], fmt: str, packing: str) -> int:
    """An upper bound on the bytes `encode` and its JSON answer take for an array of `shape`
    (the float32 maps, the encoded field, and per-token overhead): what an answer claims."""
    *outer, T, _ = shape
    mats = int(np.prod(outer)) if outer else 1
    cells = mats * (T * (T + 1) // 2 if packing == "tril" else T * T)
    per_cell = {"json": 10.0, "f16": 2 + 8 / 3, "u8": 1 + 4 / 3}[fmt]  # text, or raw + base64
    return int(mats * T * T * 4 + cells * per_cell + mats * T * 2 + T * 64 + 4096)


def decode(fields: dict) -> np.ndarray:
    """The inverse of encode (for tests and Python clients): a float32 array of `shape`."""
    shape = fields["shape"]
    if fields.get("attention") is not None:
        if fields.get("packing") == "tril":
            out = np.zeros(shape, dtype=np.float32)
            for li, layer in enumerate(fields["attention"]):
                for hi, matrix in enumerate(layer):
                    for i, row in enumerate(matrix):
                        out[li, hi, i, : i + 1] = row
            return out
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

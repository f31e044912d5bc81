"""The wire format of attention maps (POST /attention), both ways, with numpy alone.

`json` is nested lists (with packing="tril", rows of growing length). `f16` and `u8` are
the same [layers][heads][rows][cols] array, row-major, as base64 of little-endian float16, or of
bytes with value = byte * scale (scale = 1/255). With packing="tril" each T x T matrix
keeps only the cells on or below the diagonal (row i has i + 1 values), since causal
attention is zero above it: about half the bytes.

A reduced answer (top_k) also has key `positions` [layers][heads][rows][k]: json nested lists,
otherwise base64 of little-endian int32 (`positions_dtype` "int32"); -1 marks no key.

The server encodes with it (attnlens.app.serving.attention_codec) and the client decodes with it, so
the format is written once and a client install needs no torch.
"""

from __future__ import annotations

import base64

import numpy as np

U8_SCALE = 1.0 / 255.0
FORMATS = ("json", "f16", "u8")
PACKINGS = ("full", "tril")
# The largest difference between a decoded map and the exact one, per format: json is rounded to
# 6 decimals; float16 keeps 11 significant bits (2^-12 of values below 1, with margin); u8 is
# rounded to the nearest step of 1/255.
PRECISION = {"json": 5e-7, "f16": 2.5e-4, "u8": U8_SCALE / 2}


def tril_pack(a: np.ndarray) -> np.ndarray:
    """Keep the lower triangle (diagonal included) of every T x T matrix, row by row."""
    T = a.shape[-1]
    rows, cols = np.tril_indices(T)
    return a[..., rows, cols]


def encode(a: np.ndarray, fmt: str, packing: str = "full") -> dict:
    """Fields of an /attention answer (shape, attention | data, dtype, packing, scale) for `a`."""
    shape = list(a.shape)
    if fmt == "json":  # numpy arrays, written as nested lists by the server's JSON encoder
        rounded = np.round(a.astype(np.float32, copy=False), 6)
        if packing == "tril":  # row i of each matrix keeps its first i + 1 values
            nested = [[[row[: i + 1] for i, row in enumerate(m)] for m in layer] for layer in rounded]
            return {"shape": shape, "attention": nested, "packing": packing}
        return {"shape": shape, "attention": rounded, "packing": packing}
    flat = tril_pack(a) if packing == "tril" else a
    if fmt == "u8" and a.dtype == np.uint8:  # already in steps of U8_SCALE (attnlens.app keeps maps so)
        return {"shape": shape, "data": base64.b64encode(np.ascontiguousarray(flat).tobytes()).decode("ascii"),
                "dtype": "uint8", "packing": packing, "scale": U8_SCALE}
    if fmt == "f16":
        raw = np.ascontiguousarray(flat, dtype="<f2").tobytes()
        return {"shape": shape, "data": base64.b64encode(raw).decode("ascii"), "dtype": "float16",
                "packing": packing}
    q = np.clip(np.rint(flat / U8_SCALE), 0, 255).astype(np.uint8)
    return {"shape": shape, "data": base64.b64encode(q.tobytes()).decode("ascii"), "dtype": "uint8",
            "packing": packing, "scale": U8_SCALE}


def decode(fields: dict) -> np.ndarray:
    """The inverse of encode: a float32 array of `shape`, whatever the format and packing."""
    shape = [int(n) for n in fields["shape"]]
    packing = fields.get("packing") or "full"
    if packing not in PACKINGS:
        raise ValueError(f"unknown packing {packing!r}")
    if fields.get("attention") is not None:
        if packing == "tril":
            out = np.zeros(shape, dtype=np.float32)
            for li, layer in enumerate(fields["attention"]):
                for hi, matrix in enumerate(layer):
                    for i, row in enumerate(matrix):
                        out[li, hi, i, : i + 1] = row
            return out
        return np.asarray(fields["attention"], dtype=np.float32).reshape(shape)
    raw = base64.b64decode(fields["data"])
    if fields["dtype"] == "float16":
        flat = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    elif fields["dtype"] == "uint8":
        flat = np.frombuffer(raw, dtype=np.uint8).astype(np.float32) * np.float32(fields["scale"])
    else:
        raise ValueError(f"unknown dtype {fields['dtype']!r}")
    if packing == "tril":
        T = shape[-1]
        out = np.zeros(shape, dtype=np.float32)
        rows, cols = np.tril_indices(T)
        out[..., rows, cols] = flat.reshape(*shape[:-2], len(rows))
        return out
    return flat.reshape(shape)


def encode_positions(p: np.ndarray, fmt: str) -> dict:
    """A top_k answer's key positions (int, -1 = none) in the answer's format."""
    if fmt == "json":
        return {"positions": np.asarray(p, dtype=np.int32)}
    raw = np.ascontiguousarray(p, dtype="<i4").tobytes()
    return {"positions": base64.b64encode(raw).decode("ascii"), "positions_dtype": "int32"}


def decode_positions(fields: dict) -> np.ndarray | None:
    """The inverse of encode_positions (None when the fields hold none), shaped as `shape`."""
    positions = fields.get("positions")
    if positions is None:
        return None
    shape = [int(n) for n in fields["shape"]]
    if isinstance(positions, str):
        return np.frombuffer(base64.b64decode(positions), dtype="<i4").astype(np.int32).reshape(shape)
    return np.asarray(positions, dtype=np.int32).reshape(shape)

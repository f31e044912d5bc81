"""Pack attention maps compactly for the browser (the maps are computed on the model's side:
model/analysis/attention_maps.py).

The wire format itself (json, f16, u8; packing full or tril) is attnlens.codec: numpy alone,
so the Python client decodes with the very code the server encodes with. It is re-exported
here (encode, decode, tril_pack, U8_SCALE) for the server's modules and tests.
"""

from __future__ import annotations

import numpy as np

from attnlens.codec import U8_SCALE, decode, encode, encode_positions, tril_pack  # noqa: F401  (the server's wire format)


def encoded_bytes(shape: list[int], fmt: str, packing: str) -> int:
    """An upper bound on the bytes `encode` and its JSON answer take for an array of `shape`
    (the float32 maps, the encoded field, and per-token overhead): what an answer claims."""
    *outer, T, _ = shape
    mats = int(np.prod(outer)) if outer else 1
    cells = mats * (T * (T + 1) // 2 if packing == "tril" else T * T)
    per_cell = {"json": 10.0, "f16": 2 + 8 / 3, "u8": 1 + 4 / 3}[fmt]  # text, or raw + base64
    return int(mats * T * T * 4 + cells * per_cell + mats * T * 2 + T * 64 + 4096)

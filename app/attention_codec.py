"""Compute full attention maps and pack them compactly for the browser.

The wire format itself (json, f16, u8; packing full or tril) is attnlens.codec: numpy alone,
so the Python client decodes with the very code the server encodes with. It is re-exported
here (encode, decode, tril_pack, U8_SCALE) for the server's modules and tests.
"""

from __future__ import annotations

import numpy as np
import torch

from attnlens.codec import U8_SCALE, decode, encode, encode_positions, tril_pack  # noqa: F401  (the server's wire format)


def attention_maps(model, ids: list[int], layers: list[int], heads: list[int]) -> np.ndarray:
    """(len(layers), len(heads), T, T) float32 probabilities; runs on the engine thread."""
    device = model.tok_emb.weight.device
    inputs = torch.tensor([ids], dtype=torch.long, device=device)
    attn = model(inputs, return_attention=True, last_only=True).attentions
    stacked = torch.stack([attn[i][0] for i in layers])  # (L', H, T, T)
    return stacked[:, heads].float().cpu().numpy()


def encoded_bytes(shape: list[int], fmt: str, packing: str) -> int:
    """An upper bound on the bytes `encode` and its JSON answer take for an array of `shape`
    (the float32 maps, the encoded field, and per-token overhead): what an answer claims."""
    *outer, T, _ = shape
    mats = int(np.prod(outer)) if outer else 1
    cells = mats * (T * (T + 1) // 2 if packing == "tril" else T * T)
    per_cell = {"json": 10.0, "f16": 2 + 8 / 3, "u8": 1 + 4 / 3}[fmt]  # text, or raw + base64
    return int(mats * T * T * 4 + cells * per_cell + mats * T * 2 + T * 64 + 4096)

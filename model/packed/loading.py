"""Packed weights in a checkpoint folder, and a model served with them.

A GGUF import (model/interop/convert.py: packed_state, write_packed) writes, beside the float32 `model.safetensors`,
`packed.safetensors`: every weight matrix whose parts the file holds in Q4_0, Q4_1 or Q8_0, as
those blocks (uint8 (rows, row bytes), our names, fused as the float32 ones are: q|k|v, gate|up;
parts in different formats are not packed), each tensor's format in the file's metadata.

`load_checkpoint(..., packed=True)` (model/checkpoint.py) then reads the float32 file for the
other tensors only (norms, biases, a float32 head) and puts a PackedLinear / PackedEmbedding in
place of each packed module (`pack_model`): the float32 copy of a packed matrix is never made.

    read_packed    its tensors and formats
    pack_model     swap the modules of a model for packed ones
    describe       {"Q4_1": 120, "Q8_0": 1}: how many packed matrices of each format a model holds
    file_formats   the same counts from packed.safetensors' header alone
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from attnlens.model.packed import kernel
from attnlens.model.packed.modules import PackedEmbedding, PackedLinear, PackedMatrix

PACKED_FILE = "packed.safetensors"


def read_packed(path: Path) -> dict[str, tuple[torch.Tensor, str]]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            formats = f.metadata() or {}
            out = {name: (f.get_tensor(name), formats.get(name, "")) for name in f.keys()}
    except Exception as e:  # safetensors raises SafetensorError / OSError on bad files
        raise ValueError(f"{path}: corrupt or truncated safetensors file ({e})") from e
    bad = sorted(n for n, (_, fmt) in out.items() if fmt not in kernel.FORMATS)
    if bad:
        raise ValueError(f"{path}: tensor {bad[0]} has no packed format in the file's metadata")
    return out


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def pack_model(model: nn.Module, state: dict[str, tuple[torch.Tensor, str]], *, tied: bool) -> None:
    """Put a PackedLinear (its bias kept) or PackedEmbedding in place of each module whose
    `<module>.weight` is in `state`; with `tied`, a packed embedding is the head too. A tensor
    that fits no module is a ValueError naming it."""
    for name, (data, fmt) in state.items():
        path = name.removesuffix(".weight")
        try:
            old = model.get_submodule(path)
        except AttributeError as e:
            raise ValueError(f"{PACKED_FILE}: tensor {name} names no module of this model") from e
        if isinstance(old, nn.Embedding):
            cols = old.embedding_dim
        elif isinstance(old, nn.Linear):
            cols = old.in_features
        else:
            raise ValueError(f"{PACKED_FILE}: {name} is the weight of a {type(old).__name__}, not packed")
        try:
            packed = PackedMatrix(data, fmt, cols)
        except ValueError as e:
            raise ValueError(f"{PACKED_FILE}: tensor {name}: {e}") from e
        if packed.rows != old.weight.shape[0]:
            raise ValueError(f"{PACKED_FILE}: tensor {name} has {packed.rows} rows, the model {old.weight.shape[0]}")
        if isinstance(old, nn.Embedding):
            _set_module(model, path, PackedEmbedding(packed))
        else:
            _set_module(model, path, PackedLinear(packed, old.bias))
    emb = getattr(model, "tok_emb", None)
    if tied and isinstance(emb, PackedEmbedding) and "lm_head.weight" not in state and hasattr(model, "lm_head"):
        model.lm_head = PackedLinear(emb.packed)  # the tied head reads the embedding's blocks


def describe(model: nn.Module) -> dict[str, int]:
    """How many packed matrices of each format the model holds (a tied pair counted once)."""
    seen: dict[int, str] = {}
    for m in model.modules():
        if isinstance(m, (PackedLinear, PackedEmbedding)):
            seen[id(m.packed)] = m.packed.fmt
    counts: dict[str, int] = {}
    for fmt in seen.values():
        counts[fmt] = counts.get(fmt, 0) + 1
    return counts


def file_formats(path: Path) -> dict[str, int]:
    """describe's counts for the model packed.safetensors at `path` would make (read from its header)."""
    with safe_open(str(path), framework="pt", device="cpu") as f:
        formats = list((f.metadata() or {}).values())
    return {fmt: formats.count(fmt) for fmt in sorted(set(formats))}


def label(counts: dict[str, int]) -> str:
    """'packed: Q4_1 x120, Q8_0 x1'."""
    return "packed: " + ", ".join(f"{fmt} x{n}" for fmt, n in sorted(counts.items()))

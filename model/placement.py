"""Pick the device and dtype, and load the checkpoint the service will serve (the server for its
runners, an engine process for its model: app/engine/ reads it from here, not from the app)."""

from __future__ import annotations

import logging

import torch

from attnlens.model import Checkpoint, load_checkpoint
from attnlens.model.checkpoint import load_config
from attnlens.model.families import family_named

log = logging.getLogger("attnlens.loader")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(setting: str) -> torch.device:
    """`auto` = CUDA when available, else CPU; anything else is passed to torch as is."""
    if setting == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.info("device auto -> %s (CUDA %s)", device, "available" if device.type == "cuda" else "not available")
        return device
    device = torch.device(setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"ATTNLENS_DEVICE={setting} but CUDA is not available")
    return device


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """`auto` = bfloat16 on CUDA, float32 on CPU (a model with packed blocks keeps them there:
    packed_or_why); `packed` computes in float32 (its weights are blocks)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if setting == "packed":
        if device.type != "cpu":
            raise RuntimeError(f"ATTNLENS_DTYPE=packed runs on the CPU only (ATTNLENS_DEVICE resolved to {device})")
        return torch.float32
    return DTYPES[setting]


def packed_or_why(model_dir, dtype_setting: str, device: torch.device) -> tuple[bool, str | None]:
    """Whether the model is served with its packed blocks (model/packed/): ATTNLENS_DTYPE=packed, or
    auto on the CPU, when the checkpoint has them (a GGUF import's packed.safetensors) and the C
    kernels build here. (False, why) otherwise; why is None when there is nothing to say (another
    dtype, CUDA, auto on a model without blocks). Logs nothing: the loader says it once."""
    from pathlib import Path

    from attnlens.model.packed import kernel
    from attnlens.model.packed.loading import PACKED_FILE

    if dtype_setting not in ("packed", "auto") or device.type != "cpu":
        return False, None
    if not (Path(model_dir) / PACKED_FILE).is_file():
        why = "has no packed weights (only a GGUF import has them): served in float32"
        return False, why if dtype_setting == "packed" else None
    ok, reason = kernel.available()
    return ok, None if ok else f"served in float32, not packed: {reason}"


def load_for_serving(model_dir, device_setting: str, dtype_setting: str, *, engine_process: bool = False
                     ) -> Checkpoint:
    """The checkpoint to serve. With `engine_process`, a model that generates is served by an engine
    process that loads its weights itself: here only its shapes are built (on the meta device), so
    the weights are held once."""
    device = resolve_device(device_setting)
    dtype = resolve_dtype(dtype_setting, device)
    weights = not (engine_process and family_named(load_config(model_dir).family).generation is not None)
    packed, why = packed_or_why(model_dir, dtype_setting, device) if weights else (False, None)
    if why is not None:  # a warning when packed was asked for
        (log.warning if dtype_setting == "packed" else log.info)("%s: %s", model_dir, why)
    log.info("loading checkpoint %s onto %s as %s%s", model_dir, device,
             "packed blocks" if packed else str(dtype).removeprefix("torch."),
             "" if weights else " (its shapes: its engine process holds the weights)")
    return load_checkpoint(model_dir, device=device, dtype=dtype, weights=weights, packed=packed)


def weights_label(ckpt: Checkpoint, dtype_setting: str) -> str:
    """How the served weights are held, for GET /model: "float32" (the dtype), or "packed: Q4_1 x120,
    Q8_0 x1" (the packed matrices by format), also for a model whose engine process holds them."""
    from attnlens.model.packed.loading import PACKED_FILE, describe, file_formats, label

    if counts := describe(ckpt.model):
        return label(counts)
    on_meta = next(ckpt.model.parameters()).is_meta  # its engine process loaded it, by the same settings
    if on_meta and ckpt.path is not None and packed_or_why(ckpt.path, dtype_setting, ckpt.weights_device)[0]:
        return label(file_formats(ckpt.path / PACKED_FILE))
    return str(ckpt.model.dtype).removeprefix("torch.")

"""Pick the device and dtype, and load the checkpoint the service will serve."""

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
    """`auto` = bfloat16 on CUDA, float32 on CPU."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[setting]


def load_for_serving(model_dir, device_setting: str, dtype_setting: str, *, engine_process: bool = False
                     ) -> Checkpoint:
    """The checkpoint to serve. With `engine_process`, a model that generates is served by an engine
    process that loads its weights itself: here only its shapes are built (on the meta device), so
    the weights are held once."""
    device = resolve_device(device_setting)
    dtype = resolve_dtype(dtype_setting, device)
    weights = not (engine_process and family_named(load_config(model_dir).family).generation is not None)
    log.info("loading checkpoint %s onto %s as %s%s", model_dir, device, str(dtype).removeprefix("torch."),
             "" if weights else " (its shapes: its engine process holds the weights)")
    return load_checkpoint(model_dir, device=device, dtype=dtype, weights=weights)

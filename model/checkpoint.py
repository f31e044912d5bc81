"""Checkpoint directories: config.json, model.safetensors, tokenizer.json[, train_report.json].

tokenizer_config.json and special_tokens_map.json sit beside tokenizer.json so that
`transformers.AutoTokenizer.from_pretrained(dir)` (as evaluation harnesses call it) reads
the same tokenizer with bos/eos set. attnlens reads them too: an imported checkpoint's
special tokens, add_bos_token and chat_template live there (and, when ids other than EOS end
a generation, in generation_config.json), as in the transformers directory it came from.

A loaded model is in eval mode; its Linear weights stay row-major (out, in), the layout
model/parts/linear.py's CPU product reads fastest.

Loading never unpickles anything. Every problem is reported as a CheckpointError that
names the file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from attnlens.model.config import ConfigError, ModelConfig
from attnlens.model.families import build_model
from attnlens.model.families.decoder import Transformer
from attnlens.model.packed.loading import PACKED_FILE, pack_model, read_packed
from attnlens.model.tokenizer import Tokenizer
from attnlens.model.weight_arena import gather

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
REPORT_FILE = "train_report.json"


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded; the message names the file."""


@dataclass
class Checkpoint:
    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path | None = None
    report: dict[str, Any] | None = field(default=None)
    # where the weights are: the model's own device, or for a checkpoint loaded without its
    # weights (load_checkpoint(weights=False): the model on the meta device, its weights held by an
    # engine process) the device that process holds them on
    device: torch.device | None = None

    @property
    def weights_device(self) -> torch.device:
        return self.device if self.device is not None else next(self.model.parameters()).device


def model_state(model: Transformer, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors to store: parameters and persistent buffers, a tied head only once."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_embeddings:
            continue
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        state[name] = t.contiguous().cpu()
    return state


def save_checkpoint(
    out_dir: str | Path,
    model: Transformer,
    tokenizer: Tokenizer,
    *,
    report: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a checkpoint directory. `dtype` (e.g. torch.float16) shrinks the weights file."""
    return write_checkpoint(out_dir, model.config, model_state(model, dtype), tokenizer, report=report)


def write_checkpoint(out_dir: str | Path, config: ModelConfig, state: dict[str, torch.Tensor], tokenizer: Tokenizer,
                     *, report: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint directory from tensors already named as `model_state` names them
    (an import converts a transformers checkpoint without building the model)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / PACKED_FILE).unlink(missing_ok=True)  # blocks of an earlier import would not match these weights
    config.save(out / CONFIG_FILE)
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp),
              metadata={"format": "pt", "producer": "attnlens"})
    readable_by_all(tmp)
    tmp.replace(out / WEIGHTS_FILE)  # never leave a half-written weights file behind
    tokenizer.save(out / TOKENIZER_FILE)
    for name, data in tokenizer.transformers_files(config.context_length).items():
        (out / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if report is not None:
        (out / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return out


def readable_by_all(path: Path) -> None:
    """Give a file safetensors wrote (owner-only, 0600) the mode the umask gives any new file: a
    cache or a checkpoint made by one user is read by the server running as another (the image)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


class _NoRandomInit(TorchFunctionMode):
    """Building a model whose every parameter the weights file then overwrites: its random
    initialisation (normal_, uniform_) is skipped, as transformers' from_pretrained skips it.
    Nothing else changes: buffers (rotary frequencies, a sinusoidal table) are computed as always.
    For SmolLM2 that initialisation was 1.7 of the 1.85 s a load took."""

    init = torch.nn.init
    SKIPPED = {torch.Tensor.normal_, torch.Tensor.uniform_, init.normal_, init.uniform_, init.trunc_normal_,
               init.kaiming_uniform_, init.kaiming_normal_, init.xavier_uniform_, init.xavier_normal_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


def state_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor `model_state` stores for this config, from a model
    built on the meta device (no memory, no initialisation: cheap for a model of any size)."""
    return _stored_shapes(_shapes_only(config), config)


def _shapes_only(config: ModelConfig):
    """The model on the meta device, its initialisation skipped (on meta, torch runs normal_ through
    its Python reference: 1.5 s for SmolLM2's embedding)."""
    with torch.device("meta"), _NoRandomInit():
        return build_model(config)


def _stored_shapes(model, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    tied = getattr(config, "tie_embeddings", False)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()
            if not (name == "lm_head.weight" and tied)}


def _require(path: Path) -> Path:
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing")
    return path


def load_config(ckpt_dir: str | Path) -> ModelConfig:
    """config.json of a checkpoint directory (the first file a load reads: a directory that is not
    there is said to be so here)."""
    if not Path(ckpt_dir).is_dir():
        raise CheckpointError(f"{ckpt_dir}: checkpoint directory does not exist")
    path = _require(Path(ckpt_dir) / CONFIG_FILE)
    try:
        return ModelConfig.from_json(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    except (ConfigError, TypeError) as e:
        raise CheckpointError(f"{path}: invalid model config ({e})") from e


def load_tokenizer(ckpt_dir: str | Path) -> Tokenizer:
    """tokenizer.json with the special tokens and chat template of tokenizer_config.json."""
    path = _require(Path(ckpt_dir) / TOKENIZER_FILE)
    try:
        return Tokenizer.from_dir(Path(ckpt_dir))
    except ValueError as e:  # a tokenizer_config.json / special_tokens_map.json that is not JSON
        raise CheckpointError(str(e)) from e
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise CheckpointError(f"{path}: cannot be read as a tokenizer ({e})") from e


def read_tensors(path: Path, *, skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
    _require(path)
    try:
        tensors = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in skip:
                    tensors[name] = f.get_tensor(name)
        return tensors
    except Exception as e:  # safetensors raises SafetensorError / OSError on bad files
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from e


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape from a safetensors file's header, reading no tensor data
    (a file cut short or not safetensors at all is a CheckpointError, as for read_tensors)."""
    _require(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as e:  # safetensors raises SafetensorError / OSError on bad files
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({e})") from e


def check_weights(want: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]], path: Path) -> None:
    """That the file's tensors (`got`: name -> shape) are exactly the ones the model stores (`want`)."""
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:8])}")
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensor(s) {', '.join(unexpected[:8])}")
    for name, shape in want.items():
        if tuple(got[name]) != tuple(shape):
            raise CheckpointError(
                f"{path}: tensor {name} has shape {list(got[name])} but config.json implies {list(shape)}"
            )


def load_weights(model: Transformer, path: Path, *, skip: Collection[str] = ()) -> None:
    """Every tensor of the weights file into the model, all names and shapes checked first; those
    in `skip` are checked but not read (their modules are about to be replaced)."""
    expected = model_state(model)
    check_weights({k: tuple(v.shape) for k, v in expected.items()}, read_shapes(path), path)
    tensors = read_tensors(path, skip=skip)
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()}, strict=False)


def load_report(ckpt_dir: str | Path) -> dict[str, Any] | None:
    path = Path(ckpt_dir) / REPORT_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e


def load_checkpoint(
    ckpt_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: bool = True,
    packed: bool = False,
) -> Checkpoint:
    """The checkpoint in `ckpt_dir`, its model on `device` in `dtype`. `weights=False`: the model's
    shapes alone, on the meta device (no memory), for a process that hands every model call to
    another that holds the weights (the server beside its engine processes). `packed`: the
    matrices in packed.safetensors (a GGUF import's Q4_0 / Q4_1 / Q8_0 blocks) stay in their
    blocks (model/packed/), on the CPU in float32 only; a folder without that file loads as usual."""
    ckpt = Path(ckpt_dir)
    config = load_config(ckpt)  # says so if the directory is not there
    tokenizer = load_tokenizer(ckpt)
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{ckpt / TOKENIZER_FILE}: tokenizer has {tokenizer.vocab_size} tokens but "
            f"config.json says vocab_size={config.vocab_size}"
        )
    try:
        if weights:
            with _NoRandomInit():  # load_weights fills every parameter
                model = build_model(config)
        else:
            model = _shapes_only(config)
    except ValueError as e:
        raise CheckpointError(f"{ckpt / CONFIG_FILE}: {e}") from e
    if not weights:  # the file is still checked (its header: names and shapes), so a bad one fails here
        check_weights(_stored_shapes(model, config), read_shapes(ckpt / WEIGHTS_FILE), ckpt / WEIGHTS_FILE)
        model.to(dtype=dtype).eval()
        return Checkpoint(model=model, tokenizer=tokenizer, config=config, path=ckpt, report=load_report(ckpt),
                          device=torch.device(device))
    packed_path = ckpt / PACKED_FILE
    if packed and packed_path.is_file():
        if torch.device(device).type != "cpu" or dtype != torch.float32:
            raise CheckpointError(f"{packed_path}: packed weights are served on the CPU in float32, "
                                  f"not on {device} in {str(dtype).removeprefix('torch.')}")
        try:
            state = read_packed(packed_path)
            load_weights(model, ckpt / WEIGHTS_FILE, skip=set(state))
            pack_model(model, state, tied=getattr(config, "tie_embeddings", False))
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        gather(model)
        return Checkpoint(model=model.eval(), tokenizer=tokenizer, config=config, path=ckpt, report=load_report(ckpt))
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        # before the weights are read, which then go straight into the arena: load_weights writes every
        # parameter (check_weights: the file holds them all), so nothing is copied there first
        gather(model, values=False)
    load_weights(model, ckpt / WEIGHTS_FILE)
    model.to(device=device, dtype=dtype).eval()
    # Linear weights stay row-major (out, in): model/parts/linear.py takes W x^T from that layout
    return Checkpoint(model=model, tokenizer=tokenizer, config=config, path=ckpt, report=load_report(ckpt))

"""`attnlens import-hf` and `export-hf` for every registered architecture
(model/interop/architectures): pick the architecture, then convert by its declarations.

Import reads a transformers directory already on disk (nothing is downloaded, ever):
config.json -> the architecture (by its `architectures` class, else its model_type) -> our
ModelConfig; the weights (model.safetensors, a sharded index or pytorch_model.bin) -> our
names by the architecture's rules, every tensor's shape checked against the config before
anything is written; tokenizer.json with its special tokens, chat template and stop ids;
generation_config.json (stop ids, recommended sampling) copied beside them.
The weights keep their dtype (a bf16 source stays bf16 on disk) and the model is never built
to convert it, so a 7B model converts without 28 GB of float32.

Export writes the architecture the checkpoint was imported from (config.architecture), else
the first registered one that can express it, or the one named.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from attnlens.model.checkpoint import CheckpointError, load_checkpoint, readable_by_all, state_shapes, write_checkpoint
from attnlens.model.config import ModelConfig
from attnlens.model.generation_config import copy_generation_config
from attnlens.model.interop.architectures import ARCHITECTURES, Architecture
from attnlens.model.interop.hf import read_hf_config, read_hf_weights, write_hf_dir, write_json
from attnlens.model.packed.kernel import BLOCK_BYTES
from attnlens.model.packed.loading import PACKED_FILE
from attnlens.model.tokenizer import Tokenizer


def supported() -> str:
    return ", ".join(a.hf_class for a in ARCHITECTURES)


def find_for_import(data: dict[str, Any], path: Path) -> Architecture:
    """The architecture of a transformers config.json: the one whose class `architectures`
    names, else the one of its model_type; GPT-2 when it names neither (the oldest GPT-2 files).
    Anything else is refused, naming it and what is supported."""
    classes = data.get("architectures") or []
    model_type = data.get("model_type")
    if not isinstance(classes, list):
        classes = []
    for arch in ARCHITECTURES:
        if arch.hf_class in classes:
            return arch
    named = f"architecture {classes[0]!r}" if classes else f"model_type {model_type!r}"
    for arch in ARCHITECTURES:
        if model_type == arch.model_type:
            if not classes or arch.also_accepts is None or any(c in arch.also_accepts for c in classes):
                return arch
            raise CheckpointError(f"{path}: {named} is not supported (a {arch.title} checkpoint is "
                                  f"imported as {arch.hf_class}); supported: {supported()}")
    if model_type is None and not classes:
        return next(a for a in ARCHITECTURES if a.name == "gpt2")
    raise CheckpointError(f"{path}: {named}"
                          + (f" (model_type {model_type!r})" if classes and model_type else "")
                          + f" is not supported; supported: {supported()}")


def import_checkpoint(src_dir: str | Path, out_dir: str | Path, *, context_length: int | None = None,
                      progress=None) -> tuple[Path, Architecture]:
    """Convert the transformers directory (or GGUF file) `src_dir` into an attnlens checkpoint at
    `out_dir`. `progress(done, total)`: called per tensor read from a GGUF file."""
    src = Path(src_dir)
    if src.is_file() or src.suffix == ".gguf":
        return import_gguf(src, Path(out_dir), context_length=context_length, progress=progress)
    data, config_path = read_hf_config(src)
    arch = find_for_import(data, config_path)
    if arch.import_dir is not None:
        out = arch.import_dir(src, Path(out_dir), context_length)
    else:
        config = arch.config_from_hf(data, config_path, context_length)
        tokenizer = read_tokenizer(src, data)
        if tokenizer.vocab_size > config.vocab_size:
            raise CheckpointError(f"{src}: tokenizer has {tokenizer.vocab_size} tokens but config.json says "
                                  f"vocab_size={config.vocab_size}")
        tensors, weights_path = read_hf_weights(src)
        state = state_from_rules(arch, config, tensors, weights_path)
        out = write_checkpoint(out_dir, config, state, tokenizer)
    try:  # its recommended sampling (and every other field) comes along: model/generation_config.py
        copy_generation_config(src, out)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    return out, arch


def import_gguf(src: Path, out_dir: Path, *, context_length: int | None = None, progress=None
                ) -> tuple[Path, Architecture]:
    """A GGUF file through the same converter: its metadata as config.json, its dequantized
    tensors under transformers' names, its tokenizer rebuilt (model/interop/gguf_file.py).
    The weights are written as float32 (what every block format dequantizes to); the Q4_0, Q4_1
    and Q8_0 matrices also as their blocks, in packed.safetensors (model/packed/loading.py)."""
    from attnlens.model.interop.gguf_file import read_gguf

    source = read_gguf(src, progress=progress)
    arch = find_for_import(source.config, src)
    config = arch.config_from_hf(source.config, src, context_length)
    if source.tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{src}: tokenizer has {source.tokenizer.vocab_size} tokens but the metadata says "
                              f"vocab_size={config.vocab_size}")
    state = state_from_rules(arch, config, source.tensors, src)
    out = write_checkpoint(out_dir, config, state, source.tokenizer)
    write_packed(out, packed_state(arch, config, source.blocks))  # for serving packed (model/packed/)
    return out, arch


def read_tokenizer(src: Path, model_config: dict[str, Any]) -> Tokenizer:
    """tokenizer.json with its special tokens (tokenizer_config.json, special_tokens_map.json,
    config.json), chat template and stop ids (generation_config.json)."""
    path = src / "tokenizer.json"
    if not path.is_file():
        hint = (": only a SentencePiece tokenizer.model is here; transformers writes tokenizer.json beside it with "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)") if (src / "tokenizer.model").is_file() else ""
        raise CheckpointError(f"{src}: no tokenizer.json found{hint}")
    try:
        return Tokenizer.from_dir(src, model_config)
    except ValueError as e:  # a tokenizer_config.json or special_tokens_map.json that is not a JSON object
        raise CheckpointError(str(e)) from e
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise CheckpointError(f"{path}: cannot be read as a tokenizer ({e})") from e


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def state_from_rules(arch: Architecture, config: ModelConfig, tensors: dict[str, torch.Tensor],
                     path: Path) -> dict[str, torch.Tensor]:
    """Our tensors from theirs by the architecture's rules, every name and shape checked."""
    renames = dict(arch.renames)
    theirs = {renames.get(k, k): v for k, v in tensors.items() if not k.endswith(arch.ignored)}
    assert arch.tensors is not None  # only GPT-2 and BERT declare no rules: they import by their import_dir
    rules = arch.tensors(config)
    wanted = {name for rule in rules for name in rule.theirs}
    if config.tie_embeddings and arch.head in theirs and arch.head not in wanted:
        embedding = next(r.theirs[0] for r in rules if r.ours == "tok_emb.weight")
        if embedding in theirs and not torch.equal(theirs[arch.head], theirs[embedding]):
            raise CheckpointError(f"{path}: {arch.head} differs from {embedding}, but config.json ties them "
                                  "(tie_word_embeddings)")
        del theirs[arch.head]
    missing = sorted(wanted - set(theirs), key=_natural)
    unexpected = sorted(set(theirs) - wanted, key=_natural)
    if missing:
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:8])}")
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensor(s) {', '.join(unexpected[:8])}")
    shapes = state_shapes(config)
    state = {}
    for rule in rules:
        want = rule.split(torch.empty(shapes[rule.ours], device="meta"))  # their shapes, as config.json implies
        for name, w in zip(rule.theirs, want):
            if tuple(theirs[name].shape) != tuple(w.shape):
                raise CheckpointError(f"{path}: tensor {name} has shape {list(theirs[name].shape)} but config.json "
                                      f"implies {list(w.shape)}")
        state[rule.ours] = rule.join([theirs[name] for name in rule.theirs])
    assert set(state) == set(shapes), (sorted(set(shapes) ^ set(state)))  # the rules cover the model exactly
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    keep = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return {k: v.to(keep) if v.is_floating_point() else v for k, v in state.items()}


def packed_state(arch, config, blocks: dict[str, tuple[torch.Tensor, str]]) -> dict[str, tuple[torch.Tensor, str]]:
    """Our tensor name -> (blocks, format) for every 2-D weight whose parts (`blocks`, by
    transformers' names) are all packed in one format; the architecture's rule joins them (rows
    concatenated), and the result must have the rows and columns config implies."""
    renames = dict(arch.renames)
    theirs = {renames.get(k, k): v for k, v in blocks.items()}
    shapes = state_shapes(config)
    out = {}
    for rule in arch.tensors(config):
        shape = shapes.get(rule.ours)
        if shape is None or len(shape) != 2 or not all(n in theirs for n in rule.theirs):
            continue
        formats = {theirs[n][1] for n in rule.theirs}
        if len(formats) != 1:
            continue  # q, k, v in different formats: that matrix stays float32
        fmt = formats.pop()
        rows, cols = shape
        joined = rule.join([theirs[n][0] for n in rule.theirs])
        if cols % 32 == 0 and tuple(joined.shape) == (rows, cols // 32 * BLOCK_BYTES[fmt]):
            out[rule.ours] = (joined.contiguous(), fmt)
    return out


def write_packed(out_dir: str | Path, state: dict[str, tuple[torch.Tensor, str]]) -> Path | None:
    """packed.safetensors in `out_dir` (None, and no file, when nothing is packed)."""
    path = Path(out_dir) / PACKED_FILE
    if not state:
        return None
    tmp = path.with_name(PACKED_FILE + ".tmp")
    save_file({k: t for k, (t, _) in state.items()}, str(tmp), metadata={k: fmt for k, (_, fmt) in state.items()})
    readable_by_all(tmp)
    tmp.replace(path)
    return path


# --- export ----------------------------------------------------------------------------------

def find_for_export(config: ModelConfig, name: str | None = None, *, where: str = "") -> Architecture:
    """The named architecture (ValueError with its reasons if it cannot express `config`), else
    the one the model was imported as, else the first registered one that fits."""
    by_name = {a.name: a for a in ARCHITECTURES}
    if name is not None:
        if name not in by_name:
            raise ValueError(f"unknown architecture {name!r} (known: {', '.join(by_name)})")
        candidates = [by_name[name]]
    else:
        own = [a for a in ARCHITECTURES if a.hf_class == config.architecture]
        candidates = own or [a for a in ARCHITECTURES if (a.model_type == "bert") == (config.family == "encoder")]
    reasons = {}
    for arch in candidates:
        reasons[arch.title] = arch.export_reasons(config)
        if not reasons[arch.title]:
            return arch
    if len(candidates) == 1:
        raise ValueError(f"{where}cannot export as {candidates[0].title}: " + "; ".join(reasons[candidates[0].title]))
    raise ValueError(f"{where}no transformers architecture can express this model: "
                     + " | ".join(f"cannot export as {t}: {'; '.join(r)}" for t, r in reasons.items()))


def export_checkpoint(model_dir: str | Path, out_dir: str | Path, *, architecture: str | None = None
                      ) -> tuple[Path, Architecture]:
    """Write the checkpoint in `model_dir` as a transformers directory; return it and its architecture."""
    from attnlens.model.checkpoint import load_config

    arch = find_for_export(load_config(model_dir), architecture, where=f"{model_dir}: ")
    if arch.export_dir is not None:
        return arch.export_dir(model_dir, out_dir), arch
    ckpt = load_checkpoint(model_dir)
    ours = {k: v.detach().float().cpu() for k, v in ckpt.model.state_dict().items()}
    assert arch.tensors is not None  # every architecture without an export_dir declares its rules
    state = {}
    for rule in arch.tensors(ckpt.config):
        for name, t in zip(rule.theirs, rule.split(ours[rule.ours])):
            state[name] = t.clone(memory_format=torch.contiguous_format)  # no two share memory (safetensors)
    tok = ckpt.tokenizer
    config = {**arch.config_to_hf(ckpt.config), "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
              "torch_dtype": "float32"}
    out = write_hf_dir(out_dir, state, config, tok)
    files = tok.transformers_files(ckpt.config.context_length)
    files.setdefault("generation_config.json", {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id})
    for name, data in files.items():
        write_json(out / name, data)
    return out, arch

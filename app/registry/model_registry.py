"""The models the service holds, by name: each with its family's declaration (the contract in
model/families/contract.py), the tasks it answers and, for a classifier, its labels. Routes ask
the registry for a model *and* a task, so an unknown name or the wrong endpoint for a model is
one clear 4xx in one place.

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
from attnlens.app.server.api_errors import ApiError
from attnlens.app.server.metrics import note_request_model
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

    @property
    def state(self) -> str:
        """starting | running | restarting | failed | stopped (its engine's, as its supervisor reads it)."""
        return self.supervisor.state if self.supervisor is not None else "running"

    @property
    def family(self) -> Family:
        """The family's declaration (model/families/contract.py)."""
        return family_of(self.checkpoint.model)

    @property
    def generates(self) -> bool:
        return self.family.generation is not None

    @property
    def generation(self) -> GenerationSpec:
        """How the family generates: for a model looked up for a generating task (its route's
        dependency, app/api/deps.py, checks it)."""
        spec = self.family.generation
        assert spec is not None, f"{self.describe()} does not generate"
        return spec

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

    def get(self, name: str | None, task: str | None = None, *, param: str = "model") -> ServedModel:
        """The model `name` (default: the default model, or for a task it cannot do, the one
        loaded model that can), checked to answer `task`."""
        if name is None and task is not None and task not in self.models[self.default].tasks:
            able = [m for m in self.models.values() if task in m.tasks]
            if len(able) == 1:
                return able[0]
        served = self.models.get(self.default if name is None else name)
        if served is None:
            raise ApiError(404, f"unknown model {name!r}; the loaded models are: {', '.join(self.names)} "
                                f"(GET /models describes them)", param=param, code="model_not_found")
        note_request_model(served.name)  # /metrics labels what this request counts with its model
        if task is not None and task not in served.tasks:
            can = ", ".join(f"{t} ({TASK_ENDPOINTS[t]})" for t in served.tasks)
            others = [m.name for m in self.models.values() if task in m.tasks]
            hint = f"; models that can: {', '.join(others)}" if others else ""
            raise ApiError(400, f"{served.describe()} cannot do {task}: it can do {can}{hint}",
                           param=param, code="unsupported_task")
        return served


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


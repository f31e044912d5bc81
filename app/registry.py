"""The models the service holds, by name: each with its family, the tasks it answers and,
for a classifier, its labels. Routes ask the registry for a model *and* a task, so an
unknown name or the wrong endpoint for a model is one clear 4xx in one place.

Decoders are run by their generation engine; encoders by an `EncoderRunner`: one forward
per request on a worker thread, at most `max_concurrent` at once per model and at most
`max_queue` waiting (then 429), like the engine's admission limits.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from attnlens.model import Checkpoint

from .engine import QueueFull
from .errors import ApiError
from .metrics import note_request_model

# Endpoint names, as /models lists them and as error messages name them.
GENERATE, COMPLETIONS, ATTENTION, FILL_MASK, CLASSIFY = "generate", "completions", "attention", "fill-mask", "classify"
TASK_ENDPOINTS = {GENERATE: "POST /generate", COMPLETIONS: "POST /v1/completions", ATTENTION: "POST /attention",
                  FILL_MASK: "POST /fill-mask", CLASSIFY: "POST /classify"}


# How each family is served: whether the batched generation engine runs it (prompt -> tokens;
# for an encoder-decoder the prompt is the source) and what its attention maps are.
ENGINE_FAMILIES = ("decoder", "encoder-decoder")
ATTENTION_KIND = {"decoder": "causal", "encoder": "bidirectional", "encoder-decoder": "encoder-decoder"}


def tasks_of(ckpt: Checkpoint) -> list[str]:
    family = ckpt.config.family
    if family == "encoder":
        return [FILL_MASK, *([CLASSIFY] if ckpt.config.labels else []), ATTENTION]
    return [GENERATE, COMPLETIONS, ATTENTION]


class EncoderRunner:
    """Runs one encoder's requests on worker threads, bounded like the engine."""

    def __init__(self, checkpoint: Checkpoint, *, max_concurrent: int = 2, max_queue: int = 32):
        self.checkpoint = checkpoint
        self.model = checkpoint.model
        self.tokenizer = checkpoint.tokenizer
        self.config = checkpoint.config
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self._slots = asyncio.Semaphore(max_concurrent)
        self._in_flight = 0

    async def call(self, fn: Callable[[Checkpoint], Any]) -> Any:
        if self._in_flight >= self.max_concurrent + self.max_queue:
            raise QueueFull(self.max_concurrent + self.max_queue, retry_after=1)
        self._in_flight += 1
        try:
            async with self._slots:
                return await asyncio.to_thread(fn, self.checkpoint)
        finally:
            self._in_flight -= 1


@dataclass
class ServedModel:
    name: str
    path: Path | None
    checkpoint: Checkpoint
    runner: Any = None  # the decoder's Engine, or an EncoderRunner
    tasks: list[str] = field(default_factory=list)

    @property
    def family(self) -> str:
        return self.checkpoint.config.family

    @property
    def labels(self) -> list[str] | None:
        return list(self.checkpoint.config.labels) or None

    def describe(self) -> str:
        return f"model {self.name!r} (an {self.family})" if self.family[0] in "ae" else f"model {self.name!r} (a {self.family})"


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
        """The model `name` (default: the default model), checked to answer `task`."""
        served = self.models.get(name or self.default)
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


def model_name(path: Path) -> str:
    return Path(path).resolve().name


def bundled_checkpoints(root: Path) -> list[Path]:
    """Every checkpoint directory under `root` (one with a config.json), sorted by name."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "config.json").is_file())


def lookup(state, name: str | None, task: str, *, param: str = "model") -> ServedModel:
    """The served model for a request (503 until start-up is done; 404 / 400 as `get`)."""
    registry = getattr(state, "registry", None)
    if not state.ready or registry is None:
        raise ApiError(503, f"the model is not ready ({state.status})", code="not_ready",
                       headers={"Retry-After": "5"})
    return registry.get(name, task, param=param)

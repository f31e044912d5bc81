"""What the app holds between requests: settings, metrics, and (once loaded) the models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnlens.app.registry.model_registry import ModelRegistry
from attnlens.app.server.middleware import Drain, Metrics
from attnlens.app.server.settings import Settings
from attnlens.app.serving.answer_budget import AnswerBudget
from attnlens.model import Checkpoint


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    answers: AnswerBudget
    registry: ModelRegistry | None = None  # every loaded model by name, with its engine or runner
    supervision: Any = None  # the engines' supervisors (engine/supervisor.py), once started
    ready: bool = False
    status: str = "starting"
    preloaded: dict[str, Checkpoint] = field(default_factory=dict)  # model dir -> loaded before start-up
    drain: Drain = field(default_factory=Drain)  # graceful shutdown (app/server/shutdown.py, middleware.py)

    @property
    def model_name(self) -> str:
        return self.settings.model_dir.resolve().name

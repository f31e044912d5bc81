"""What the app holds between requests: settings, metrics, and (once loaded) the models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attnlens.model import Checkpoint

from .answers import AnswerBudget
from .metrics import Metrics
from .registry import ModelRegistry
from .settings import Settings
from .shutdown import Drain


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
    drain: Drain = field(default_factory=Drain)  # graceful shutdown (app/shutdown.py)

    @property
    def model_name(self) -> str:
        return self.settings.model.resolve().name

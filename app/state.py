"""What the app holds between requests: settings, metrics, and (once loaded) the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnlens.model import Checkpoint

from .answers import AnswerBudget
from .engine import EngineFront
from .metrics import Metrics
from .registry import ModelRegistry
from .settings import Settings
from .shutdown import Drain


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    answers: AnswerBudget
    checkpoint: Checkpoint | None = None
    engine: EngineFront | None = None  # the default model's engine
    registry: ModelRegistry | None = None  # every loaded model by name
    ready: bool = False
    status: str = "starting"
    preloaded: dict[str, Checkpoint] = field(default_factory=dict)  # model dir -> loaded before start-up
    drain: Drain = field(default_factory=Drain)  # graceful shutdown (app/shutdown.py)

    @property
    def model_name(self) -> str:
        return self.settings.model.resolve().name

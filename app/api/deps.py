"""FastAPI dependencies: the shared state and the model registry, reached through the request
(the full-stack template's `Annotated` aliases: `StateDep`, `RegistryDep`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from attnlens.app.registry.model_registry import ModelRegistry
from attnlens.app.server.api_errors import ApiError
from attnlens.app.server.metrics import Metrics
from attnlens.app.server.settings import Settings
from attnlens.app.server.state import AppState


def get_state(request: Request) -> AppState:
    return request.app.state.attnlens


def get_settings(request: Request) -> Settings:
    return get_state(request).settings


def get_metrics(request: Request) -> Metrics:
    return get_state(request).metrics


def get_registry(request: Request) -> ModelRegistry:
    """Every loaded model; 503 until start-up is done."""
    state = get_state(request)
    if not state.ready or state.registry is None:
        raise ApiError(503, f"the models are not ready ({state.status})", code="not_ready",
                       headers={"Retry-After": "5"})
    return state.registry


StateDep = Annotated[AppState, Depends(get_state)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
RegistryDep = Annotated[ModelRegistry, Depends(get_registry)]

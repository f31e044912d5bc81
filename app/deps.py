"""FastAPI dependencies: the shared state, reached through the request."""

from __future__ import annotations

from fastapi import Request

from .engine import EngineFront
from .errors import ApiError
from .metrics import Metrics
from .settings import Settings
from .state import AppState


def get_state(request: Request) -> AppState:
    return request.app.state.attnlens


def get_settings(request: Request) -> Settings:
    return get_state(request).settings


def get_metrics(request: Request) -> Metrics:
    return get_state(request).metrics


def get_engine(request: Request) -> EngineFront:
    state = get_state(request)
    if not state.ready or state.engine is None:
        raise ApiError(503, f"the model is not ready ({state.status})", code="not_ready",
                       headers={"Retry-After": "5"})
    return state.engine

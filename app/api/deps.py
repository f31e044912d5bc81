"""FastAPI dependencies, as the full-stack template's `Annotated` aliases: the shared state, its
settings, the model registry and, for each task, the served model a request names.

Every route that takes a model has it from here, so every one gives the same 503 until start-up
is done (`get_registry`: code not_ready, Retry-After) and checks the model as its task needs: a
404 for a name that is not loaded, a 400 for a model that cannot do the task (the /v1 routes word
theirs as OpenAI does). The name is where the route has it: the body's `model`, the query's
(GET /model) or the path's (GET /v1/models/{model}). The model found is the request's for
/metrics too: what the request counts is labelled with it (`counted_for`).

A route whose body names its model gets the body from its model's dependency, with the model
(`ModelRequest`: `.body`, `.served`), rather than as a parameter of its own beside it: FastAPI
validates a body once for each dependency that reads it, so a body read twice would be validated
twice and each of its errors listed twice.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Annotated, Callable, Generic, Protocol, TypeVar

from fastapi import Depends, Request

from attnlens.app.api.attention_schemas import AttentionRequest
from attnlens.app.api.causes_schemas import LogitAttributionRequest, PatchRequest
from attnlens.app.api.chat_schemas import ChatCompletionRequest
from attnlens.app.api.encoder_schemas import ClassifyRequest, FillMaskRequest
from attnlens.app.api.explain_schemas import ExplainRequest, LensRequest, LogitsRequest
from attnlens.app.api.generate_schemas import GenerateRequest
from attnlens.app.api.heads_schemas import HeadsRequest
from attnlens.app.api.openai_schemas import CompletionRequest, EmbeddingRequest
from attnlens.app.registry.model_registry import (
    ATTENTION,
    CHAT,
    CLASSIFY,
    COMPLETIONS,
    EMBEDDINGS,
    FILL_MASK,
    GENERATE,
    TASK_ENDPOINTS,
    ModelRegistry,
    ServedModel,
)
from attnlens.app.server.api_errors import ApiError
from attnlens.app.server.middleware import REQUEST_MODEL, Metrics
from attnlens.app.server.settings import Settings
from attnlens.app.server.state import AppState
from attnlens.app.serving.openai_serving import not_found
from attnlens.app.serving.prompts import require_template


def get_state(request: Request) -> AppState:
    return request.app.state.attnlens


StateDep = Annotated[AppState, Depends(get_state)]


def get_settings(state: StateDep) -> Settings:
    return state.settings


def get_metrics(state: StateDep) -> Metrics:
    return state.metrics


def get_registry(state: StateDep) -> ModelRegistry:
    """Every loaded model; until start-up is done, the one "not ready" answer of every route."""
    if not state.ready or state.registry is None:
        raise ApiError(503, f"the models are not ready ({state.status})", code="not_ready",
                       headers={"Retry-After": "5"})
    return state.registry


SettingsDep = Annotated[Settings, Depends(get_settings)]
RegistryDep = Annotated[ModelRegistry, Depends(get_registry)]


# --- the model of each task: (state, the name asked for or None) -> the served model --------------
def counted_for(served: ServedModel) -> ServedModel:
    """`served` is the request's model: /metrics labels what the request counts with it (the
    RequestModel that app/server/middleware.py's middleware made for the request, if any)."""
    current = REQUEST_MODEL.get()
    if current is not None:
        current.name = served.name
    return served


def find_model(state: AppState, name: str | None, task: str | None = None, *, param: str = "model") -> ServedModel:
    """The model `name` (default: the default model, or for a task it cannot do, the one loaded
    model that can), checked to answer `task`: a 404 for a name that is not loaded, a 400 (saying
    what it can do) for a model that cannot do the task."""
    registry = get_registry(state)
    models = registry.models
    if name is None and task is not None and task not in models[registry.default].tasks:
        able = [m for m in models.values() if task in m.tasks]
        if len(able) == 1:
            return able[0]  # counted under the default model, as a request that names none
    served = models.get(registry.default if name is None else name)
    if served is None:
        raise ApiError(404, f"unknown model {name!r}; the loaded models are: {', '.join(registry.names)} "
                            f"(GET /models describes them)", param=param, code="model_not_found")
    counted_for(served)
    if task is not None and task not in served.tasks:
        can = ", ".join(f"{t} ({TASK_ENDPOINTS[t]})" for t in served.tasks)
        others = [m.name for m in models.values() if task in m.tasks]
        hint = f"; models that can: {', '.join(others)}" if others else ""
        raise ApiError(400, f"{served.describe()} cannot do {task}: it can do {can}{hint}",
                       param=param, code="unsupported_task")
    return served


def generating_model(state: AppState, name: str | None) -> ServedModel:
    return find_model(state, name, GENERATE)


def attention_model(state: AppState, name: str | None) -> ServedModel:
    return find_model(state, name, ATTENTION)


def lens_model(state: AppState, name: str | None) -> ServedModel:
    """A model whose family declares logits per position (/logits, /lens, /attention/explain)."""
    served = attention_model(state, name)
    if served.family.lens is None:
        raise ApiError(400, f"{served.describe()} declares no logits to read per position", param="model",
                       code="unsupported_task")
    return served


def causal_model(state: AppState, name: str | None) -> ServedModel:
    """A decoder or an encoder-decoder (/patch, /logit-attribution): the causal analyses patch and read a
    causal stream (an encoder-decoder's decoder, reading its source through cross-attention). An
    encoder's attention is bidirectional, with no logits of a next token to read."""
    served = attention_model(state, name)
    family = served.checkpoint.config.family
    if family not in ("decoder", "encoder-decoder"):
        registry = get_registry(state)
        able = [m.name for m in registry.models.values()
                if m.checkpoint.config.family in ("decoder", "encoder-decoder")]
        listed = f"the models served here that can are: {', '.join(able)}" if able else "none is served here"
        raise ApiError(400, f"patching and logit attribution need a decoder (a causal language model) or an "
                            f"encoder-decoder: {served.describe()} is neither: its attention is bidirectional, with "
                            f"no causal stream to patch; {listed} (name one in `model`)",
                       param="model", code="unsupported_task")
    return served


def fill_mask_model(state: AppState, name: str | None) -> ServedModel:
    return find_model(state, name, FILL_MASK)


def classify_model(state: AppState, name: str | None) -> ServedModel:
    return find_model(state, name, CLASSIFY)


def v1_model(state: AppState, name: str | None, task: str | None) -> ServedModel:
    """The model a /v1 request names: a name no loaded model has is OpenAI's 404 (naming the /v1
    models); a loaded model that cannot do `task` find_model's 400, which says what it can do."""
    registry = get_registry(state)
    if name is not None and name not in registry.models:
        raise not_found(registry, name)
    return find_model(state, name, task)


def completions_model(state: AppState, name: str | None) -> ServedModel:
    return v1_model(state, name, COMPLETIONS)


def chat_model(state: AppState, name: str | None) -> ServedModel:
    """The model a chat request names; with no name, the default model, or else the one loaded
    model that has a chat template. A model that does not generate is find_model's 400 (what it
    can do); one that generates without a template, `no_template`'s."""
    registry = get_registry(state)
    if name is None and CHAT not in registry.models[registry.default].tasks:
        able = [m.name for m in registry.models.values() if CHAT in m.tasks]
        if len(able) == 1:
            name = able[0]
    served = v1_model(state, name, None)
    if COMPLETIONS not in served.tasks:
        find_model(state, served.name, CHAT)  # find_model's 400: what this model can do instead
    require_template(state, served)
    return served


def embedding_model(state: AppState, name: str | None) -> ServedModel:
    """The encoder a request names; with no name, the default model, or else the one loaded
    encoder. An unknown name is OpenAI's 404 and a model that is no encoder a 400, both naming
    the encoders served here."""
    registry = get_registry(state)
    try:
        return find_model(state, name, EMBEDDINGS)
    except ApiError as e:
        if e.code not in ("model_not_found", "unsupported_task"):
            raise
        able = [m.name for m in registry.models.values() if EMBEDDINGS in m.tasks]
        listed = f"the encoders served here are: {', '.join(able)}" if able else "no encoder is served here"
        if e.code == "model_not_found":
            raise ApiError(404, f"the model {name!r} does not exist; {listed}", param="model",
                           code="model_not_found") from None
        served = registry.models[name or registry.default]
        which = "" if name else "the default "
        raise ApiError(400, f"embeddings need an encoder: {which}{served.describe()} is not one; {listed} "
                            f"(name one in `model`)", param="model", code="unsupported_task") from None


# --- a route's body with the model it names ------------------------------------------------------
class NamesModel(Protocol):
    model: str | None


B = TypeVar("B", bound=NamesModel)


@dataclass(frozen=True)
class ModelRequest(Generic[B]):
    """A request's body, validated, and the served model it names, checked for the route's task."""

    body: B
    served: ServedModel


class BodyModel(Generic[B]):
    """The dependency of a route whose body (`schema`) names its model, found by `resolve`.

    FastAPI reads what a dependency takes from its signature: here the body, as `schema`, and the
    state. The body is validated before the model is looked up, so a request that is not valid is
    a 422 whatever its model."""

    def __init__(self, schema: type[B], resolve: Callable[[AppState, str | None], ServedModel]):
        self.resolve = resolve
        self.__signature__ = inspect.Signature([
            inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=schema),
            inspect.Parameter("state", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=StateDep)])

    async def __call__(self, body: B, state: AppState) -> ModelRequest[B]:
        return ModelRequest(body, self.resolve(state, body.model))


GeneratingModel = Annotated[ModelRequest[GenerateRequest], Depends(BodyModel(GenerateRequest, generating_model))]
AttentionModel = Annotated[ModelRequest[AttentionRequest], Depends(BodyModel(AttentionRequest, attention_model))]
HeadsModel = Annotated[ModelRequest[HeadsRequest], Depends(BodyModel(HeadsRequest, attention_model))]
LogitsModel = Annotated[ModelRequest[LogitsRequest], Depends(BodyModel(LogitsRequest, lens_model))]
LensModel = Annotated[ModelRequest[LensRequest], Depends(BodyModel(LensRequest, lens_model))]
ExplainModel = Annotated[ModelRequest[ExplainRequest], Depends(BodyModel(ExplainRequest, lens_model))]
PatchModel = Annotated[ModelRequest[PatchRequest], Depends(BodyModel(PatchRequest, causal_model))]
LogitAttributionModel = Annotated[ModelRequest[LogitAttributionRequest],
                                  Depends(BodyModel(LogitAttributionRequest, causal_model))]
FillMaskModel = Annotated[ModelRequest[FillMaskRequest], Depends(BodyModel(FillMaskRequest, fill_mask_model))]
ClassifyModel = Annotated[ModelRequest[ClassifyRequest], Depends(BodyModel(ClassifyRequest, classify_model))]
CompletionsModel = Annotated[ModelRequest[CompletionRequest],
                             Depends(BodyModel(CompletionRequest, completions_model))]
ChatModel = Annotated[ModelRequest[ChatCompletionRequest], Depends(BodyModel(ChatCompletionRequest, chat_model))]
EmbeddingModel = Annotated[ModelRequest[EmbeddingRequest], Depends(BodyModel(EmbeddingRequest, embedding_model))]


# --- a model named in the query or the path ------------------------------------------------------
async def any_model(state: StateDep, model: str | None = None) -> ServedModel:
    """GET /model's `?model=`: the default model, or the loaded model it names, whatever its tasks."""
    return find_model(state, model)


async def listed_model(state: StateDep, model: str) -> ServedModel:
    """GET /v1/models/{model}: a model of GET /v1/models; any other name is OpenAI's 404."""
    registry = get_registry(state)
    served = registry.models.get(model)
    if served is None or COMPLETIONS not in served.tasks:
        raise not_found(registry, model)
    return served


AnyModel = Annotated[ServedModel, Depends(any_model)]
ListedModel = Annotated[ServedModel, Depends(listed_model)]

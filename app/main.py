"""The FastAPI application: `create_app(settings)` builds it; `app` is the default one.

Start-up (lifespan): load every checkpoint Settings.model_dirs() names (ATTNLENS_MODELS, by
default every bundled one; ATTNLENS_MODEL is the default model) onto ATTNLENS_DEVICE in
ATTNLENS_DTYPE, start an engine per decoder (an EncoderRunner per encoder), warm each up
through the same path requests take, then report ready on /readyz.

If the checkpoint cannot be loaded, start-up fails: `attnlens serve` loads it before it
starts the server, prints one line saying which directory and why ("attnlens: cannot load
the model from ...: ...") and exits with status 3 without ever accepting connections.
Importing this module never touches the checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from pydantic.json_schema import models_json_schema
from starlette.middleware.gzip import GZipMiddleware

from attnlens.model import Checkpoint, SamplingParams

from .answers import AnswerBudget
from .attention_codec import attention_maps
from .auth import ApiKeyMiddleware, is_open
from .translation_attention import translation_maps
from .body_limit import BodyLimitMiddleware
from .engine import Engine, EngineFront, EngineProcess, GenerationParams
from .errors import install_error_handlers, scope_error_response
from .loader import load_for_serving
from .metrics import Metrics, MetricsMiddleware
from .encoder_tasks import classify_or_fill_warm_up
from .registry import ENGINE_FAMILIES, EncoderRunner, ModelRegistry, ServedModel, model_name, tasks_of
from .routers import attention, encoder, generate, openai, ops, ui
from .schemas import StreamDone, StreamError, StreamToken
from .settings import Settings, default_switch_interval_ms
from .shutdown import DrainMiddleware
from .state import AppState

log = logging.getLogger("attnlens.app")


async def warm_up(engine: EngineFront) -> None:
    """One short generation and one attention pass, through the engine like any request."""
    ids = engine.tokenizer.encode("The") or [0]
    params = GenerationParams(prompt_ids=ids, max_new_tokens=2, sampling=SamplingParams(temperature=0.0),
                              n_logprobs=1, return_attention=True)
    async for event in engine.submit(params).events():
        if isinstance(event, StreamError):
            raise RuntimeError(f"warm-up generation failed: {event.message}")
    if engine.config.family == "encoder-decoder":  # the prompt is a source; the target its translation
        await engine.call(partial(translation_maps, source_ids=ids, target_ids=None, layers=[0], heads=[0]))
    else:
        await engine.call(partial(attention_maps, ids=ids, layers=[0], heads=[0]))


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: AppState = app.state.attnlens
    s = state.settings
    state.status = "loading"
    registry = ModelRegistry(default=model_name(s.model))
    engines: list[EngineFront] = []
    try:
        for model_dir in s.model_dirs():
            ckpt = state.preloaded.pop(str(model_dir), None)  # `attnlens serve` loads them first
            try:
                if ckpt is None:
                    ckpt = await asyncio.to_thread(load_for_serving, model_dir, s.device, s.dtype)
            except Exception as e:
                state.status = "failed"
                log.error("cannot load the model from %s: %s", model_dir, e)
                raise RuntimeError(f"cannot load the model from {model_dir}: {e}") from None
            if ckpt.config.family in ENGINE_FAMILIES:
                limits = dict(max_concurrent=s.max_concurrent, max_queue=s.max_queue,
                              max_attention_concurrent=s.max_attention_concurrent, cuda_graphs=s.cuda_graphs,
                              max_stream_backlog_bytes=s.max_stream_backlog_bytes)
                if s.engine_process and ckpt.path is not None:
                    runner = await asyncio.to_thread(EngineProcess, ckpt, device=s.device, dtype=s.dtype,
                                                     log_level=s.log_level, **limits)
                else:
                    runner = Engine(ckpt, **limits)
                engines.append(runner)
            else:
                runner = EncoderRunner(ckpt, max_concurrent=s.max_encoder_concurrent, max_queue=s.max_queue)
            registry.add(ServedModel(model_name(model_dir), ckpt.path, ckpt, runner, tasks_of(ckpt)))
        if s.max_prompt_tokens is None:  # the default follows the models (each checks its own context too)
            longest = max(m.checkpoint.config.context_length for m in registry.models.values())
            s = state.settings = s.model_copy(update={"max_prompt_tokens": longest})
        default = registry.get(None)
        engine = default.runner if isinstance(default.runner, EngineFront) else (engines[0] if engines else None)
        state.checkpoint, state.engine, state.registry = default.checkpoint, engine, registry
        device = next(default.checkpoint.model.parameters()).device
        interval = s.switch_interval_ms or default_switch_interval_ms(device.type)
        sys.setswitchinterval(interval / 1000)  # process-wide: see Settings.switch_interval_ms
        state.metrics.bind_registry(registry)  # every loaded model's gauges, each labelled with its name
        if s.warmup:
            state.status = "warming up"
            for served in registry.models.values():
                if isinstance(served.runner, EngineFront):
                    await warm_up(served.runner)
                else:
                    await served.runner.call(lambda ckpt: classify_or_fill_warm_up(ckpt))
        state.ready, state.status = True, "ready"
        for served in registry.models.values():
            cfg = served.checkpoint.config
            log.info("ready: %s, %s (%d layers x %d heads, context %d, %s params; %s)%s",
                     served.name, cfg.family, cfg.n_layers, cfg.n_heads, cfg.context_length,
                     f"{served.checkpoint.model.num_parameters():,}", ", ".join(served.tasks),
                     " [default]" if served.name == registry.default else "")
        for engine in engines:
            log.info("engine for %s on %s as %s%s; KV cache %d rows, %.0f MB", engine.checkpoint.path,
                     engine.device, str(engine.dtype).removeprefix("torch."),
                     f" in process {engine.process.pid}" if isinstance(engine, EngineProcess) else "",
                     engine.max_concurrent, engine.cache_bytes / 2**20)
        yield
    finally:
        state.ready, state.status = False, "stopped"
        for engine in engines:
            await asyncio.to_thread(engine.close)


def add_stream_schemas(app: FastAPI) -> None:
    """Put the server-sent events' bodies (StreamToken, StreamDone, StreamError) in the OpenAPI components,
    where /generate's text/event-stream answer refers to them; FastAPI only adds models that
    a route returns as JSON."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default()  # also stored in app.openapi_schema
            _, defs = models_json_schema([(m, "serialization") for m in (StreamToken, StreamDone, StreamError)],
                                         ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, body in defs.get("$defs", {}).items():
                components.setdefault(name, body)
        return app.openapi_schema

    app.openapi = openapi


def add_bearer_scheme(app: FastAPI) -> None:
    """With an API key set, the OpenAPI description says which operations need it (so /docs'
    Authorize button and generated clients send it)."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default()
            schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
            schemes["bearer"] = {"type": "http", "scheme": "bearer", "description": "ATTNLENS_API_KEY"}
            for path, operations in schema.get("paths", {}).items():
                if not is_open(path):
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}]
        return app.openapi_schema

    app.openapi = openapi


def create_app(settings: Settings | None = None, preloaded: dict[str, Checkpoint] | None = None) -> FastAPI:
    """The app for `settings`; `preloaded` (str(model dir) -> Checkpoint) are served instead of
    loading those directories at start-up (`attnlens serve` loads them first, to fail with one
    clear line)."""
    settings = settings or Settings()
    app = FastAPI(
        title="attnlens",
        summary="A small transformer trained from scratch: generate text and look at its attention heads.",
        version="0.1.0",
        lifespan=lifespan,
        # no redirect from /path/ to /path (or /static to /static/): Starlette builds its absolute
        # URL from the Host header the client sent, so anyone could make us point elsewhere
        redirect_slashes=False,
    )
    app.state.attnlens = AppState(settings=settings, metrics=Metrics(default_model=model_name(settings.model)),
                                  answers=AnswerBudget(settings.max_answer_bytes, settings.answer_wait_s),
                                  preloaded=dict(preloaded or {}))
    install_error_handlers(app)
    for module in (generate, attention, encoder, openai, ops, ui):
        app.include_router(module.router)
    add_stream_schemas(app)
    if settings.static_dir.is_dir():
        app.mount("/static", StaticFiles(directory=settings.static_dir), name="static")

    # added innermost first: metrics sees everything, CORS headers go on every answer (a 401
    # too; CORS answers preflights itself, before the key check)
    app.add_middleware(GZipMiddleware, minimum_size=1024, compresslevel=settings.gzip_level)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, error_response=scope_error_response,
                       timeout_s=settings.body_timeout_s)
    if settings.api_key is not None and settings.api_key.get_secret_value():
        add_bearer_scheme(app)
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key.get_secret_value(),
                           error_response=scope_error_response)
    app.add_middleware(DrainMiddleware, drain=app.state.attnlens.drain)  # graceful shutdown (app/shutdown.py)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    app.add_middleware(MetricsMiddleware, metrics=app.state.attnlens.metrics)
    return app


app = create_app()

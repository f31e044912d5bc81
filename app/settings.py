"""Service settings, read from `ATTNLENS_*` environment variables (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "checkpoints" / "default"
STATIC_DIR = REPO_ROOT / "static"


class Settings(BaseSettings):
    """Every knob of the service; `ATTNLENS_<NAME>` overrides each one."""

    model_config = SettingsConfigDict(env_prefix="ATTNLENS_", extra="ignore")

    model: Path = DEFAULT_MODEL_DIR
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_prompt_tokens: int = Field(1024, ge=1)
    max_new_tokens: int = Field(512, ge=1)
    # generations decoded together in one batch (= KV cache rows); see bench/README.md
    max_concurrent: int = Field(32, ge=1)
    max_queue: int = Field(64, ge=0)  # generations waiting for a slot
    max_attention_concurrent: int = Field(4, ge=1)  # /attention forwards running or waiting
    cuda_graphs: bool = True  # on CUDA, replay the decode step from captured CUDA graphs
    # Comma-separated list ("*" for any origin); empty = no CORS headers.
    cors_origins: Annotated[list[str], NoDecode] = []
    log_level: str = "info"
    max_body_bytes: int = Field(1_000_000, ge=1)
    static_dir: Path = STATIC_DIR
    warmup: bool = True

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value):
        if isinstance(value, str):
            return [o.strip() for o in value.split(",") if o.strip()]
        return value

    @field_validator("log_level")
    @classmethod
    def _lower_level(cls, value: str) -> str:
        value = value.lower()
        if value not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise ValueError(f"unknown log level {value!r}")
        return value

"""`attnlens serve`: run the app under uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from .settings import Settings

STARTUP_FAILED = 3  # uvicorn's own exit status for a failed start-up


def serve(model: str | None = None, host: str | None = None, port: int | None = None,
          models: str | None = None) -> None:
    """Serve with ATTNLENS_* settings; arguments that are not None override them."""
    overrides = {k: v for k, v in {"model": model, "host": host, "port": port, "models": models}.items()
                 if v is not None}
    settings = Settings(**overrides)
    logging.basicConfig(level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .main import create_app  # after logging is set up

    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.log_level, lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILED)

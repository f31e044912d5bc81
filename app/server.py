"""`attnlens serve`: run the app under uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from .http_protocol import protocol_with_header_timeout
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
    from .loader import load_for_serving
    from .main import create_app  # after logging is set up

    preloaded = {}
    for model_dir in settings.model_dirs():
        try:
            preloaded[str(model_dir)] = load_for_serving(model_dir, settings.device, settings.dtype)
        except Exception as e:  # one line that says what to fix, not a traceback
            print(f"attnlens: cannot load the model from {model_dir}: {e}", file=sys.stderr)
            sys.exit(STARTUP_FAILED)
    config = uvicorn.Config(create_app(settings, preloaded), host=settings.host, port=settings.port,
                            log_level=settings.log_level, lifespan="on", timeout_graceful_shutdown=5,
                            http=protocol_with_header_timeout(settings.header_timeout_s, settings.max_header_bytes),
                            timeout_keep_alive=settings.keep_alive_s)
    server = uvicorn.Server(config)
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILED)

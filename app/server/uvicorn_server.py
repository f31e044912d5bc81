"""`attnlens serve`: run the app under uvicorn, draining on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from attnlens.app.server.http_protocol import protocol_with_header_timeout
from attnlens.app.server.settings import Settings
from attnlens.app.server.shutdown import drain

if TYPE_CHECKING:
    from attnlens.app.server.state import AppState

STARTUP_FAILED = 3  # uvicorn's own exit status for a failed start-up

log = logging.getLogger("attnlens.server")


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, except that the first SIGTERM drains before the server stops
    (app/server/shutdown.py). uvicorn's own handling stops listening at once (a request still routed
    here meets a closed port) and cuts what is still running after timeout_graceful_shutdown.
    A second SIGTERM ends the grace period at once (the generations still running end with an
    error event). SIGINT (Ctrl-C), or a SIGTERM during start-up, stop at once, as in uvicorn.
    After a drain the process exits with status 0."""

    def __init__(self, config: uvicorn.Config, state: AppState):
        super().__init__(config)
        self.state = state
        self.drain_task: asyncio.Task | None = None
        self._drain_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn calls this from its signal handler, on the event loop's thread between two bytecodes
        if sig == signal.SIGTERM and self.started and not self.should_exit and self._loop is not None:
            if self._drain_requested:
                self._loop.call_soon_threadsafe(self.state.drain.end_grace)
            else:
                self._drain_requested = True
                self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self.drain_task = asyncio.create_task(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        try:
            await drain(self.state, self.state.settings.shutdown_grace_s)
        except Exception:  # stop all the same: a drain that failed must not keep the process up
            log.exception("the drain failed; stopping now")
        finally:
            self.should_exit = True  # uvicorn's main loop sees it within 0.1 s: it closes the port and the idle
            # keep-alive connections, then the lifespan closes the engines


def build_server(app: FastAPI, settings: Settings) -> DrainingServer:
    """The server `attnlens serve` runs for `app` (tests start the same one in their event loop)."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            lifespan="on", timeout_graceful_shutdown=5,
                            http=protocol_with_header_timeout(settings.header_timeout_s, settings.max_header_bytes),
                            # typed int by uvicorn, used as call_later's seconds: a float works
                            timeout_keep_alive=settings.keep_alive_s)  # type: ignore[arg-type]
    return DrainingServer(config, app.state.attnlens)


def serve(settings: Settings) -> None:
    """Serve the models of `settings` until a signal stops the server."""
    logging.basicConfig(level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from attnlens.app.server.main import create_app  # after logging is set up
    from attnlens.model.placement import load_for_serving

    preloaded = {}
    for model_dir in settings.model_dirs():
        try:
            preloaded[str(model_dir)] = load_for_serving(model_dir, settings.device, settings.dtype,
                                                         engine_process=settings.engine_process)
        except Exception as e:  # one line that says what to fix, not a traceback
            print(f"attnlens: cannot load the model from {model_dir}: {e}", file=sys.stderr)
            sys.exit(STARTUP_FAILED)
    server = build_server(create_app(settings, preloaded), settings)
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILED)

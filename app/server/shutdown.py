"""Graceful shutdown, as a rolling update needs it: drain the requests running, then exit.

`attnlens serve` (server.py) calls `drain` on SIGTERM. From that moment:
- /readyz answers 503 (`"status": "draining"`), so Kubernetes or a load balancer stops sending here;
- every new request but /healthz and /metrics answers 503 with the code `shutting_down`,
  `Retry-After: 1` and `Connection: close`. None of it ran, so a load balancer may pass it to
  another replica (deploy/nginx: `proxy_next_upstream ... http_503 non_idempotent`);
- the requests already running, streams included, go on to their end.
Once none is left, or ATTNLENS_SHUTDOWN_GRACE_S later (or at a second SIGTERM), the server stops
listening and exits, and its lifespan closes the engines. Generations still running when the
grace period ends get an `error` event ("the server is shutting down"): their streams end in
the protocol, not cut.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from fastapi.responses import JSONResponse

from attnlens.app.registry.model_registry import ModelRegistry
from attnlens.app.server.api_errors import error_response

log = logging.getLogger("attnlens.shutdown")

# Still answered while draining: liveness (a draining server is alive; failing it would get the
# pod killed before its streams end) and the metrics that show the drain.
OPEN_WHILE_DRAINING = frozenset({"/healthz", "/metrics"})
# After the grace period: how long the generations just ended get to send their error event
END_WAIT_S = 10.0
SHUTTING_DOWN = "the server is shutting down: send the request again (another replica, or this one once back, takes it)"


class Drain:
    """Whether the server is draining, and how many requests it is still serving."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0  # requests past DrainMiddleware that have not ended (a stream: until its last byte)
        self._idle: asyncio.Event | None = None
        self._grace_over: asyncio.Event | None = None

    def request_started(self) -> None:
        self.active += 1

    def request_ended(self) -> None:
        self.active -= 1
        if self.active == 0 and self._idle is not None:
            self._idle.set()

    def end_grace(self) -> None:
        """Stop waiting for the requests running (a second SIGTERM): their generations end now."""
        self.grace_over_event().set()

    def grace_over_event(self) -> asyncio.Event:
        if self._grace_over is None:
            self._grace_over = asyncio.Event()
        return self._grace_over

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is running; False if some still are after `timeout` seconds."""
        if self.active == 0:
            return True
        self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            pass
        return self.active == 0


def refusal(path: str) -> JSONResponse:
    """What a request that arrives while draining gets."""
    if path == "/readyz":
        return JSONResponse({"ready": False, "status": "draining", "detail": "the server is shutting down"},
                            status_code=503)
    return error_response(path, 503, SHUTTING_DOWN, code="shutting_down",
                          headers={"Retry-After": "1", "Connection": "close"})


class DrainMiddleware:
    """The one place the drain is checked: counts the requests running and, while draining,
    answers new ones itself (the module docstring)."""

    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining and scope["path"] not in OPEN_WHILE_DRAINING:
            return await refusal(scope["path"])(scope, receive, send)
        self.drain.request_started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.request_ended()


class Draining(Protocol):
    """What of the server's state (state.py's AppState, which holds a Drain) the drain reads."""

    @property
    def drain(self) -> Drain: ...

    @property
    def registry(self) -> ModelRegistry | None: ...


async def close_engines(state: Draining) -> None:
    """End every generation and model call the engines hold ("the server is shutting down"), and
    the engines; the lifespan's own close afterwards finds them closed."""
    registry = state.registry
    engines = [m.runner for m in registry.models.values()] if registry is not None else []
    await asyncio.gather(*(asyncio.to_thread(e.close) for e in engines))


async def drain(state: Draining, grace_s: float) -> None:
    """Drain (the module docstring). Returns once no request is running, or once the
    generations still running after `grace_s` seconds have been ended."""
    d = state.drain
    d.draining = True
    log.info("draining: /readyz and new requests answer 503; %d request(s) running get %.0f s to finish",
             d.active, grace_s)
    idle = asyncio.create_task(d.wait_idle(grace_s))
    grace_over = asyncio.create_task(d.grace_over_event().wait())
    await asyncio.wait([idle, grace_over], return_when=asyncio.FIRST_COMPLETED)
    idle.cancel()
    grace_over.cancel()
    if d.active == 0:
        log.info("drained: no request is running")
        return
    log.warning("%d request(s) still running %s: ending their generations", d.active,
                "at a second SIGTERM" if d.grace_over_event().is_set() else f"after the {grace_s:.0f} s grace period")
    await close_engines(state)
    if not await d.wait_idle(END_WAIT_S):
        log.warning("%d request(s) still running; the server cuts them", d.active)

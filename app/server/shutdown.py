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

The requests' side of it (the 503, the count of requests running, the paths still open) is the
server's one middleware's (app/server/middleware.py: RequestMiddleware and Drain); this module drains.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from attnlens.app.registry.model_registry import ModelRegistry
from attnlens.app.server.middleware import Drain

log = logging.getLogger("attnlens.shutdown")

# After the grace period: how long the generations just ended get to send their error event
END_WAIT_S = 10.0


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

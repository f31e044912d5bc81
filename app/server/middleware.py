"""What the server does around every HTTP request, in one middleware (RequestMiddleware): count
and time it by model, refuse it while the server drains, and guard its body. And the Prometheus
metrics it keeps, in a registry of their own per app (several apps may share a process).

Every series carries a `model` label, so that a dashboard sums or splits them across replicas
and models alike:
- what an HTTP request counts (its status and duration, its generations' tokens, a refusal) is
  labelled with the model the request was for: the one it named, else the default model (also
  for requests about no model, such as /healthz);
- the engines' gauges (running, waiting, attention calls...) are read at each scrape, one series
  per loaded model that generates; `attnlens_model_info` lists every loaded model.
"""

from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the router)
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from attnlens.app.server.api_errors import error_response

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

@dataclass
class RequestModel:
    """The model of the HTTP request being served: RequestMiddleware puts a fresh one in
    REQUEST_MODEL for each request, and the model dependency (app/api/deps.py) sets its name. One
    shared object rather than the name itself: the tasks a request starts (a stream's body, its
    exception handlers) run in copies of its context, and all of them see the same one."""

    name: str | None = None


# Outside a request (start-up, warm-up): None, and what is counted is labelled with the default model
REQUEST_MODEL: ContextVar[RequestModel | None] = ContextVar("attnlens_request_model", default=None)


# name, help, value of one engine (an EngineFront): one series per model that generates
ENGINE_GAUGES = (
    ("attnlens_queue_depth", "Generations waiting for a slot", lambda e: e.waiting),
    ("attnlens_requests_in_flight", "Generations running (one KV cache row each)", lambda e: e.in_flight),
    ("attnlens_generations_running_or_waiting",
     "Generations running plus waiting for a slot: the load per replica an autoscaler follows",
     lambda e: e.in_flight + e.waiting),
    ("attnlens_engine_step_errors", "Engine steps that raised", lambda e: e.errors),
    ("attnlens_engine_cancelled_requests", "Requests stopped early because their client went away",
     lambda e: e.cancelled),
    ("attnlens_attention_in_flight", "Attention requests running or waiting for the model",
     lambda e: e.attention_in_flight),
    ("attnlens_kv_cache_budget_bytes", "The most the model's KV cache may hold (ATTNLENS_KV_CACHE_BYTES; on the "
     "CPU its blocks are handed out with the tokens in flight up to this)", lambda e: e.cache_bytes),
    ("attnlens_kv_cache_used_bytes", "What the model's KV cache holds now: the blocks in use on the CPU "
     "(whole rows elsewhere: all of it)", lambda e: e.cache_held),
)


class ForRequestModel:
    """A metric whose first label is `model`: `.labels(*rest)` gives the child for the current
    request's model, so a caller counts as it would without the label
    (`metrics.rejected.labels("queue_full").inc()`)."""

    def __init__(self, metric, metrics: Metrics):
        self.metric = metric
        self.metrics = metrics

    def labels(self, *values: str):
        return self.metric.labels(self.metrics.request_model(), *values)


class LoadedModels:
    """A collector: the gauges read from the loaded models at each scrape (ENGINE_GAUGES, and
    attnlens_model_info for every model, the encoders too)."""

    def __init__(self) -> None:
        self.registry = None  # the app's ModelRegistry, once start-up has loaded it

    def describe(self):
        return [GaugeMetricFamily("attnlens_model_info", "", labels=["model", "family", "default"]),
                *(GaugeMetricFamily(name, doc, labels=["model"]) for name, doc, _ in ENGINE_GAUGES)]

    def collect(self):
        registry = self.registry
        served = list(registry.models.values()) if registry is not None else []
        info = GaugeMetricFamily("attnlens_model_info", "Each loaded model (value 1): its family, and whether "
                                 "requests that name no model get it", labels=["model", "family", "default"])
        for m in served:
            info.add_metric([m.name, m.family.name, str(m.name == registry.default).lower()], 1)
        yield info
        for name, doc, read in ENGINE_GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["model"])
            for m in served:
                gauge.add_metric([m.name], read(m.runner))
            yield gauge


class Metrics:
    def __init__(self, default_model: str = "") -> None:
        self.default_model = default_model  # the label of requests that name no model
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("attnlens_http_requests_total", "HTTP requests by model, route, method and status",
                                ["model", "route", "method", "status"], registry=r)
        self.latency = Histogram("attnlens_http_request_duration_seconds",
                                 "Time from request to the end of the response (streams included)",
                                 ["model", "route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("attnlens_time_to_first_token_seconds",
                              "Time from admission to the first generated token",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter("attnlens_generated_tokens_total", "Tokens generated", ["model"], registry=r)
        self.generations = Counter("attnlens_generations_total", "Generations by how they ended: a finish "
                                   "reason (length, stop, eos), or cancelled (the client went away) or error",
                                   ["model", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("attnlens_prompt_tokens_total", "Prompt tokens processed", ["model"],
                                     registry=r)
        self.rejected = ForRequestModel(Counter("attnlens_rejected_total", "Requests refused before generation",
                                                ["model", "reason"], registry=r), self)
        self.loaded = LoadedModels()
        r.register(self.loaded)

    def bind_registry(self, registry) -> None:
        """Read the gauges of every model in this ModelRegistry from now on."""
        self.loaded.registry = registry
        self.default_model = registry.default

    def request_model(self) -> str:
        """The model of the HTTP request being served (RequestModel), else the default one."""
        current = REQUEST_MODEL.get()
        return (current.name if current is not None else None) or self.default_model

    def observe_generation(self, done) -> None:
        """Record a finished generation from its StreamDone event (for the request's model)."""
        model = self.request_model()
        usage, timings = done.usage, done.timings
        self.generations.labels(model, done.finish_reason).inc()
        self.prompt_tokens.labels(model).inc(usage.prompt_tokens)
        self.generated_tokens.labels(model).inc(usage.completion_tokens)
        if usage.completion_tokens:
            self.ttft.labels(model).observe(timings.time_to_first_token_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# --- the drain: graceful shutdown's side of every request (app/server/shutdown.py drains) ---------
# Still answered while draining: liveness (a draining server is alive; failing it would get the
# pod killed before its streams end) and the metrics that show the drain.
OPEN_WHILE_DRAINING = frozenset({"/healthz", "/metrics"})
SHUTTING_DOWN = "the server is shutting down: send the request again (another replica, or this one once back, takes it)"


class Drain:
    """Whether the server is draining, and how many requests it is still serving."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0  # requests past the drain's check that have not ended (a stream: until its last byte)
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


def drain_refusal(path: str):
    """What a request that arrives while draining gets."""
    if path == "/readyz":
        return JSONResponse({"ready": False, "status": "draining", "detail": "the server is shutting down"},
                            status_code=503)
    return error_response(path, 503, SHUTTING_DOWN, code="shutting_down",
                          headers={"Retry-After": "1", "Connection": "close"})


# --- the body limit ------------------------------------------------------------------------------
class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body larger than {limit} bytes")


class BodyTooSlow(HTTPException):
    def __init__(self, timeout_s: float):
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s "
                              f"(ATTNLENS_BODY_TIMEOUT_S)", headers={"Connection": "close"})


def declared_length(scope) -> int:
    """The request's Content-Length (0 when absent or not a number)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


class BodyLimit:
    """The limits of request bodies: at most `max_bytes`, all of it within `timeout_s` seconds."""

    def __init__(self, max_bytes: int, timeout_s: float | None, error_response):
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.error_response = error_response  # (scope, status, message) -> ASGI response

    def guarded(self, receive):
        """`receive` that counts the body's bytes and times it: a body that lies about (or omits) its
        length, or trickles in, raises BodyTooLarge / BodyTooSlow, which the app's HTTPException
        handler turns into a 413 / 408 like any other. Once the body is complete, receive() is
        passed through untouched (a handler may wait on it for the client's disconnect)."""
        max_bytes, timeout_s = self.max_bytes, self.timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        received = 0
        complete = False

        async def limited_receive():
            nonlocal received, complete
            if complete or deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise BodyTooSlow(timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise BodyTooLarge(max_bytes)
                complete = complete or not message.get("more_body", False)
            else:
                complete = True
            return message

        return limited_receive


# --- the one middleware ----------------------------------------------------------------------------
CLIENT_CLOSED = 499  # nginx's status for an answer that began but did not reach its end


class RequestMiddleware:
    """Every HTTP request, in this order (the app's outermost middleware, so that it sees them all):

    - counted by model, route template and status, and timed to its last byte. An answer that began
      but never sent its last byte (a stream whose client went away, an /attention answer dropped
      for not being read) counts as 499, not as its 200;
    - while the server drains (app/server/shutdown.py), refused (503) unless its path is open, else
      counted as running until its end;
    - its body refused (413) when its Content-Length is over the limit, else counted and timed as
      it arrives (BodyLimit.guarded).
    """

    def __init__(self, app, metrics: Metrics, drain: Drain, body: BodyLimit):
        self.app = app
        self.metrics = metrics
        self.drain = drain
        self.body = body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]
        current = RequestModel()
        token = REQUEST_MODEL.set(current)
        ended = [False]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended[0] = True
            await send(message)

        try:
            await self._serve(scope, receive, send_wrapper)
        except BaseException:
            ended[0] = True  # an error: counted under the status it had (500 unless it began)
            raise
        finally:
            REQUEST_MODEL.reset(token)
            model = current.name or self.metrics.default_model
            label = getattr(scope.get("route"), "path", None) or "unmatched"
            code = status[0] if ended[0] else CLIENT_CLOSED
            self.metrics.requests.labels(model, label, scope["method"], str(code)).inc()
            self.metrics.latency.labels(model, label).observe(time.perf_counter() - start)

    async def _serve(self, scope, receive, send):
        """The request past the drain's check and the body's declared length, or refused by them."""
        if self.drain.draining and scope["path"] not in OPEN_WHILE_DRAINING:
            return await drain_refusal(scope["path"])(scope, receive, send)
        limit = self.body.max_bytes
        declared = declared_length(scope)
        if declared > limit:
            response = self.body.error_response(
                scope, 413, f"request body of {declared} bytes is larger than the limit of {limit} bytes")
            return await response(scope, receive, send)
        self.drain.request_started()
        try:
            await self.app(scope, self.body.guarded(receive), send)
        finally:
            self.drain.request_ended()

"""Prometheus metrics, in a registry of their own per app (several apps may share a process).

Every series carries a `model` label, so that a dashboard sums or splits them across replicas
and models alike:
- what an HTTP request counts (its status and duration, its generations' tokens, a refusal) is
  labelled with the model the request was for: the one it named, else the default model (also
  for requests about no model, such as /healthz);
- the engines' gauges (running, waiting, attention calls...) are read at each scrape, one series
  per loaded model that generates; `attnlens_model_info` lists every loaded model.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the router)
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# The model of the HTTP request being served: MetricsMiddleware puts a fresh one-item list here
# for each request, and ModelRegistry.get fills it in (note_request_model). A list rather than
# the name itself: the tasks a request starts (a stream's body, its exception handlers) run in
# copies of its context, and all of them see the same list.
_REQUEST_MODEL: ContextVar[list | None] = ContextVar("attnlens_request_model", default=None)


def note_request_model(name: str) -> None:
    """The current HTTP request is for model `name`: what it counts is labelled so. Outside a
    request (start-up, warm-up) nothing happens."""
    holder = _REQUEST_MODEL.get()
    if holder is not None:
        holder[0] = name


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
        """The model of the HTTP request being served (note_request_model), else the default one."""
        holder = _REQUEST_MODEL.get()
        return (holder[0] if holder is not None else None) or self.default_model

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


CLIENT_CLOSED = 499  # nginx's status for an answer that began but did not reach its end


class MetricsMiddleware:
    """Count every HTTP request by model, route template and status, and time it to its last byte.
    An answer that began but never sent its last byte (a stream whose client went away, an
    /attention answer dropped for not being read) counts as 499, not as its 200."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]
        token = _REQUEST_MODEL.set([None])
        ended = [False]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended[0] = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            ended[0] = True  # an error: counted under the status it had (500 unless it began)
            raise
        finally:
            model = self.metrics.request_model()
            _REQUEST_MODEL.reset(token)
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            code = status[0] if ended[0] else CLIENT_CLOSED
            self.metrics.requests.labels(model, label, scope["method"], str(code)).inc()
            self.metrics.latency.labels(model, label).observe(time.perf_counter() - start)

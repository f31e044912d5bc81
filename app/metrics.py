"""Prometheus metrics, in a registry of their own per app (several apps may share a process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the router)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("attnlens_http_requests_total", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram("attnlens_http_request_duration_seconds",
                                 "Time from request to the end of the response (streams included)",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("attnlens_time_to_first_token_seconds",
                              "Time from admission to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter("attnlens_generated_tokens_total", "Tokens generated", registry=r)
        self.generations = Counter("attnlens_generations_total", "Generations by how they ended: a finish "
                                   "reason (length, stop, eos), or cancelled (the client went away) or error",
                                   ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("attnlens_prompt_tokens_total", "Prompt tokens processed", registry=r)
        self.rejected = Counter("attnlens_rejected_total", "Requests refused before generation",
                                ["reason"], registry=r)
        self.queue_depth = Gauge("attnlens_queue_depth", "Requests waiting for a slot", registry=r)
        self.in_flight = Gauge("attnlens_requests_in_flight", "Requests being generated", registry=r)
        self.engine_errors = Gauge("attnlens_engine_step_errors", "Engine steps that raised", registry=r)
        self.engine_cancelled = Gauge("attnlens_engine_cancelled_requests",
                                      "Requests stopped early because their client went away", registry=r)
        self.attention_in_flight = Gauge("attnlens_attention_in_flight",
                                         "Attention requests running or waiting for the model", registry=r)

    def bind_engines(self, engines: dict) -> None:
        """The gauges read every generating model's engine (name -> engine), summed."""
        total = lambda attr: lambda: sum(getattr(e, attr) for e in engines.values())
        self.queue_depth.set_function(total("waiting"))
        self.in_flight.set_function(total("in_flight"))
        self.engine_errors.set_function(total("errors"))
        self.engine_cancelled.set_function(total("cancelled"))
        self.attention_in_flight.set_function(total("attention_in_flight"))

    def observe_generation(self, done) -> None:
        """Record a finished generation from its StreamDone event."""
        usage, timings = done.usage, done.timings
        self.generations.labels(done.finish_reason).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generated_tokens.inc(usage.completion_tokens)
        if usage.completion_tokens:
            self.ttft.observe(timings.time_to_first_token_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)


CLIENT_CLOSED = 499  # nginx's status for an answer that began but did not reach its end


class MetricsMiddleware:
    """Count every HTTP request by route template and status, and time it to its last byte.
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
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            code = status[0] if ended[0] else CLIENT_CLOSED
            self.metrics.requests.labels(label, scope["method"], str(code)).inc()
            self.metrics.latency.labels(label).observe(time.perf_counter() - start)

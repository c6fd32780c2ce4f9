"""vLLM's `http_*` metric families on /metrics (what prometheus-fastapi-instrumentator, which vLLM installs,
exports), so dashboards built on them work here: per request, by route template ("handler"), method and
status class ("2xx", "4xx", ...), the count, the latency (coarse buckets by handler and method, fine ones
overall) and the request and response sizes. vLLM's excluded routes (/metrics, /health, /load, /ping,
/version) are not counted; a path no route matches counts as handler "none", and a method outside HTTP's
standard ones as "other" (a client cannot mint label values: each would be a new series forever). Kept by an ASGI middleware
around the whole app: a streamed response is timed and sized to its last byte.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, Summary
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worldserve.api.auth import route_path

EXCLUDED = ("/metrics", "/health", "/load", "/ping", "/version")
"""vLLM's `excluded_handlers`."""
HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10,
                 30, 60)  # fmt: skip
"""The instrumentator's `http_request_duration_highr_seconds` buckets."""
METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"))
"""The methods counted by name (RFC 9110's and PATCH); any other is "other"."""


class HTTPMetrics:
    """The families, in `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                                ["method", "status", "handler"], registry=r)  # fmt: skip
        self.size_in = Summary("http_request_size_bytes", "Content length of incoming requests by handler.",
                               ["handler"], registry=r)  # fmt: skip
        self.size_out = Summary("http_response_size_bytes", "Content length of outgoing responses by handler.",
                                ["handler"], registry=r)  # fmt: skip
        self.latency = Histogram("http_request_duration_seconds", "Latency with few buckets by handler.",
                                 ["method", "handler"], buckets=(0.1, 0.5, 1), registry=r)  # fmt: skip
        self.latency_highr = Histogram("http_request_duration_highr_seconds",
                                       "Latency with many buckets but no labels.", buckets=HIGHR_BUCKETS,
                                       registry=r)  # fmt: skip


class HTTPMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: HTTPMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # (those routes: /healthz is "none"; every path of the /metrics mount, as its handler is /metrics)
        if scope["type"] != "http" or (path := route_path(scope)) in EXCLUDED or path.startswith("/metrics"):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status, sent = 500, 0  # (an app that raises before answering: its 500)

        async def counting(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting)
        finally:
            seconds = time.perf_counter() - start
            handler = self._handler(scope)
            method = scope.get("method", "") if scope.get("method") in METHODS else "other"
            m = self.metrics
            m.requests.labels(method=method, status=f"{status // 100}xx", handler=handler).inc()
            m.size_in.labels(handler=handler).observe(_content_length(scope))
            m.size_out.labels(handler=handler).observe(sent)
            m.latency.labels(method=method, handler=handler).observe(seconds)
            m.latency_highr.observe(seconds)

    @staticmethod
    def _handler(scope: Scope) -> str:
        """The route template that answered ("/v1/videos/{video_id}": FastAPI leaves the matched route in the
        scope), or "none"."""
        return getattr(scope.get("route"), "path", None) or "none"


def _content_length(scope: Scope) -> int:
    """The request's Content-Length header (0 when absent or not a number)."""
    value = Headers(scope=scope).get("content-length", "")
    return int(value) if value.isdigit() else 0

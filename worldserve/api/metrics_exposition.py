"""The /metrics exposition: prometheus_client's ASGI app (the one vLLM mounts) with its OpenMetrics names fixed.

prometheus_client (0.22 and later, client_python issue #1177) writes an OpenMetrics scrape whose escaping is not
`allow-utf-8` (Prometheus 2's default Accept header, `application/openmetrics-text;version=1.0.0,...`, names
none: underscores) with its families' names as they are in `# HELP` / `# TYPE` but its samples' names with
every `:` turned into `_`: `# TYPE vllm:request_success counter` above `vllm_request_success_total{...}`.
Such a scrape is not OpenMetrics (prometheus_client's own parser refuses it, "Clashing name") and Prometheus
stored the samples as `vllm_*` / `worldserve_*`, so the dashboards built for vLLM's `vllm:*` found nothing.
A colon is a legacy metric-name character, which no escaping changes: here each name of a sample is escaped
as its family's name is (prometheus_client's escape_metric_name, for every escaping scheme), so the samples
keep their `vllm:` names. Everything else is prometheus_client's: the format the Accept header asks for
(OpenMetrics or text), only the families a scrape names with `?name[]=`, a gzip body when it accepts one.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterable
from functools import partial
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as om
from prometheus_client.registry import Collector
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

OPENMETRICS = "application/openmetrics-text"


def exposition_app(registry: CollectorRegistry) -> ASGIApp:
    """The ASGI app serving `registry` (an HTTP scope; any method, as prometheus_client's)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = Headers(scope=scope)
        params = parse_qs(scope.get("query_string", b"").decode("utf-8"))
        encoder, content_type = encoder_for(",".join(headers.getlist("accept")))
        source: Collector = registry.restricted_registry(params["name[]"]) if "name[]" in params else registry
        body = encoder(source)
        answer = {"Content-Type": content_type}
        if gzip_accepted(",".join(headers.getlist("accept-encoding"))):
            body = gzip.compress(body)
            answer["Content-Encoding"] = "gzip"
        await Response(body, headers=answer)(scope, receive, send)

    return app


def encoder_for(accept: str) -> tuple[Callable[[Collector], bytes], str]:
    """prometheus_client's choose_encoder, but an OpenMetrics scrape's names escaped alike in its metadata and
    its samples; an Accept whose OpenMetrics version does not parse (`version=abc`: prometheus_client's
    comparison raised, a 500 on every scrape) gets the text format, as one naming no format does."""
    try:
        encoder, content_type = choose_encoder(accept)
    except (TypeError, ValueError):
        encoder, content_type = choose_encoder("")
    if not content_type.startswith(OPENMETRICS):
        return encoder, content_type
    params = dict(p.strip().split("=", 1) for p in content_type.split(";")[1:] if "=" in p)
    escaping = params.get("escaping", om.UNDERSCORES)
    if escaping == om.ALLOWUTF8:  # (names written as they are: prometheus_client's encoder is right)
        return encoder, content_type
    return partial(_openmetrics, escaping=escaping, version=params.get("version", "1.0.0")), content_type


def _openmetrics(registry: Collector, *, escaping: str, version: str) -> bytes:
    """`registry` in OpenMetrics, its names escaped by `escaping` before prometheus_client writes them (as
    allow-utf-8, which writes a legacy name, as every escaped one is, unchanged in the metadata and samples)."""
    return om.generate_latest(_Escaped(registry, escaping), escaping=om.ALLOWUTF8, version=version)


class _Escaped(Collector):
    """`registry`'s families with their names, their samples' names (less their suffixes) and their label
    names escaped by `escaping` (prometheus_client's escape_metric_name / escape_label_name: a legacy name,
    colons included, is kept by underscores and values escaping)."""

    def __init__(self, registry: Collector, escaping: str) -> None:
        self._registry, self._escaping = registry, escaping

    def collect(self) -> Iterable[Metric]:
        esc = self._escaping
        for metric in self._registry.collect():
            name = om.escape_metric_name(metric.name, esc)
            out = Metric(name, metric.documentation, metric.type)
            out.unit = metric.unit
            out.samples = [
                s._replace(name=_sample_name(s.name, metric.name, name, esc),
                           labels={om.escape_label_name(k, esc): v for k, v in s.labels.items()})
                for s in metric.samples
            ]  # fmt: skip
            yield out


def _sample_name(sample: str, family: str, escaped_family: str, escaping: str) -> str:
    """A sample's name: its family's escaped name and the suffix (`_total`, `_bucket`, ...) as it is, as the
    Prometheus client in Go writes them (dots escaping doubles a name's underscores, not its suffix's)."""
    if sample.startswith(family):
        return escaped_family + sample[len(family) :]
    return om.escape_metric_name(sample, escaping)

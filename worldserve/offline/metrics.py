"""The offline Engine's metrics: what `worldserve serve` exports at /metrics, for the requests of one Engine, read
back as vLLM's `LLM.get_metrics()` reads its own (vllm/v1/metrics/reader.py `get_metrics_snapshot`).

`served_state` builds the state the server's routes share (api/state.py AppState) the way serve builds it: a
`Metrics` (api/metrics.py) wired by `Metrics.watch`, build_app's own wiring (the video engine's and the chat
worker's observer, the queue and K/V-cache gauges), exactly as for the server; the Engine's chats are counted
into the same object (offline/chat_requests.py). Each Metrics owns a
CollectorRegistry, so two Engines in one process neither share nor clash.

`metrics_snapshot` turns that registry into vLLM's frozen records: a `Counter` per series (named as its family:
`worldserve:request_success`, whose /metrics sample is `worldserve:request_success_total`), a `Gauge`, a
`Histogram` (cumulative bucket counts by their `le` text, "+Inf" last; count; sum). Only the `worldserve:` and
`vllm:` families: the HTTP layer's `http_*` (no HTTP here) and the process's `process_*` are not the Engine's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from prometheus_client import CollectorRegistry
    from prometheus_client.samples import Sample

    from worldserve.api.state import AppState
    from worldserve.config import EngineConfig
    from worldserve.engine.client import EngineClient

PREFIXES = ("worldserve:", "vllm:")
"""The families a snapshot holds (the engine's: worldserve's own names and their vLLM / vLLM-Omni twins)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Metric:
    """One series of a metric family: its family's name and its labels (`model_name`; vLLM's families also
    `engine`; some a status, a reason or a stage)."""

    name: str
    labels: dict[str, str]


@dataclasses.dataclass(frozen=True, slots=True)
class Counter(Metric):
    """A count that only grows (requests, tokens)."""

    value: int


@dataclasses.dataclass(frozen=True, slots=True)
class Vector(Metric):
    """An ordered array of counters: vLLM's shape for its speculative decoding's accepted tokens by position,
    which worldserve has no family of (defined so that code written for vLLM's reader runs unchanged)."""

    values: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class Gauge(Metric):
    """A value that goes up and down (queued and running requests, K/V cache use), read when the snapshot is
    taken."""

    value: float


@dataclasses.dataclass(frozen=True, slots=True)
class Histogram(Metric):
    """Observations in buckets: `buckets` maps each upper bound, as its `le` label writes it ("0.5", "+Inf"),
    to the count of observations at most that (cumulative: "+Inf" holds `count`); `sum` is their total."""

    count: int
    sum: float
    buckets: dict[str, int]


def served_state(
    client: EngineClient, config: EngineConfig, gpu_memory_bytes: Callable[[], float] | None
) -> AppState:
    """The state `worldserve serve`'s app gives its routes over `client` (commands/serve.py `_serve`: the
    settings of `config`, a Metrics with the load's GPU-memory reader), its metrics wired to the engine as the
    server's are (Metrics.watch, build_app's wiring)."""
    from worldserve.api.metrics import Metrics
    from worldserve.api.state import AppState
    from worldserve.commands.serve import app_settings

    metrics = Metrics(client.model_name, gpu_memory_bytes=gpu_memory_bytes)
    metrics.watch(client)
    return AppState.serving(client, metrics, app_settings(config))


def metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every series of the registry's `worldserve:` / `vllm:` families now, in the registry's order."""
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIXES):
            continue
        reader = _READERS.get(family.type)
        if reader is not None:
            collected += reader(family.name, family.samples)
    return collected


def _named(samples: list[Sample], name: str) -> list[Sample]:
    return [s for s in samples if s.name == name]


def _counters(name: str, samples: list[Sample]) -> list[Metric]:
    return [Counter(name, dict(s.labels), int(s.value)) for s in _named(samples, name + "_total")]


def _gauges(name: str, samples: list[Sample]) -> list[Metric]:
    return [Gauge(name, dict(s.labels), float(s.value)) for s in _named(samples, name)]


def _histograms(name: str, samples: list[Sample]) -> list[Metric]:
    """One Histogram per label set: its `_bucket` samples by `le` (in the registry's order, +Inf last), its
    `_count` and `_sum`."""

    def series(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple((k, v) for k, v in labels.items() if k != "le")

    buckets: dict[tuple[tuple[str, str], ...], dict[str, int]] = {}
    for s in _named(samples, name + "_bucket"):
        buckets.setdefault(series(s.labels), {})[s.labels["le"]] = int(s.value)
    counts = {series(s.labels): int(s.value) for s in _named(samples, name + "_count")}
    sums = {series(s.labels): float(s.value) for s in _named(samples, name + "_sum")}
    return [
        Histogram(name, dict(labels), counts[labels], sums[labels], by_le)
        for labels, by_le in buckets.items()
    ]


_READERS: dict[str, Callable[[str, list[Sample]], list[Metric]]] = {
    "counter": _counters,
    "gauge": _gauges,
    "histogram": _histograms,
}
"""How each family type becomes records (other types, which no engine family is, are skipped as vLLM skips them)."""

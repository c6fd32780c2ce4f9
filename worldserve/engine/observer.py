"""What the video engine reports as it runs (step times, finished, failed and cancelled jobs): the Prometheus metrics
(api/metrics.py) implement `EngineObserver`; `NullObserver` drops everything."""

from __future__ import annotations

from typing import Protocol


class EngineObserver(Protocol):
    """Where the engine reports timings (the Prometheus metrics implement it)."""

    def on_step(self, seconds: float, batch_size: int) -> None: ...

    def on_finished(
        self, e2e_s: float, queue_s: float, stages: dict[str, float], peak_memory_mb: float
    ) -> None: ...

    def on_failed(self, code: int) -> None: ...

    def on_cancelled(self) -> None:
        """A job deleted, or a streamed request stopped, before its end."""


class NullObserver:
    def on_step(self, seconds: float, batch_size: int) -> None:
        pass

    def on_finished(
        self, e2e_s: float, queue_s: float, stages: dict[str, float], peak_memory_mb: float
    ) -> None:
        pass

    def on_failed(self, code: int) -> None:
        pass

    def on_cancelled(self) -> None:
        pass

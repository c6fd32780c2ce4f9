"""What the video engine reports as it runs (step times, finished, failed and cancelled jobs): the Prometheus metrics
(api/metrics.py) implement `EngineObserver`; `NullObserver` drops everything; `RequestGroup` reports the engine
requests of one HTTP request (an image request's n images) as one; `HeldFinish` reports a realtime stream's
finish only once its session has sent it."""

from __future__ import annotations

import threading
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


class _ReportedOnce:
    """An observer in front of `observer` that reports one ending at most: the first failure or cancellation
    passes, later ones do not (the subclass says when a finish does). Endings come from the engine thread, the
    encode pool and the event loop: a lock orders them."""

    def __init__(self, observer: EngineObserver) -> None:
        self._observer = observer
        self._ended = False  # reported (finished, failed or cancelled)
        self._lock = threading.Lock()

    def on_step(self, seconds: float, batch_size: int) -> None:
        self._observer.on_step(seconds, batch_size)

    def on_failed(self, code: int) -> None:
        if self._end():
            self._observer.on_failed(code)

    def on_cancelled(self) -> None:
        if self._end():
            self._observer.on_cancelled()

    def _end(self) -> bool:
        """Whether this ending is the one reported (the first)."""
        with self._lock:
            first, self._ended = not self._ended, True
        return first


class RequestGroup(_ReportedOnce):
    """The engine requests of one HTTP request (an image request's `n` images) reported to `observer` as one
    request, as vLLM-Omni counts a request with num_outputs_per_prompt n: finished once all of them are (its
    latency the last one's, its queue time the first one's, each stage its longest, the largest peak memory);
    failed once, at the first failure (the others, aborted then, count nothing more); cancelled once, unless it
    failed. Its members' endings come from the engine thread and the encode pool: a lock orders them."""

    def __init__(self, observer: EngineObserver, size: int) -> None:
        super().__init__(observer)
        self._size = size
        self._finished: list[tuple[float, float, dict[str, float], float]] = []

    def on_finished(
        self, e2e_s: float, queue_s: float, stages: dict[str, float], peak_memory_mb: float
    ) -> None:
        with self._lock:
            if self._ended:
                return
            self._finished.append((e2e_s, queue_s, stages, peak_memory_mb))
            if len(self._finished) < self._size:
                return
            self._ended = True
        longest: dict[str, float] = {}
        for _, _, member, _ in self._finished:
            for stage, seconds in member.items():
                longest[stage] = max(seconds, longest.get(stage, 0.0))
        self._observer.on_finished(
            max(f[0] for f in self._finished), min(f[1] for f in self._finished), longest,
            max(f[3] for f in self._finished),
        )  # fmt: skip


class HeldFinish(_ReportedOnce):
    """A streamed request's (/v1/realtime/video) ending as its client saw it: the engine finishing it (its parts
    all made) is held until the session has sent the last of them (`delivered`); a session that ends first
    (the client left, or read nothing until the send timed out: the parts were made into memory ahead of the
    socket) reports it cancelled (`undelivered`), also when the engine's finish comes after it (the caller
    left while the last frames were still being encoded: the abort came too late to stop them). A failure or
    cancellation the engine reports passes at once. One report in all; the engine's calls come from its thread
    and the encode pool, the session's from the event loop: a lock orders them."""

    def __init__(self, observer: EngineObserver) -> None:
        super().__init__(observer)
        self._held: tuple[float, float, dict[str, float], float] | None = None
        self._abandoned = False  # undelivered() came before the engine's finish

    def on_finished(
        self, e2e_s: float, queue_s: float, stages: dict[str, float], peak_memory_mb: float
    ) -> None:
        with self._lock:
            if self._ended:
                return
            if not self._abandoned:
                self._held = (e2e_s, queue_s, stages, peak_memory_mb)
                return
            self._ended = True
        self._observer.on_cancelled()

    def delivered(self) -> None:
        """The session sent every part: a held finish is reported."""
        with self._lock:
            held = self._held if not self._ended else None
            self._ended = self._ended or held is not None
        if held is not None:
            self._observer.on_finished(*held)

    def undelivered(self) -> None:
        """The session ended without sending every part: a held finish is reported as cancelled, and one
        still to come will be (the engine's own failure or cancellation, if that comes instead, is reported
        as it is)."""
        with self._lock:
            held = self._held is not None and not self._ended
            self._ended = self._ended or held
            self._abandoned = True
        if held:
            self._observer.on_cancelled()

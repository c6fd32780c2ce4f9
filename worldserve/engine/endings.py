"""How a video request ends: its MP4 muxed and its job saved, its frames or result handed to its caller, or
its failure / cancellation reported; one `Endings` per engine.

The engine thread (engine.py) decides *when* a request ends; this module is *what* ending means, and much of
it runs in the engine's CPU pool (the mux, an ephemeral request's `on_frames`), so every method here may run
off the engine thread: each touches only the request it is given, the job store (thread-safe), the metrics
observer and `on_done`. A request ends exactly once: completed (`encode_and_save` / `hand_over`), failed
(`fail`) or cancelled (`cancelled`); each of them calls `on_done(job_id)` so the HTTP side can wake waiters
(an ephemeral request's caller learns through `request.on_result`). A job that the engine loop was running
when it crashed is queued again (`park_after_crash`), or fails if the server has stopped running it too often.
What the store meets on its disk ends the job too (a StorageError, 507 or 503): recording a failure never
raises into the engine thread or the pool, so neither the loop nor a waiter's answer depends on the disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from worldserve.engine.jobs import GIVEN_UP_MESSAGE, JobStore
from worldserve.engine.observer import EngineObserver
from worldserve.engine.outputs import VideoResult
from worldserve.engine.refusals import CancelledRequest, error_for
from worldserve.engine.request import Request
from worldserve.failures import release_frames
from worldserve.media.frame_stream import FramesCancelled, FramesLost, FrameStream

log = logging.getLogger(__name__)

Encoder = Callable[..., bytes]
"""`encode_mp4(frames, fps, audio, sample_rate=..., crf=..., codec_options=...) -> bytes`."""


def default_encoder(*args: Any, **kwargs: Any) -> bytes:
    """media.video.encode_mp4, imported on first use (PyAV)."""
    from worldserve.media.video import encode_mp4

    return encode_mp4(*args, **kwargs)


class Endings:
    def __init__(self, store: JobStore, encoder: Encoder, observer: EngineObserver, ttl_s: float | None):
        self.store = store
        self.observer = observer
        self.on_done: Callable[[str], None] = lambda job_id: None
        self.service_ewma_s: float | None = None
        """Mean seconds from admission to a saved MP4 (exponentially weighted), None before the first."""
        self._encoder = encoder
        self._ttl_s = ttl_s

    def encode_and_save(self, request: Request, result: VideoResult) -> None:
        """Mux the MP4 (reading a FrameStream's chunks as they come) and complete the job. The "encode"
        stage is the mux's wall time, which overlaps the decode when the frames stream."""
        try:
            t0 = time.monotonic()
            frames = result.frames if isinstance(result.frames, FrameStream) else np.asarray(result.frames)
            video = self._encoder(
                frames, result.fps, result.audio, sample_rate=result.sample_rate,
                crf=request.encode.crf, codec_options=request.encode.codec_options,
            )  # fmt: skip
            now = time.monotonic()
            stages = {**request.stage_seconds, **result.stage_seconds, "encode": now - t0}
            saved = self.store.complete(
                request.job_id, video, completed_at=time.time(), ttl_s=self._ttl_s,
                inference_time_s=now - request.admitted_at, stage_durations=_rounded(stages),
                peak_memory_mb=float(result.peak_memory_mb),
            )  # fmt: skip
            if saved:
                service = now - request.admitted_at
                ewma = self.service_ewma_s
                self.service_ewma_s = service if ewma is None else 0.8 * ewma + 0.2 * service
                _observer(self, request).on_finished(
                    now - request.arrival_time, request.admitted_at - request.arrival_time, stages,
                    float(result.peak_memory_mb),
                )  # fmt: skip
            elif self.store.get(request.job_id) is None:  # deleted while its MP4 was made: the engine had
                _observer(self, request).on_cancelled()  # let it go to the encoder, so nothing counted it
        except FramesLost:
            return  # the decode failed: the engine thread failed the job
        except Exception as exc:
            self.fail(request, exc)
        except BaseException as exc:  # (SystemExit, KeyboardInterrupt in this pool thread) the job still ends
            self.fail(request, exc)
            raise
        self.on_done(request.job_id)

    def encode_streamed(self, request: Request, result: VideoResult, frames: FrameStream) -> None:
        """`encode_and_save` reading the frames as the decode makes them."""
        result.frames = frames
        self.encode_and_save(request, result)

    def hand_over(self, request: Request, result: VideoResult) -> None:
        """An ephemeral request's end: its stage times and the metrics, then its caller gets the result."""
        now = time.monotonic()
        stages = {**request.stage_seconds, **result.stage_seconds}
        result.stage_seconds = stages
        try:
            _observer(self, request).on_finished(
                now - request.arrival_time, request.admitted_at - request.arrival_time, stages,
                float(result.peak_memory_mb),
            )  # fmt: skip
        except Exception:  # the metrics' fault: the caller still gets its result
            log.exception("observer.on_finished failed for %s", request.job_id)
        request.deliver(result)

    def hand_streamed(self, request: Request, result: VideoResult, frames: FrameStream) -> None:
        """An ephemeral request's frames, as the decode makes them, to its caller's `on_frames` (in the
        pool), then its end, once: the result; or the abort when it cut the frames short (an abort after
        the last chunk was made is too late: the caller gets the result); a decode that failed is ended by
        the engine thread."""
        result.frames = frames
        on_frames = request.on_frames
        assert on_frames is not None, "hand_streamed takes a streaming request"
        try:
            on_frames(result)
        except FramesLost as exc:
            if isinstance(exc.__cause__, FramesCancelled):
                self.cancelled(request)
            return
        except Exception as exc:
            self.fail(request, exc)
            return
        except BaseException as exc:  # (SystemExit, KeyboardInterrupt in this pool thread) it still ends
            self.fail(request, exc)
            raise
        self.hand_over(request, result)

    def cancelled(self, request: Request) -> None:
        self.count_cancelled(request)
        if request.ephemeral:
            request.deliver(CancelledRequest(request.job_id, request.stop_reason))
        self.on_done(request.job_id)

    def count_cancelled(self, request: Request) -> None:
        """A request stopped before its end, in the metrics: failed with its abort's own status when one was
        set (a timeout's 504, a stalled stream's), else cancelled."""
        if request.abort_status is not None:
            _observer(self, request).on_failed(request.abort_status)
        else:
            _observer(self, request).on_cancelled()

    def fail(self, request: Request, exc: BaseException) -> None:
        code, message, param = error_for(exc)
        if code >= 500:
            log.error("job %s failed: %s", request.job_id, message, exc_info=exc)
        else:
            log.info("job %s rejected: %s", request.job_id, message)
        release_frames(exc)  # (a kept log record or caller holds no latents through its frames: failures.py)
        if request.ephemeral:
            _observer(self, request).on_failed(code)
            request.deliver(exc)
        elif self._record_failure(request.job_id, code, message, param):
            _observer(self, request).on_failed(code)
        self.on_done(request.job_id)

    def _record_failure(self, job_id: str, code: int, message: str, param: str | None) -> bool:
        """The store's `fail`; a fault of the store's own (it handles the disk's) is logged and the job still
        ends here, counted failed (its row stays unfinished: a restart runs it again)."""
        try:
            return self.store.fail(
                job_id, code, message, completed_at=time.time(), ttl_s=self._ttl_s, param=param
            )
        except Exception:
            log.exception("job %s: its failure could not be recorded", job_id)
            return True

    def park_after_crash(self, requests: Sequence[Request]) -> set[str]:
        """The jobs the engine loop was running when it crashed, queued again with the crash counted (jobs.py:
        MAX_INTERRUPTIONS, as a death of the process counts); the ids of those the server has now stopped
        that many times, failed instead (500, GIVEN_UP_MESSAGE): counted failed, their waiters woken."""
        given_up = set(self.store.requeue([r.job_id for r in requests], crashed=True, ttl_s=self._ttl_s))
        for request in requests:
            if request.job_id not in given_up:
                continue
            log.error("job %s failed: %s", request.job_id, GIVEN_UP_MESSAGE)
            try:
                _observer(self, request).on_failed(500)
            except Exception:  # the metrics' fault: the job still ends
                log.exception("observer.on_failed failed for %s", request.job_id)
            self.on_done(request.job_id)
        return given_up


def _observer(ends: Endings, request: Request) -> EngineObserver:
    """Where `request`'s end is reported: its own observer (a RequestGroup), else the engine's."""
    return request.observer or ends.observer


def _rounded(stages: dict[str, float]) -> dict[str, float]:
    return {k: round(float(v), 4) for k, v in stages.items()}

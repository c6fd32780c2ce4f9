"""One video request inside the engine: its immutable inputs and the mutable bookkeeping of its lifetime.

A `Request` is created by the client when a job is submitted (or re-submitted after a restart), waits in
the scheduler, gets a backend `DenoiseState` when admitted (`prepare`), advances one denoising step per
engine iteration, then is decoded and handed to the encoder pool. Only the engine thread mutates it, except
`stage_seconds["encode"]`, written by the one encoder that owns the request after decode, and the stop
marks other threads set for the engine to act on at its next step: `abort_status` (the event loop: a
realtime stream's stall, an ephemeral request's end) and `stop_reason` (Engine.stop_now's caller).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from worldserve.engine.observer import EngineObserver
from worldserve.engine.outputs import DenoiseState, VideoResult
from worldserve.params import VideoParams


@dataclass(frozen=True, slots=True, kw_only=True)
class EncodeOptions:
    """How the finished frames become an MP4 (per request, from `quality` / `extra_params`)."""

    crf: int = 18
    """x264 constant rate factor (0 = lossless)."""
    codec_options: dict[str, str | int | float] | None = None
    """Extra libx264 options (`extra_params.video_codec_options`); None: the encoder's defaults."""


@dataclass(slots=True, eq=False, kw_only=True)
class Request:
    job_id: str
    params: VideoParams
    encode: EncodeOptions = field(default_factory=EncodeOptions)
    arrival_time: float
    """Monotonic clock when the job was (re-)submitted: e2e latency and queue time start here."""
    state: DenoiseState | None = None
    """The backend's per-request state; set by `prepare`, dropped after `release`."""
    admitted_time: float | None = None
    """Monotonic clock when the scheduler admitted it (prepare started)."""
    admitted: bool = False
    """Taken from the queue by the scheduler (set for a whole admitted batch before any of it is prepared,
    where admitted_time waits for its own prepare): a queued request's session may be refused at a shutdown,
    an admitted one runs within the grace."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Engine-measured stage wall times: prepare, diffuse (sum of its steps), decode, encode."""
    decode_started: float | None = None
    """Monotonic clock when its decode started (None before)."""
    on_result: Callable[[VideoResult | BaseException], None] | None = None
    """Set for an ephemeral request (POST /v1/images/generations, /v1/realtime/video): no job in the store,
    no MP4; the decoded result, or the exception that ended it, goes here (from the engine thread or, after
    `on_frames`, from the encode pool) instead."""
    abort_status: int | None = None
    """Set before an abort that ends the request as a failure (504: past its caller's timeout, or stalled):
    counted as a failed request with this status rather than as cancelled."""
    stop_reason: str | None = None
    """Set when the engine stopped the request's decode at its shutdown deadline (the engine parks it: a job
    is queued again, an ephemeral request's caller gets CancelledRequest with this reason)."""
    on_frames: Callable[[VideoResult], None] | None = None
    """An ephemeral request that streams (/v1/realtime/video): called on the engine's encode pool with the
    result whose `frames` is a FrameStream, read while the engine thread decodes (it raises FramesLost when
    the decode fails or is aborted); `on_result` gets the result once it has returned."""

    observer: EngineObserver | None = None
    """Where its end is reported instead of the engine's observer (a RequestGroup: the n images of one image
    request count as one request); None: the engine's."""

    @property
    def ephemeral(self) -> bool:
        return self.on_result is not None

    def deliver(self, outcome: VideoResult | BaseException) -> None:
        """An ephemeral request's end (its result, or the exception that ended it) to its caller."""
        if self.on_result is None:
            raise RuntimeError(f"request {self.job_id} is not ephemeral: its end goes to the job store")
        self.on_result(outcome)

    @property
    def admitted_at(self) -> float:
        """`admitted_time` of a request the scheduler admitted (an ending's timings start there)."""
        if self.admitted_time is None:
            raise RuntimeError(f"request {self.job_id} was never admitted")
        return self.admitted_time

    @property
    def prepared(self) -> DenoiseState:
        """The backend state of a request that is running (prepared, not yet released)."""
        if self.state is None:
            raise RuntimeError(f"request {self.job_id} has no backend state (not prepared, or released)")
        return self.state

    @property
    def num_steps(self) -> int:
        return self.state.num_steps if self.state is not None else self.params.num_inference_steps

    @property
    def steps_done(self) -> int:
        return self.state.step_index if self.state is not None else 0

    @property
    def denoised(self) -> bool:
        return self.state is not None and self.state.step_index >= self.state.num_steps

    def seconds_left(self, now: float) -> float | None:
        """Rough seconds until it ends at its own pace so far (a full queue's Retry-After before any job has
        ended): decoding, as long again as its decode has run; denoising, its time since admission over the
        share of its steps done; None before its first step. Other threads call it: `state` is read once (the
        engine thread may release it meanwhile)."""
        if self.decode_started is not None:
            return now - self.decode_started
        state, admitted = self.state, self.admitted_time
        if state is None or admitted is None or state.step_index <= 0:
            return None
        return (now - admitted) * max(0, state.num_steps - state.step_index) / state.step_index

    @property
    def progress(self) -> int:
        """Percent of denoising steps done; 99 at most, 100 is reserved for a saved video."""
        return min(99, self.steps_done * 100 // max(1, self.num_steps))

"""The video engine: a busy loop in its own thread driving a `VideoBackend` one denoising step at a time.

Each iteration: apply the inbox (new requests, aborts) -> admit (`backend.prepare`, job `in_progress`) ->
step the scheduler's batch once (`backend.denoise`) and write every member's progress to the job store ->
decode the requests that finished their steps (`backend.decode`, then `backend.release`), handing a job's
frames chunk by chunk, as the VAE makes them, to a CPU pool that muxes the MP4 meanwhile and saves the job
(media/frame_stream.py), so encoding overlaps the decode and the next request's denoising.

Invariants: only this thread calls the backend and touches the scheduler; other threads talk to it through
`add_request` / `abort` / `drain` / `stop` (a condition-guarded inbox). An abort takes effect at the next
step boundary (during a decode: at its next chunk of frames) and always releases the request's state. An
exception inside a request (prepare, its denoise step, decode, encode) fails only that job (status `failed`,
error {code, message}; a failed batched step is tried again request by request: batch.py); the loop itself
never dies of one, except `BackendLost` (a multi-GPU pipeline lost a peer rank): then it stops as on a crash
and its jobs wait in the store. Backend calls run under `model_lock`, which the chat worker (chat_worker.py)
also takes around each chat prefill / decode step, so chat and video share the model step by step, unless the
chat backend runs beside video steps on its own CUDA stream (runner/chat_share.py: then it takes no lock).
How a request ends (its MP4 saved, its result handed over, its failure or cancellation reported,
`on_done(job_id)` called so the HTTP side can wake waiters) is endings.py's, from this thread or the encode
pool; how the engine stops (drain, stop, stop_now, the running jobs parked when the loop ends) is
engine_shutdown.py's, Engine's base class.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from worldserve.config import SchedulerConfig
from worldserve.engine.batch import step_batch
from worldserve.engine.endings import Encoder, Endings, default_encoder
from worldserve.engine.engine_shutdown import EngineShutdown
from worldserve.engine.jobs import JobStore
from worldserve.engine.observer import EngineObserver, NullObserver
from worldserve.engine.outputs import BackendLost, VideoBackend, VideoResult, crash_reason
from worldserve.engine.refusals import SHUTDOWN_REASON
from worldserve.engine.request import Request
from worldserve.engine.scheduler import Scheduler
from worldserve.lasting_pool import LastingThreadPool
from worldserve.media.frame_stream import FrameStream, lower_thread_priority, read_beside

log = logging.getLogger(__name__)


class Engine(EngineShutdown):
    def __init__(
        self,
        backend: VideoBackend,
        store: JobStore,
        config: SchedulerConfig,
        *,
        encoder: Encoder = default_encoder,
        observer: EngineObserver | None = None,
        job_ttl_s: float | None = None,
    ):
        self.backend = backend
        self.store = store
        self.config = config
        self._ends = Endings(store, encoder, observer or NullObserver(), job_ttl_s)
        self.on_crash: Callable[[BaseException], None] = lambda exc: None
        """Called on the engine thread once its loop has crashed (the jobs it held are queued again)."""
        self._sched = Scheduler(config.max_batch_size)
        self._cv = threading.Condition()
        self._inbox: list[Request | str] = []  # what other threads asked: a Request to add, a job id to abort
        self._waiting_ids: set[str] = set()  # queued, not yet admitted nor aborted (inbox + scheduler); _cv
        # the decodes in progress: their stop events (set by abort() and stop()) and requests; _cv
        self._decode_stops: dict[str, tuple[threading.Event, Request]] = {}
        self._num_running = 0
        self._draining = False
        self._hard_stop = False
        self._stop_reason = SHUTDOWN_REASON
        """Why the loop ended (once it has): what an ephemeral request arriving later is cancelled for."""
        self._stopped = False  # set when the loop has ended (ephemeral requests are refused from then on)
        # the muxes yield the CPUs to this engine's thread, which feeds the GPU; the pool serves through the
        # interpreter's exit (an offline Engine's request in a thread Python waits for: lasting_pool.py)
        self._pool = LastingThreadPool(
            config.encode_workers, thread_name_prefix="worldserve-encode", initializer=lower_thread_priority
        )
        self._thread = threading.Thread(target=self._run, name="worldserve-engine", daemon=True)
        self.crashed: BaseException | None = None
        self.model_lock = threading.Lock()
        """Held around every backend model call; the chat worker takes it too (shared und weights)."""

    # -- API for other threads --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def add_request(self, request: Request) -> None:
        self.add_requests((request,))

    def add_requests(self, requests: Sequence[Request]) -> None:
        """Queue `requests` together: the loop takes them from the inbox in one piece, so same-shape ones
        are admitted at the same step boundary and batch from their first step (added one by one, the loop
        can wake between two and start the first alone)."""
        with self._cv:
            for request in requests:
                if self._stopped and request.ephemeral:  # the loop is gone: nothing would ever run it
                    self._end_at_shutdown(request, self._stop_reason)
                    continue
                self._inbox.append(request)
                self._waiting_ids.add(request.job_id)
            self._cv.notify()

    def abort(self, job_id: str) -> None:
        """Abort at the next step boundary, or during its decode at the next chunk of frames; a request still
        waiting stops counting as queued right away (admission control reads num_waiting, and the loop may
        be busy for a while)."""
        with self._cv:
            self._waiting_ids.discard(job_id)
            self._inbox.append(job_id)
            if (decoding := self._decode_stops.get(job_id)) is not None:
                decoding[0].set()
            self._cv.notify()

    @property
    def observer(self) -> EngineObserver:
        return self._ends.observer

    @observer.setter
    def observer(self, observer: EngineObserver) -> None:
        self._ends.observer = observer

    @property
    def on_done(self) -> Callable[[str], None]:
        """Called (from this thread or an encoder) whenever a job reaches completed/failed or is aborted."""
        return self._ends.on_done

    @on_done.setter
    def on_done(self, on_done: Callable[[str], None]) -> None:
        self._ends.on_done = on_done

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.crashed is None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting_ids)

    @property
    def num_running(self) -> int:
        return self._num_running

    def estimated_slot_wait_s(self) -> float:
        """Rough seconds until a queue slot frees: when the first running job will end at its own pace so far
        (its time since admission over the share of its steps done, or as long again as its decode has run);
        with none under way yet, the mean service time / batch size, else 1 s. The running jobs' own pace comes
        first: after small jobs the mean said 4 s while a large one had 17 s left (the OpenAI SDK retries twice,
        after the Retry-After it is given), and a 429 during the server's first long job had said 1 s."""
        now = time.monotonic()
        with self._cv:  # (the decodes' table changes under _cv; the running list is copied whole)
            requests = [*self._sched.running, *(request for _, request in self._decode_stops.values())]
        paces = [left for r in requests if (left := r.seconds_left(now)) is not None]
        if paces:
            return min(paces)
        ewma = self._ends.service_ewma_s
        return 1.0 if ewma is None else ewma / self.config.max_batch_size

    # -- the loop (engine thread) -----------------------------------------------------------------------
    def _run(self) -> None:
        crashed: BaseException | None = None
        try:
            # (the compiled layers' per-thread settings)
            prepare = getattr(self.backend, "prepare_thread", None)
            if prepare is not None:
                prepare()
            while True:
                with self._cv:
                    while not (self._inbox or self._sched.has_work() or self._should_exit()):
                        self._cv.wait()
                    inbox, self._inbox = self._inbox, []
                    self._sched.admitting = not self._draining
                for item in inbox:
                    if isinstance(item, Request):
                        self._sched.add(item)
                    else:
                        self._abort(item)
                if self._draining:  # never admitted now, and nothing to resume them from
                    self._cancel_waiting_ephemeral([], SHUTDOWN_REASON)
                if self._should_exit():
                    break
                self._iterate()
        except BaseException as exc:  # a bug in the loop itself: report unhealthy rather than hang
            crashed = exc
            if isinstance(exc, BackendLost):  # not a bug: one line, the traceback is the backend's log
                log.error("the engine has stopped: %s", exc)
            else:
                log.exception("engine loop crashed")
        finally:
            try:
                self._park_running(
                    SHUTDOWN_REASON if crashed is None else f"the engine has stopped: {crash_reason(crashed)}"
                )
            finally:  # reported once the running jobs are queued again (health, alive, on_crash)
                self.crashed = crashed
        if crashed is not None:
            self.on_crash(crashed)

    def _should_exit(self) -> bool:
        return self._hard_stop or (self._draining and not self._sched.running)

    def _iterate(self) -> None:
        admitted = self._sched.admit()
        self._num_running = len(self._sched.running) + len(admitted)  # (counted before they stop waiting)
        # all of them stop waiting together: one by one, the ones not yet prepared (a prefill each) were
        # counted running and waiting at once
        with self._cv:
            self._waiting_ids.difference_update(request.job_id for request in admitted)
        for request in admitted:
            request.admitted = True
        for i, request in enumerate(admitted):
            try:
                self._prepare(request)
            except BackendLost:  # the loop stops: this one and the ones not yet prepared wait again
                if not request.ephemeral:
                    self.store.requeue([request.job_id])
                with self._cv:
                    self._waiting_ids.update(waiting.job_id for waiting in admitted[i:])
                for waiting in admitted[i:]:
                    waiting.admitted = False
                self._sched.waiting.extendleft(reversed(admitted[i:]))
                raise
        batch = self._sched.next_batch()
        if batch:
            self._step(batch)
        self._num_running = len(self._sched.running)

    def _prepare(self, request: Request) -> None:
        try:
            if not request.ephemeral and not self.store.mark_in_progress(request.job_id, time.time()):
                self._ends.cancelled(request)  # deleted while it waited (its abort, queued, finds nothing)
                return
            request.admitted_time = t0 = time.monotonic()
            with self.model_lock:
                request.state = self.backend.prepare(request.job_id, request.params)
        except BackendLost:  # nothing can run any more: a crash of the loop (_iterate queues it again)
            raise
        except Exception as exc:  # a bad input, or the disk refused the admission write (a StorageError)
            self._ends.fail(request, exc)
            return
        request.stage_seconds["prepare"] = time.monotonic() - t0
        self._sched.start(request)

    def _step(self, batch: list[Request]) -> None:
        """One denoising step of `batch`; a failure fails only the requests that fail alone (batch.py)."""
        outcome = step_batch(self.backend, batch, self.model_lock)
        if outcome.too_large:  # (out of memory at this size: not paid again every step)
            self._sched.shrink(batch[0].prepared.batch_key, len(batch))
            log.warning("a batch of %d failed as a batch and stepped alone: this shape now steps in batches of "
                        "%d", len(batch), self._sched.caps[batch[0].prepared.batch_key])  # fmt: skip
        for seconds, size in outcome.calls:
            self.observer.on_step(seconds, size)
        for request, exc in outcome.failed:
            self._sched.finish(request)
            self._release(request)
            self._ends.fail(request, exc)
        for request, seconds in outcome.stepped:
            request.stage_seconds["diffuse"] = request.stage_seconds.get("diffuse", 0.0) + seconds
        self.store.set_progress([(r.job_id, r.progress) for r, _ in outcome.stepped if not r.ephemeral])
        for request, _ in outcome.stepped:
            if request.denoised:
                self._sched.finish(request)
                self._decode(request)

    def _decode(self, request: Request) -> None:
        """Decode a finished request. A job's frames stream to its MP4 encode (in the pool) chunk by chunk
        while the decode runs; an ephemeral request (an image) gets the whole result. An abort that came
        during its last step skips the decode; one that comes during it stops it at the next chunk."""
        request.decode_started = t0 = time.monotonic()

        def decoded() -> None:
            request.stage_seconds["decode"] = time.monotonic() - t0

        stop = self._watch_decode(request)
        streamed, failure = False, None
        try:
            if not stop.is_set():
                result, streamed = self._run_decode(request, stop, decoded)
        except Exception as exc:  # (a streamed encode stops with FramesLost: the job fails here, once)
            failure = exc
        finally:
            parked, cancelled = self._unwatch_decode(request)
            self._release(request)
        if parked and not request.ephemeral:  # as _park_running: queued again, resumed at the next start
            self.store.requeue([request.job_id])
            log.warning(
                "stopped job %s in its decode at the shutdown deadline; it is queued again", request.job_id
            )
            return
        if cancelled and not (streamed and request.ephemeral):  # (else the reader ends it: hand_streamed)
            self._ends.cancelled(request)
        elif failure is not None:
            self._ends.fail(request, failure)
            failure = None  # (its traceback holds this frame: a cycle that would keep the decode's tensors)
            return
        if cancelled or streamed:
            return
        decoded()
        if request.ephemeral:  # the caller encodes (an image): hand the frames over
            self._ends.hand_over(request, result)
            return
        self._pool.submit(self._ends.encode_and_save, request, result)

    def _watch_decode(self, request: Request) -> threading.Event:
        """The stop event of `request`'s decode, registered (abort() and stop() set it under _cv): already set
        when an abort of it waits in the inbox, or when the engine is stopping hard."""
        stop = threading.Event()
        with self._cv:
            self._decode_stops[request.job_id] = (stop, request)
            if request.job_id in self._inbox:  # (an abort of it waits there)
                stop.set()
            elif self._hard_stop:  # (its last step ended after the stop: it is parked, not decoded)
                request.stop_reason = SHUTDOWN_REASON
                stop.set()
        return stop

    def _run_decode(
        self, request: Request, stop: threading.Event, decoded: Callable[[], None]
    ) -> tuple[VideoResult, bool]:
        """(the backend's decode of `request`, whether its frames were streamed): under model_lock, a streamed
        decode runs here chunk after chunk, its frames read beside it in the pool until the end or `stop`."""
        with self.model_lock:
            stream = not request.ephemeral or request.on_frames is not None
            result = self.backend.decode(request.prepared, stream=stream)
            if stream:  # the decode runs here, chunk after chunk
                frames = result.frames
                if not isinstance(frames, FrameStream):  # (a backend that cannot stream)
                    result.frames = frames = FrameStream.of(np.asarray(frames))
                reader = self._ends.hand_streamed if request.ephemeral else self._ends.encode_streamed
                read_beside(frames, partial(reader, request, result), self._pool,
                            before_end=decoded, stop=stop)  # fmt: skip
        return result, stream

    def _unwatch_decode(self, request: Request) -> tuple[bool, bool]:
        """Unregister `request`'s decode stop event: (parked, cancelled). Parked: the shutdown's deadline
        stopped it before its last chunk (it is queued again); cancelled: it stopped for any other reason."""
        with self._cv:  # (abort() and stop() set the event under _cv: after this, the outcome is settled)
            stopped = self._decode_stops.pop(request.job_id)[0].is_set()
            user_abort = request.job_id in self._inbox
        # the shutdown's deadline stopped it (not its caller), before its last chunk (else it just ends)
        deadline = stopped and request.stop_reason is not None and not user_abort
        parked = deadline and "decode" not in request.stage_seconds
        cancelled = stopped and (parked or not deadline)
        return parked, cancelled

    def _abort(self, job_id: str) -> None:
        request = self._sched.remove(job_id)
        if request is None:
            return  # unknown, already finished (its decode stopped), or being encoded (the store drops it)
        self._release(request)
        self._num_running = len(self._sched.running)
        self._ends.cancelled(request)

    def _release(self, request: Request) -> None:
        if request.state is None:
            return
        state, request.state = request.state, None
        try:
            self.backend.release(state)
        except Exception:
            log.exception("backend.release failed for %s", request.job_id)

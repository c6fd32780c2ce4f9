"""EngineClient: the asyncio-side handle on the engine and the job store; the only thing `api/` talks to.

The HTTP event loop never waits on GPU work: `create_job` admits a job (the queue bound, the shutdown), then
its `jobs` (VideoJobs, engine/video_jobs.py) persist it queued and drop a `Request` into the engine's inbox
(`submit` / `delete` are the synchronous forms of `create_job` / `delete_job`, for callers off the event loop:
the engine tests). Completion comes back from the engine thread as `on_done(job_id)`, bridged into the loop
with `loop.call_soon_threadsafe`, which resolves the futures of `wait(job_id)` (the sync route;
job_waiters.py). Store reads are short SQLite queries on a connection of their own and run inline; creates
and deletes write on a thread (a locked database or a slow fsync holds their requests only).

Lifecycle: `start()` re-submits every job the store reports unfinished (a crash or shutdown left it queued
or in progress; it re-runs from its persisted inputs, or fails with a reason: job_recovery.py), then starts
the engine thread and, with a TTL, the expiry sweep (VideoJobs.expire_forever). `begin_shutdown()` stops
intake (submit raises `ShuttingDownError` -> 503) and lets running requests finish; `shutdown()` stops the
engine and wakes the remaining waiters with `ShuttingDownError` (their jobs stay queued for the next start).
`death()` says why nothing here can serve again (the engine loop crashed, the chat worker's loop failed, a peer
rank lost: /health's 503 too); `worldserve serve` then stops as on SIGTERM (commands/engine_death.py).
Chat completions (when a chat backend is given) run in a ChatWorker thread; `chat_many(choices)` starts a
request's choices together and gives a `ChatEvents` async iterator for each (ChatStarted, ChatDelta..., or
ChatFailed), bridged with call_soon_threadsafe. Shutdown gives running chats the same timeout as jobs, then
fails them with a 503 (on a deadline of their own: the engine may be inside a decode it cannot interrupt).
Image batches and realtime streams run without jobs through `jobless` (engine/ephemeral.py), admitted by
the same queue bound.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from worldserve.chat_params import ChatParams
from worldserve.config import DEFAULT_MAX_NUM_SEQS
from worldserve.engine.chat_events import ChatEvent, ChatEvents, ChatFailed, ChatStarted
from worldserve.engine.chat_metering import ChatMeter, metered
from worldserve.engine.chat_observer import ChatObserver, ChatTimes
from worldserve.engine.chat_worker import ChatWorker
from worldserve.engine.engine import Engine
from worldserve.engine.ephemeral import JoblessRequests
from worldserve.engine.job_files import StorageError
from worldserve.engine.job_waiters import JobWaiters
from worldserve.engine.jobs import Job, JobSpec, JobStatus, JobStore
from worldserve.engine.observer import EngineObserver, HeldFinish
from worldserve.engine.outputs import ChatBackend, ChatDelta, TokenLogprob, VideoResult, crash_reason
from worldserve.engine.prompt_upsampling import (
    UpsamplerConfig,
    UpsamplingFailed,
    built_upsampling_chat,
    check_upsampling,
    checked,
    model_checked,
    unless_stopping,
    upsample,
)
from worldserve.engine.refusals import (
    SHUTDOWN_REASON,
    ChatUnavailableError,
    QueueFullError,
    ShuttingDownError,
    error_for,
)
from worldserve.engine.request import EncodeOptions, Request
from worldserve.engine.video_jobs import VideoJobs
from worldserve.params import ParamError, VideoParams

__all__ = [
    "ChatDelta", "ChatEvent", "ChatEvents", "ChatFailed", "ChatMeter", "ChatStarted", "ChatTimes", "ChatUnavailableError", "EncodeOptions", "EngineClient", "HeldFinish", "Job", "JobSpec",
    "JobStatus", "NO_REASONER", "QueueFullError", "Request", "SHUTDOWN_REASON", "ShuttingDownError", "StorageError", "TokenLogprob", "UpsamplingFailed", "VideoResult", "error_for", "metered",
]  # fmt: skip

log = logging.getLogger(__name__)
SWEEP_PERIOD_MAX_S = 60.0
NO_REASONER = (
    "this server runs no Reasoner, so its text routes (chat, completions, responses, tokenize) are not "
    "available: the fake backend, or --tensor-parallel-size > 1"
)


class EngineClient:
    def __init__(
        self,
        engine: Engine,
        store: JobStore,
        *,
        model_name: str,
        max_queued_requests: int,
        job_ttl_s: float | None = None,
        sweep_interval_s: float | None = None,
        chat_backend: ChatBackend | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        upsampler: UpsamplerConfig | None = None,
        restored_check: Callable[[VideoParams], None] | None = None,
    ):
        self.engine = engine
        self.chat_worker = (
            None if chat_backend is None else ChatWorker(chat_backend, engine.model_lock, max_num_seqs)
        )
        self.store = store
        self.model_name = model_name
        self.max_queued_requests = max_queued_requests
        self.job_ttl_s = job_ttl_s
        self.sweep_interval_s = sweep_interval_s  # None: half the TTL, at most SWEEP_PERIOD_MAX_S
        self.accepting = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters = JobWaiters(store)
        self._sweeper: asyncio.Task | None = None
        self._stop_thread: threading.Thread | None = None
        self._started = False
        self.upsampler = upsampler or UpsamplerConfig()
        self.restored_check = restored_check
        """The server's own check of a job stored before a restart (its LoRA settings), before validate."""
        # settled on the loop when the shutdown begins: the prompts being upsampled stop then (upsampled_prompt)
        self._stopping: asyncio.Future[None] | None = None
        self._meter: ChatMeter | None = None  # where the upsampling chats are counted (observe)
        # video jobs: stored, then queued (their prompt upsampled first when asked), deleted, restored,
        # expired; `upsampled_prompt` looked up at each call, as the client's own (a test may replace it)
        self.jobs = VideoJobs(
            engine,
            store,
            self._waiters,
            ttl_s=job_ttl_s,
            loop=lambda: self.loop,
            accepting=lambda: self.accepting,
            write_prompt=lambda params: self.upsampled_prompt(params),
        )
        # images and realtime streams: through the engine without a job, admitted as jobs are
        self.jobless = JoblessRequests(engine, self._check_admission, self.upsampled_prompt)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the client started on (its waiters and tasks live there)."""
        if self._loop is None:
            raise RuntimeError("EngineClient.start() has not run")
        return self._loop

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._stopping = self._loop.create_future()
        self.engine.on_done = lambda job_id: self._call_in_loop(partial(self._waiters.wake, job_id))
        self.engine.on_crash = self._on_crash_threadsafe
        resumed = self._recover()
        if resumed:
            log.info("resuming %d unfinished job(s) from %s", resumed, self.store.root)
        self.engine.start()
        if self.chat_worker is not None:
            self.chat_worker.call_in_consumer = self._call_in_loop
            self.chat_worker.start()
        if self.job_ttl_s:
            period = self.sweep_interval_s or min(SWEEP_PERIOD_MAX_S, max(0.05, self.job_ttl_s / 2))
            self._sweeper = asyncio.create_task(self.jobs.expire_forever(period))
        self.accepting = True

    def begin_shutdown(self, timeout_s: float) -> None:
        """Stop intake now and stop the engine in the background (safe from a signal handler). Sync waiters
        are answered (ShuttingDownError -> 503) at once when their job stays queued, the others after
        `timeout_s` even if the engine is still inside a step it cannot interrupt (a long decode)."""
        self.accepting = False
        if self._stop_thread is None and self._started:
            self.engine.drain()  # queued jobs stay queued from now on
            self._stop_thread = threading.Thread(
                target=self._stop_engine, args=(timeout_s,), name="worldserve-stop", daemon=True
            )
            self._stop_thread.start()
            if self.chat_worker is not None:  # its own deadline: an engine step it waits for may outlast it
                threading.Thread(
                    target=self.chat_worker.stop, args=(timeout_s,), name="worldserve-stop-chats", daemon=True
                ).start()
            self._call_in_loop(lambda: self._answer_waiters_at_shutdown(timeout_s))
            self._call_in_loop(self._stop_upsampling)

    def _stop_upsampling(self) -> None:
        """On the loop, when the shutdown begins: the prompts being upsampled stop now (upsampled_prompt). Their
        requests are queued ones, which no longer start: a job stays queued for the next start, an image or a
        realtime request gets its 503 at once. Left to run as running chats are, they held the shutdown (and
        their clients) for up to --shutdown-timeout and failed all the same."""
        if self._stopping is not None and not self._stopping.done():
            self._stopping.set_result(None)

    def stop_now(self) -> None:
        """A second interrupt during the shutdown's grace: its deadline now (the engine parks running jobs for
        the next start and stops a decode at its next chunk; sync waiters get their 503). Safe from a signal
        handler: the engine is told from a thread of its own."""
        self.accepting = False
        if self._stop_thread is not None and self._started:
            threading.Thread(target=self.engine.stop_now, name="worldserve-stop-now", daemon=True).start()
            self._call_in_loop(lambda: self._waiters.fail(ShuttingDownError(SHUTDOWN_REASON)))

    def _on_crash_threadsafe(self, exc: BaseException) -> None:
        """The engine loop crashed (health reports it): nothing will finish a job in this process, so every
        waiting sync request is answered now (503; the jobs stay queued and resume after a restart)."""
        err = ShuttingDownError(f"the engine has stopped ({crash_reason(exc)})")
        self._call_in_loop(lambda: self._waiters.fail(err))

    def _answer_waiters_at_shutdown(self, timeout_s: float) -> None:
        """On the loop: fail the waiters of jobs that stay queued now, the rest when `timeout_s` has passed."""
        err = ShuttingDownError(SHUTDOWN_REASON)
        queued = [
            i
            for i in self._waiters.job_ids()
            if (job := self.store.get(i)) is not None and job.status is JobStatus.QUEUED
        ]
        self._waiters.fail(err, queued)
        self.loop.call_later(timeout_s, self._waiters.fail, err)

    async def shutdown(self, timeout_s: float) -> None:
        if not self._started:
            return
        self.begin_shutdown(timeout_s)
        if self._stop_thread is not None:  # (begin_shutdown made it: the client had started)
            await asyncio.to_thread(self._stop_thread.join)
        if self.chat_worker is not None:
            await asyncio.to_thread(self.chat_worker.stop, timeout_s)
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.jobs.cancel_upsampling()  # their jobs stay queued, upsampled at the next start
        self._waiters.fail(ShuttingDownError(SHUTDOWN_REASON))
        self.store.close()
        self._started = False

    def _stop_engine(self, timeout_s: float) -> None:
        self.engine.stop(timeout_s)
        if self._loop is not None:
            self._call_in_loop(partial(self._waiters.fail, ShuttingDownError(SHUTDOWN_REASON)))

    def health(self) -> tuple[bool, str | None]:
        if not self._started:
            return False, "No engine initialized"
        if not self.engine.alive:
            crashed = self.engine.crashed
            return False, "engine stopped" if crashed is None else f"engine crashed: {crash_reason(crashed)}"
        if (stopped := self._chat_worker_failure()) is not None:
            return False, stopped
        if not self.accepting:
            return False, "shutting down"
        if (problem := self.store.problem()) is not None:
            return False, f"storage: {problem}"
        if (problem := self.engine.backend.problem()) is not None:  # (a multi-rank backend's peers)
            return False, problem
        return True, None

    def death(self) -> str | None:
        """Why nothing in this process can serve again, None while it can: the engine loop crashed, the
        Reasoner's chat worker stopped (a bug of its loop), or the backend lost a peer rank (its `problem`,
        seen here even while the engine idles). A shutdown's stop is none. `worldserve serve` stops on one."""
        if not self._started:
            return None
        if (crashed := self.engine.crashed) is not None:
            return f"engine crashed: {crash_reason(crashed)}"
        if (stopped := self._chat_worker_failure()) is not None:
            return stopped
        return self.engine.backend.problem()

    def _chat_worker_failure(self) -> str | None:
        worker = self.chat_worker
        reason = worker.stop_reason if worker is not None else None
        return None if reason is None else f"the Reasoner's chat worker stopped: {reason}"

    def _recover(self) -> int:
        """The unfinished jobs queued again (VideoJobs.restore), each checked as the server checks a job
        stored before a restart; how many."""

        def validate(params: VideoParams) -> VideoParams:
            if self.restored_check is not None:
                self.restored_check(params)
            return self.validate(params)

        return self.jobs.restore(validate)

    # -- jobs -----------------------------------------------------------------------------------------
    def validate(self, params: VideoParams) -> VideoParams:
        """Model-aware checks (prompt length, sound availability, a Reasoner to upsample the prompt); raises
        ParamError naming the request's field."""
        try:
            if params.upsample_prompt:
                check_upsampling(
                    self.chat_worker.backend if self.chat_worker else None, params, self.upsampler
                )
            return model_checked(self.engine.backend.validate, params)
        except ParamError as exc:
            raise params.named(exc) from None

    def observe(self, observer: EngineObserver) -> None:
        """Route the engine's and the chat worker's timings (ChatObserver) to `observer` (the metrics)."""
        self.engine.observer = observer
        if self.chat_worker is not None and isinstance(observer, ChatObserver):
            self.chat_worker.observer = observer
        if isinstance(observer, ChatMeter):
            self._meter = observer  # the upsampling chats are counted as the API's are

    @property
    def num_waiting(self) -> int:
        """Jobs and streamed requests waiting: in the engine's queue or having their prompt upsampled."""
        return self.engine.num_waiting + self.jobs.waiting + self.jobless.upsampling

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def has_sound(self) -> bool:
        return bool(self.engine.backend.has_sound)

    def _check_admission(self, count: int, what: str) -> None:
        """ShuttingDownError or QueueFullError unless `count` more `what` ("jobs", "requests") may queue."""
        if not self.accepting:
            raise ShuttingDownError(f"The server is shutting down and accepts no new {what}.")
        if not self.engine.alive:
            raise ShuttingDownError(
                f"The engine has stopped (see the log for why); no new {what} are accepted."
            )
        # a peer rank that died while the engine idled: /health says so, and nothing could run a new request
        if (problem := self.engine.backend.problem()) is not None:
            raise ShuttingDownError(
                f"The server cannot run {what} now ({problem}); no new {what} are accepted until it restarts."
            )
        if self.num_waiting + count > self.max_queued_requests:
            raise QueueFullError(max(1, math.ceil(self.engine.estimated_slot_wait_s())))

    async def create_job(
        self, params: VideoParams, spec: JobSpec, encode: EncodeOptions, reference: bytes | None
    ) -> Job:
        """The job stored and queued (VideoJobs.create_job) once admitted: QueueFullError or
        ShuttingDownError when it cannot queue now."""
        self._check_admission(1, "jobs")
        return await self.jobs.create_job(params, spec, encode, reference)

    def submit(
        self, params: VideoParams, spec: JobSpec, encode: EncodeOptions, reference: bytes | None
    ) -> Job:
        self._check_admission(1, "jobs")
        return self.jobs.submit(params, spec, encode, reference)

    async def upsampled_prompt(self, params: VideoParams) -> str:
        """The prompt the Reasoner writes for `params`, checked as a client's (engine/prompt_upsampling.py);
        UpsamplingFailed when it cannot (ShuttingDownError once the shutdown begins: unless_stopping)."""
        backend = self.chat_worker.backend if self.chat_worker is not None else None
        chat = await built_upsampling_chat(backend, params, self.upsampler)  # off the chat worker's thread
        prompt = await unless_stopping(upsample(self.chat_many, chat, self._meter), self._stopping)
        written = dataclasses.replace(params, prompt=prompt, upsample_prompt=False)
        await asyncio.to_thread(checked, self.engine.backend.validate, written)  # e.g. its length in tokens
        return prompt

    def get(self, job_id: str) -> Job | None:
        return self.store.get(job_id)

    def list(self, *, after: str | None, limit: int | None, order: str) -> tuple[list[Job], bool]:
        return self.store.list(after=after, limit=limit, order=order)

    async def delete_job(self, job_id: str) -> Job | None:
        """`delete` from the event loop (VideoJobs.delete_job)."""
        return await self.jobs.delete_job(job_id)

    def delete(self, job_id: str) -> Job | None:
        """Remove the job and its files; a queued or running one is aborted at the next step boundary."""
        return self.jobs.delete(job_id)

    def video_path(self, job_id: str) -> Path:
        return self.store.video_path(job_id)

    def _call_in_loop(self, fn: Callable[[], object]) -> None:
        """Run fn on the server's event loop (from any thread); nothing once the loop has closed."""
        if self._loop is None:  # (not started: nobody is listening yet)
            return
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop closed: nobody is listening any more
            pass

    def chat_many(
        self, choices: Sequence[ChatParams], *, coalesce: bool = False
    ) -> builtins.list[ChatEvents]:  # (`list` is the job listing's name in this class)
        """Start the chats of one request (its `n` choices), queued as one entry so the worker admits and
        prefills them together: one `ChatEvents` each. Call on the event loop's thread.
        `coalesce`: the first delta, then the rest merged into one at the end (ChatHandle.coalesce)."""
        worker = self.chat_worker
        if worker is None:
            raise ChatUnavailableError(NO_REASONER)
        if not self.accepting:
            raise ShuttingDownError("The server is shutting down and accepts no new requests.")
        queues: builtins.list[asyncio.Queue[ChatEvent]] = [asyncio.Queue() for _ in choices]

        # from the worker thread onto the loop, nothing once it closed
        def emitter(events: asyncio.Queue[ChatEvent]) -> Callable[[ChatEvent], None]:
            return lambda event: self._call_in_loop(partial(events.put_nowait, event))

        handles = worker.submit_many(
            [(p, emitter(q), q.put_nowait) for p, q in zip(choices, queues, strict=True)], coalesce=coalesce
        )
        return [ChatEvents(q, h) for q, h in zip(queues, handles, strict=True)]

    async def wait(self, job_id: str) -> Job | None:
        """Wait until the job is completed or failed; None if it was deleted meanwhile."""
        return await self._waiters.wait(job_id)

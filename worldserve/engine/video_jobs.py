"""VideoJobs (the EngineClient's `jobs`): what creating, deleting, restoring and expiring a video job does to
the job store and the engine together. EngineClient admits a job (the queue bound, the shutdown) before it
calls `create_job` / `submit`; everything here runs on the client's event loop, but for `submit` / `delete`,
the synchronous forms for callers off the loop (the engine tests).

A new job is stored first (its row and its reference's fsync'd file, on a thread: a slow disk holds its own
request only), then handed to the engine's inbox; one whose prompt is to be upsampled goes to the Reasoner
first (a task on the loop; `write_prompt` is the client's `upsampled_prompt`): it stays queued meanwhile,
counted as waiting, and the store records the written prompt before the engine gets the job. A deleted job's
files and row go first; then its work stops (its upsampling cancelled, its request aborted at the next step
boundary) and a sync request waiting on it answers. At start, `restore` queues again every job a crash or a
shutdown left unfinished (job_recovery.py); with a TTL, `expire_forever` deletes the expired ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from worldserve.engine.engine import Engine
from worldserve.engine.job_files import inputs_record
from worldserve.engine.job_recovery import restored_jobs
from worldserve.engine.job_schema import new_job_id
from worldserve.engine.job_waiters import JobWaiters
from worldserve.engine.jobs import Job, JobSpec, JobStatus, JobStore
from worldserve.engine.prompt_upsampling import UpsamplingFailed
from worldserve.engine.request import EncodeOptions, Request
from worldserve.params import VideoParams

log = logging.getLogger(__name__)


class VideoJobs:
    """The video jobs between `store` and `engine`: `loop` gives the client's event loop (its upsampling tasks
    run there), `accepting` says whether the client still takes requests (a failure once it does not is the
    shutdown's: the job stays queued) and `write_prompt` writes a job's upsampled prompt."""

    def __init__(
        self,
        engine: Engine,
        store: JobStore,
        waiters: JobWaiters,
        *,
        ttl_s: float | None,
        loop: Callable[[], asyncio.AbstractEventLoop],
        accepting: Callable[[], bool],
        write_prompt: Callable[[VideoParams], Awaitable[str]],
    ):
        self.engine = engine
        self.store = store
        self.ttl_s = ttl_s
        self._waiters = waiters
        self._loop = loop
        self._accepting = accepting
        self._write_prompt = write_prompt
        self._upsampling: dict[str, asyncio.Task] = {}  # job id -> its prompt upsampling, before the queue
        self._storing = 0  # jobs admitted whose row and reference are being written (create_job)

    @property
    def waiting(self) -> int:
        """Jobs admitted that the engine has not got yet: being stored, or having their prompt upsampled."""
        return len(self._upsampling) + self._storing

    async def create_job(
        self, params: VideoParams, spec: JobSpec, encode: EncodeOptions, reference: bytes | None
    ) -> Job:
        """`submit` from the event loop: the store's writes (its row, the reference's fsync'd file) run on a
        thread, so a slow disk or a locked database holds this request, not every route. The job counts as
        waiting from its admission; once stored it is queued even if the caller is cancelled meanwhile."""
        job = _queued_job(spec)
        self._storing += 1
        stored: asyncio.Future[Job] = asyncio.ensure_future(
            asyncio.to_thread(self.store.create, job, inputs_record(params, encode), reference)
        )

        def queue(done: asyncio.Future) -> None:
            self._storing -= 1
            if not done.cancelled() and done.exception() is None:
                self._queue(job.id, params, encode)

        stored.add_done_callback(queue)
        return await asyncio.shield(stored)

    def submit(
        self, params: VideoParams, spec: JobSpec, encode: EncodeOptions, reference: bytes | None
    ) -> Job:
        job = self.store.create(_queued_job(spec), inputs_record(params, encode), reference)
        self._queue(job.id, params, encode)
        return job

    def restore(self, validate: Callable[[VideoParams], VideoParams]) -> int:
        """Queue again every job the store reports unfinished, each checked by `validate` (job_recovery.py:
        one that cannot run again fails); how many were queued."""
        resumed = 0
        for job_id, params, encode in restored_jobs(self.store, self.ttl_s, validate, self.engine.observer):
            self._queue(job_id, params, encode)
            resumed += 1
        return resumed

    def _queue(self, job_id: str, params: VideoParams, encode: EncodeOptions) -> None:
        """Hand a stored queued job to the engine; one whose prompt is to be upsampled goes to the Reasoner
        first (a task on the loop: the job stays queued meanwhile, counted as waiting)."""
        arrival = time.monotonic()
        if params.upsample_prompt:
            task = self._loop().create_task(self._upsample_then_queue(job_id, params, encode, arrival))
            self._upsampling[job_id] = task
            task.add_done_callback(lambda _: self._upsampling.pop(job_id, None))
            return
        self.engine.add_request(Request(job_id=job_id, params=params, encode=encode, arrival_time=arrival))

    async def _upsample_then_queue(
        self, job_id: str, params: VideoParams, encode: EncodeOptions, arrival: float
    ) -> None:
        """The Reasoner writes the job's prompt, the store records it (a restart then goes on with it), the
        engine gets the job (its queue time counted from `arrival`). A failed upsampling fails the job (the
        chat's status, else 500, and the reason; so too on a server restarted without a Reasoner); one stopped
        by the shutdown leaves it queued, to upsample at the next start."""
        try:
            prompt = await self._write_prompt(params)
        except Exception as exc:
            if not self._accepting():
                return  # the shutdown stopped it
            code = exc.status if isinstance(exc, UpsamplingFailed) else 500
            if self.store.fail(job_id, code, f"Prompt upsampling failed: {exc}", completed_at=time.time(),
                               ttl_s=self.ttl_s, param=getattr(exc, "param", None)):  # fmt: skip
                self.engine.observer.on_failed(code)
                self._waiters.wake(job_id)
            return
        params = dataclasses.replace(params, prompt=prompt, upsample_prompt=False)
        job = self.store.get(job_id)
        if job is None or not self.store.set_upsampled(
            job_id, dataclasses.replace(job.spec, upsampled_prompt=prompt), inputs_record(params, encode)
        ):
            return  # deleted (or failed) meanwhile
        self._upsampling.pop(job_id, None)  # counted as waiting by the engine from now on, not twice
        self.engine.add_request(Request(job_id=job_id, params=params, encode=encode, arrival_time=arrival))

    def cancel_upsampling(self) -> None:
        """At the shutdown: the prompts still being written stop; their jobs stay queued, upsampled at the
        next start."""
        for upsampling in list(self._upsampling.values()):
            upsampling.cancel()

    async def delete_job(self, job_id: str) -> Job | None:
        """`delete` from the event loop: the store's writes on a thread (as create_job's); the job is aborted
        once removed even if the caller is cancelled meanwhile."""
        removed = asyncio.ensure_future(asyncio.to_thread(self.store.delete, job_id))

        def stop(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                self._deleted(job_id, done.result())

        removed.add_done_callback(stop)
        return await asyncio.shield(removed)

    def delete(self, job_id: str) -> Job | None:
        """Remove the job and its files; a queued or running one is aborted at the next step boundary."""
        job = self.store.delete(job_id)
        self._deleted(job_id, job)
        return job

    def _deleted(self, job_id: str, job: Job | None) -> None:
        """After the store removed `job_id` (`job`: what it was, None when unknown): stop its work."""
        if (upsampling := self._upsampling.pop(job_id, None)) is not None:
            upsampling.cancel()  # its chat stops at the next step
            self.engine.observer.on_cancelled()
        if job is not None and not job.status.terminal:
            self.engine.abort(job_id)
        # a sync request waiting on it answers now (404), also while its MP4 is encoded
        self._waiters.wake(job_id)

    async def expire_forever(self, period_s: float) -> None:
        """Every `period_s`: the expired jobs deleted, their sync waiters answered (finished: no abort)."""
        while True:
            await asyncio.sleep(period_s)
            try:  # off the loop, in batches (100k expired jobs took the loop for 39 s)
                for job_id in await asyncio.to_thread(self.store.delete_expired, time.time()):
                    self._waiters.wake(job_id)
            except Exception:
                log.exception("expiry sweep failed")


def _queued_job(spec: JobSpec) -> Job:
    """A new job, queued now."""
    return Job(id=new_job_id(), status=JobStatus.QUEUED, progress=0, created_at=time.time(), spec=spec)

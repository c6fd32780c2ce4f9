"""The callers waiting for jobs to end (the sync video route, through `EngineClient.wait`): one asyncio future
per waiter, on the server's event loop, woken from whichever thread ends the job.

`wait(job_id)` registers a future first and reads the store second, so a job that ends in between is never
missed. Every method runs on the loop (EngineClient hops the engine's `on_done` onto it): a woken waiter
reads the store again, a failed one gets the exception (a ShuttingDownError: the job stays queued for the
next start).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence

from worldserve.engine.jobs import Job, JobStore


class JobWaiters:
    def __init__(self, store: JobStore) -> None:
        self._store = store
        self._futures: dict[str, list[asyncio.Future]] = defaultdict(list)

    def job_ids(self) -> list[str]:
        """The jobs someone waits for."""
        return list(self._futures)

    async def wait(self, job_id: str) -> Job | None:
        """Wait until the job is completed or failed; None if it was deleted meanwhile."""
        loop = asyncio.get_running_loop()
        while True:
            future = loop.create_future()
            self._futures[job_id].append(future)
            try:
                job = self._store.get(job_id)  # checked after registering: no wake-up can be missed
                if job is None or job.status.terminal:
                    return job
                await future
            finally:
                futures = self._futures.get(job_id, [])
                if future in futures:
                    futures.remove(future)
                if not futures:
                    self._futures.pop(job_id, None)

    def wake(self, job_id: str) -> None:
        for future in self._futures.get(job_id, ()):
            if not future.done():
                future.set_result(None)

    def fail(self, exc: BaseException, job_ids: Sequence[str] | None = None) -> None:
        """Fail the waiters of `job_ids` (all when None) with `exc`."""
        for job_id in self.job_ids() if job_ids is None else job_ids:
            for future in self._futures.get(job_id, ()):
                if not future.done():
                    future.set_exception(exc)

"""Step-level scheduling policy for video requests: what to admit and which group to step next.

Policy (first come, first served, at step granularity):
- admission: waiting requests are admitted in arrival order while fewer than `max_batch_size` requests hold
  backend state (prepared requests own device memory: und K/V caches, latents), so memory is bounded by
  the batch cap. New requests join at step boundaries; admission stops while the engine drains.
- stepping: running requests are grouped by `state.batch_key` (same shapes batch in one forward); each
  iteration steps the group of the oldest running request, so the oldest work finishes first and a
  newcomer with the same key rides along from its first step. A shape whose batch failed as a batch (out of
  memory at its size, each member fine alone: engine/batch.py) is stepped in batches of half that size
  from then on (`shrink`), so the failed call is not paid again every step.
Pure bookkeeping: no backend calls, no threads; the engine thread is its only user.
"""

from __future__ import annotations

from collections import deque

from worldserve.engine.request import Request


class Scheduler:
    def __init__(self, max_batch_size: int):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.max_batch_size = max_batch_size
        self.caps: dict[object, int] = {}  # batch_key -> its largest batch since one failed as a batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.admitting = True

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, job_id: str) -> Request | None:
        """Take a request out wherever it is (abort); the caller releases its backend state."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.job_id == job_id:
                    queue.remove(request)
                    return request
        return None

    def admit(self) -> list[Request]:
        """Pop the requests to prepare now; the engine calls `start` for each one that prepared."""
        admitted: list[Request] = []
        while self.admitting and self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            admitted.append(self.waiting.popleft())
        return admitted

    def start(self, request: Request) -> None:
        assert request.state is not None, "start() needs a prepared request"
        self.running.append(request)

    def next_batch(self) -> list[Request]:
        """The running requests to advance by one step together: the oldest request's batch_key group."""
        if not self.running:
            return []
        key = self.running[0].prepared.batch_key
        return [r for r in self.running if r.prepared.batch_key == key][
            : self.caps.get(key, self.max_batch_size)
        ]

    def shrink(self, key: object, failed_size: int) -> None:
        """A batch of `failed_size` of this shape failed as a batch: step it in batches of half that size."""
        self.caps[key] = min(self.caps.get(key, self.max_batch_size), max(1, failed_size // 2))

    def finish(self, request: Request) -> None:
        self.running.remove(request)

    def has_work(self) -> bool:
        return bool(self.running) or (self.admitting and bool(self.waiting))

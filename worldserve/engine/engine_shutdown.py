"""How the video engine stops: `drain` (admit nothing more, end once the running requests are done), `stop`
(drain until a deadline, then `stop_now`, then abandon a step still running after a grace period) and
`stop_now` (stop at the next step boundary, a decode at its next chunk of frames); and, when the loop ends
for any reason, `_park_running`: the running jobs released and queued again for the next start (after a crash
of the loop, the crash counted against each: endings.py's `park_after_crash`), the ephemeral requests
(images, realtime streams: nothing to resume them from) cancelled with the reason.

Separate from engine.py, which runs the loop: this is Engine's base class, the shutdown path other threads
call and the loop's last act. It shares the engine's state under its condition (`_cv`); the attributes
below are the ones it reads and writes, set by Engine.__init__. Its records go to the engine's logger.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from worldserve.engine.endings import Endings
from worldserve.engine.jobs import JobStore
from worldserve.engine.outputs import VideoBackend
from worldserve.engine.refusals import SHUTDOWN_REASON, CancelledRequest
from worldserve.engine.request import Request
from worldserve.engine.scheduler import Scheduler

log = logging.getLogger("worldserve.engine.engine")
STEP_STOP_GRACE_S = 10.0
"""How long a shutdown past its deadline waits for the step in progress to end before the backend's
`abandon_step` (a multi-GPU pipeline: its peer ranks killed, which ends an exchange stuck on a hung peer; the
stop had waited on it for the collectives' timeout, minutes, with the job unchanged)."""


class EngineShutdown:
    """Engine's stopping: drain, stop, stop_now, and parking what runs when the loop ends."""

    backend: VideoBackend
    store: JobStore
    _cv: threading.Condition
    _thread: threading.Thread
    _pool: ThreadPoolExecutor
    _sched: Scheduler
    _inbox: list[Request | str]
    _waiting_ids: set[str]
    _decode_stops: dict[str, tuple[threading.Event, Request]]
    _num_running: int
    _draining: bool
    _hard_stop: bool
    _stopped: bool
    _stop_reason: str
    _release: Callable[[Request], None]
    _ends: Endings

    def drain(self) -> None:
        """Stop admitting; the loop exits once the running requests are done (queued jobs stay queued)."""
        with self._cv:
            self._draining = True
            self._cv.notify()

    def stop(self, timeout_s: float) -> None:
        """Drain for up to `timeout_s` (less after a stop_now), then stop at the next step boundary, or a decode
        in progress at its next chunk of frames (its job is queued again: a long decode had kept the process up
        for ~45 s past the timeout); a step still running STEP_STOP_GRACE_S later is abandoned where the backend
        can (a hung peer rank); waits for the encoders."""
        self.drain()
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and not self._hard_stop and (left := deadline - time.monotonic()) > 0:
            self._thread.join(min(left, 0.1))  # (until the deadline, or a second interrupt's stop_now)
        if self._thread.is_alive():
            self.stop_now()
            self._thread.join(STEP_STOP_GRACE_S)
        abandon = getattr(self.backend, "abandon_step", None)
        if self._thread.is_alive() and abandon is not None:
            log.warning(
                "shutdown: the step in progress did not end within %gs of the deadline; abandoning it",
                STEP_STOP_GRACE_S,
            )
            abandon()
        self._thread.join()
        self._pool.shutdown(wait=True)

    def stop_now(self) -> None:
        """Stop the loop at its next step boundary and a decode in progress at its next chunk (the shutdown's
        deadline, or a second interrupt before it); `stop` still waits for the loop and the encoders."""
        with self._cv:
            if self._hard_stop:
                return
            self._draining = self._hard_stop = True
            for stop, request in self._decode_stops.values():
                request.stop_reason = SHUTDOWN_REASON  # (before its reader sees the stop)
                stop.set()
            decoding = len(self._decode_stops)
            # (a request decodes inside its last step's iteration: still counted running until it ends)
            stepping = max(self._num_running - decoding, 0)
            self._cv.notify()
        log.warning("shutdown: stopping %d request(s) in their steps and %d in their decode (a job is queued "
                    "again for the next start; other requests end cancelled)", stepping, decoding)  # fmt: skip

    def _cancel_waiting_ephemeral(self, late: list[Request], reason: str) -> None:
        """Cancel the ephemeral requests still waiting, and `late` (taken from the inbox), for `reason`: the
        engine is stopping, so they are never admitted (a job stays queued for the next start; they cannot)."""
        for request in [r for r in self._sched.waiting if r.ephemeral]:
            self._sched.waiting.remove(request)
            late.append(request)
        with self._cv:
            self._waiting_ids.difference_update(r.job_id for r in late)
        for request in late:
            self._end_at_shutdown(request, reason)

    def _end_at_shutdown(self, request: Request, reason: str) -> None:
        """An ephemeral request the stop ends (it cannot resume): counted cancelled, as the server counts a
        stopped stream, and its caller gets CancelledRequest."""
        try:
            self._ends.count_cancelled(request)
        except Exception:  # the metrics' fault: the caller still gets its end, the jobs still requeue
            log.exception("observer failed for %s", request.job_id)
        request.deliver(CancelledRequest(request.job_id, reason))

    def _park_running(self, reason: str) -> None:
        """When the loop ends: release what is still running and give its jobs back to the queue; ephemeral
        requests, running or waiting, are cancelled for `reason` (they cannot resume). The loop ends for
        SHUTDOWN_REASON when it was told to stop (drain, stop_now); any other reason is its crash, which
        counts against the jobs it was running (a job that crashes it is failed after MAX_INTERRUPTIONS),
        unless the shutdown's hard stop caused it (abandon_step)."""
        self._stop_reason = reason
        parked = list(self._sched.running)
        for request in parked:
            self._sched.finish(request)
            self._release(request)
            if request.ephemeral:  # nothing to resume it from: its caller gets the stop
                self._end_at_shutdown(request, reason)
        with self._cv:  # also what arrived after the loop's last look at its inbox
            self._stopped = True
            late = [r for r in self._inbox if isinstance(r, Request) and r.ephemeral]
            self._inbox = [r for r in self._inbox if not (isinstance(r, Request) and r.ephemeral)]
        self._cancel_waiting_ephemeral(late, reason)
        parked = [r for r in parked if not r.ephemeral]
        # (a step the shutdown abandoned, its peers killed, ends in a BackendLost: the shutdown's, not the job's;
        # counted, three rolling restarts during long multi-GPU steps had failed a healthy job)
        if parked and reason != SHUTDOWN_REASON and not self._hard_stop:
            given_up = self._ends.park_after_crash(parked)
            if len(given_up) < len(parked):
                log.warning("crashed with %d running job(s); they are queued again and resume at restart (the "
                            "crash counted against each)", len(parked) - len(given_up))  # fmt: skip
        elif parked:
            self.store.requeue([r.job_id for r in parked])
            log.warning(
                "stopped with %d running job(s); they are queued again and resume at restart", len(parked)
            )
        self._num_running = 0

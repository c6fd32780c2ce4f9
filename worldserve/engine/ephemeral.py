"""Requests that run through the engine without a job (POST /v1/images/generations, /v1/realtime/video): no
store row, no files; the results come back to the caller's event loop, or the first failure is raised.

`JoblessRequests` (the client's `jobless`) is what the routes call: it admits these requests as the client
admits jobs (the queue bound, the shutdown) and, for one whose prompt the Reasoner writes first, holds its
queue slots while it is written (counted as waiting), so `--max-queued-requests` bounds them too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

from worldserve.engine.engine import Engine
from worldserve.engine.observer import EngineObserver, HeldFinish, RequestGroup
from worldserve.engine.outputs import VideoResult
from worldserve.engine.prompt_upsampling import UpsamplingFailed
from worldserve.engine.request import Request
from worldserve.params import VideoParams


class JoblessRequests:
    """Image batches and realtime streams: admitted by `check_admission(count, what)` (the client's: raises
    QueueFullError / ShuttingDownError), their prompts written by `write_prompt` (the client's
    `upsampled_prompt`) when they ask for it."""

    def __init__(
        self,
        engine: Engine,
        check_admission: Callable[[int, str], None],
        write_prompt: Callable[[VideoParams], Awaitable[str]],
    ):
        self.engine = engine
        self._check_admission = check_admission
        self._write_prompt = write_prompt
        # request id -> the queue slots it holds while its prompt is written
        self._upsampling: dict[str, int] = {}

    @property
    def upsampling(self) -> int:
        """Queue slots held by requests whose prompt is being written (they count as waiting)."""
        return sum(self._upsampling.values())

    async def generate(
        self, params_list: Sequence[VideoParams], *, prefix: str, timeout_s: float,
        on_admitted: Callable[[], None] | None = None,
    ) -> list[VideoResult]:  # fmt: skip
        """Run requests (POST /v1/images/generations): the decoded results in order, or the first failure
        raised. Past `timeout_s` they are aborted and TimeoutError is raised. `on_admitted`: called once they
        are admitted (its request's log line: a refused request is not one received)."""
        self._check_admission(len(params_list), "requests")
        if on_admitted is not None:
            on_admitted()
        return await run_without_jobs(self.engine, params_list, prefix, timeout_s)

    def stream(
        self, params: VideoParams, request_id: str, on_frames: Callable[[VideoResult], None]
    ) -> tuple[Request, asyncio.Future[VideoResult]]:
        """Run one request whose frames go to `on_frames` while they are decoded (/v1/realtime/video;
        `streamed_request`). QueueFullError / ShuttingDownError when it cannot be queued now. Its finish is
        held for its session to report (the request's observer, a HeldFinish: delivered or not)."""
        return self.stream_many([(params, request_id, on_frames)])[0]

    def stream_many(
        self,
        items: Sequence[tuple[VideoParams, str, Callable[[VideoResult], None]]],
        *,
        admitted: bool = False,
    ) -> list[tuple[Request, asyncio.Future[VideoResult]]]:
        """`stream` of each (params, request id, on_frames), queued together (Engine.add_requests: same-shape
        ones batch from their first step; the offline Engine's lists). Admitted as a whole, or none is;
        `admitted`: they were already (admitted_upsampling held their slots while their prompt was written:
        checked again, a shutdown begun meanwhile refused them uncounted; the engine ends them instead, counted)."""
        if not admitted:
            self._check_admission(len(items), "requests")
        started = [streamed_request(params, request_id, on_frames, HeldFinish(self.engine.observer))
                   for params, request_id, on_frames in items]  # fmt: skip
        self.engine.add_requests([request for request, _ in started])
        return started

    async def admitted_upsampling(
        self, params: VideoParams, request_id: str, timeout_s: float, count: int = 1,
        on_admitted: Callable[[], None] | None = None,
    ) -> str:  # fmt: skip
        """The prompt the Reasoner writes for `count` requests (an image batch, a stream) that will queue once
        it is written: admitted first (QueueFullError / ShuttingDownError) and counted as waiting meanwhile,
        as a job is. Its caller queues them with no await after this returns, so the slots held pass to the
        queue. A failure (UpsamplingFailed) or `timeout_s` passing (TimeoutError) is counted as one failed
        request (its status; 504), a cancellation as one cancelled request (the `count` requests answer one
        HTTP request: RequestGroup). `on_admitted`: as `generate`'s."""
        self._check_admission(count, "requests")
        if on_admitted is not None:
            on_admitted()
        self._upsampling[request_id] = count
        observer = self.engine.observer
        try:
            return await asyncio.wait_for(self._write_prompt(params), timeout_s)
        except (TimeoutError, UpsamplingFailed) as exc:
            observer.on_failed(504 if isinstance(exc, TimeoutError) else exc.status)
            raise
        except asyncio.CancelledError:
            observer.on_cancelled()
            raise
        finally:
            del self._upsampling[request_id]

    async def stream_upsampled(
        self, params: VideoParams, request_id: str, on_frames: Callable[[VideoResult], None], timeout_s: float
    ) -> tuple[str, Request, asyncio.Future[VideoResult]]:
        """`stream` for a request whose prompt the Reasoner writes first (admitted_upsampling): the written
        prompt and the started request."""
        prompt = await self.admitted_upsampling(params, request_id, timeout_s)
        written = dataclasses.replace(params, prompt=prompt, upsample_prompt=False)
        return prompt, *self.stream_many([(written, request_id, on_frames)], admitted=True)[0]

    def abort(self, request_id: str) -> None:
        """Stop a streamed request at its next step (or decode chunk); its future then settles with
        CancelledRequest, or with the result when every frame was already decoded."""
        self.engine.abort(request_id)


async def run_without_jobs(
    engine: Engine, params_list: Sequence[VideoParams], prefix: str, timeout_s: float
) -> list[VideoResult]:
    """The decoded results in order, or the first failure raised. On a failure, past `timeout_s` (TimeoutError)
    or when the caller is cancelled, the requests still running are aborted at their next step boundary.
    The metrics count them as one request (RequestGroup: the n images of one image request)."""
    loop = asyncio.get_running_loop()
    ids = [f"{prefix}-{uuid.uuid4().hex}" for _ in params_list]
    futures = [loop.create_future() for _ in params_list]
    now = time.monotonic()
    group = RequestGroup(engine.observer, len(params_list)) if len(params_list) > 1 else None
    requests = [Request(job_id=request_id, params=params, arrival_time=now, on_result=_sink(loop, future),
                        observer=group)
                for request_id, params, future in zip(ids, params_list, futures, strict=True)]  # fmt: skip
    engine.add_requests(requests)  # (together: the n images batch from their first step)
    gathered = asyncio.gather(*futures)
    try:
        return list(await asyncio.wait_for(gathered, timeout_s))
    except BaseException as exc:
        for request in requests:  # timed out, failed or cancelled: stop the rest at a step boundary
            if isinstance(exc, TimeoutError):  # (counted as failed with a 504, not as cancelled)
                request.abort_status = 504
            engine.abort(request.job_id)
        for future in (gathered, *futures):  # nobody reads their outcomes now: asyncio must not log them
            future.add_done_callback(outcome_read)
        raise


def streamed_request(
    params: VideoParams, request_id: str, on_frames: Callable[[VideoResult], None],
    observer: EngineObserver | None = None,
) -> tuple[Request, asyncio.Future[VideoResult]]:  # fmt: skip
    """A request whose frames go to `on_frames` as they are decoded (called in the engine's encode pool with
    the result, its `frames` a FrameStream), not queued yet: the request (its `steps_done` tells the
    progress) and a future that settles on the caller's loop with the result once `on_frames` has returned,
    or with the exception that ended the request (CancelledRequest after `engine.abort(request_id)`)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    future.add_done_callback(outcome_read)  # an aborted session leaves it unread: asyncio must not log that
    request = Request(job_id=request_id, params=params, arrival_time=time.monotonic(),
                      on_result=_sink(loop, future), on_frames=on_frames, observer=observer)  # fmt: skip
    return request, future


def _sink(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> Callable[[object], None]:
    """A request's `on_result`: its outcome (a result or an exception) settles `future` on `loop`, once."""

    def deliver(outcome: object) -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def on_result(outcome: object) -> None:  # engine thread or encode pool
        try:
            loop.call_soon_threadsafe(deliver, outcome)
        except RuntimeError:  # the loop closed: nobody is waiting any more
            pass

    return on_result


def outcome_read(future: asyncio.Future) -> None:
    """Mark a settled future's exception as read (asyncio logs 'exception was never retrieved' otherwise)."""
    if not future.cancelled():
        future.exception()

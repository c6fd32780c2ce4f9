"""Requests that run through the engine without a job (POST /v1/images/generations, /v1/realtime/video): no
store row, no files; the results come back to the caller's event loop, or the first failure is raised."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence

from worldserve.engine.engine import Engine
from worldserve.engine.outputs import VideoResult
from worldserve.engine.request import Request
from worldserve.params import VideoParams


async def run_without_jobs(
    engine: Engine, params_list: Sequence[VideoParams], prefix: str, timeout_s: float
) -> list[VideoResult]:
    """The decoded results in order, or the first failure raised. On a failure, past `timeout_s` (TimeoutError)
    or when the caller is cancelled, the requests still running are aborted at their next step boundary."""
    loop = asyncio.get_running_loop()
    ids = [f"{prefix}-{uuid.uuid4().hex}" for _ in params_list]
    futures = [loop.create_future() for _ in params_list]
    now = time.monotonic()
    requests = [Request(job_id=request_id, params=params, arrival_time=now, on_result=_sink(loop, future))
                for request_id, params, future in zip(ids, params_list, futures, strict=True)]  # fmt: skip
    for request in requests:
        engine.add_request(request)
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


def start_streamed(
    engine: Engine, params: VideoParams, request_id: str, on_frames: Callable[[VideoResult], None]
) -> tuple[Request, asyncio.Future[VideoResult]]:
    """Queue one request whose frames go to `on_frames` as they are decoded (called in the engine's encode
    pool with the result, its `frames` a FrameStream). Returns the request (its `steps_done` tells the
    progress) and a future that settles on the caller's loop with the result once `on_frames` has returned,
    or with the exception that ended the request (CancelledRequest after `engine.abort(request_id)`)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    future.add_done_callback(outcome_read)  # an aborted session leaves it unread: asyncio must not log that
    request = Request(job_id=request_id, params=params, arrival_time=time.monotonic(),
                      on_result=_sink(loop, future), on_frames=on_frames)  # fmt: skip
    engine.add_request(request)
    return request, future


def _sink(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> Callable[[object], None]:
    """A request's `on_result`: its outcome (a result or an exception) settles `future` on `loop`, once."""

    def deliver(outcome) -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def on_result(outcome) -> None:  # engine thread or encode pool
        try:
            loop.call_soon_threadsafe(deliver, outcome)
        except RuntimeError:  # the loop closed: nobody is waiting any more
            pass

    return on_result


def outcome_read(future: asyncio.Future) -> None:
    """Mark a settled future's exception as read (asyncio logs 'exception was never retrieved' otherwise)."""
    if not future.cancelled():
        future.exception()

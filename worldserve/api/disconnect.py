"""Stop a request's work when its client goes away (vLLM's `with_cancellation`).

`unless_disconnected(request, work, on_gone)` awaits `work` (a coroutine: a chat's answer, an image batch, a
sync video job) while a watcher waits for the ASGI `http.disconnect` message (the body has been read
already, so the next message can only be that). If the client leaves first, `work` is cancelled, `on_gone`
runs (abort what was queued for the request: chats, jobs) and `ClientGone` is raised; its handler
(api/errors.py) answers a 499 that nobody reads (nginx's "client closed request"). A streaming response, once returned, is not
watched here: Starlette's StreamingResponse watches the connection itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request

CLIENT_CLOSED_REQUEST = 499
"""The status logged for a request whose client left (nginx's convention; nobody receives it)."""


class ClientGone(Exception):
    """The client disconnected before its answer was ready; the work was cancelled."""


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (call only after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(
    request: Request, work: Awaitable, on_gone: Callable[[], Awaitable[Any]] | None = None
) -> Any:
    """`work`'s result; ClientGone (after cancelling `work` and running `on_gone`) if the client leaves first,
    also when the answer became ready at the same moment. A cancelled handler (server shutdown) cancels
    `work` only: what was queued for the request (a job) is kept for the next start."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _cancel(task, watcher)
        raise
    gone = watcher.done()  # disconnected, or the connection broke
    await _cancel(watcher, *((task,) if gone else ()))
    if gone:
        if on_gone is not None:
            await on_gone()
        raise ClientGone
    return task.result()


async def _cancel(*tasks: asyncio.Future) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

"""Thread pools for requests' host media work: decoding images and videos, resizing, hashing.

Pillow's decoders and resize, PyAV, hashlib and torch's CPU kernels release the GIL, so the images of one
chat request (several photos, or a clip sent as frames) are prepared on as many cores at once instead of one
after another on the API's worker thread. `map_in_order(fn, items)` runs one item in the calling thread (no
hand-off) and several on the pool, returning the results in order and raising the first failure in order, as
a loop would. Callers must not nest it (pool work never waits on the pool).

`on_request_pool(fn, *args, stop=event)` runs a whole request's media preparation (a chat carrying images or
videos, a video reference) off the event loop on a pool of its own, not on the loop's default executor: every
route's small off-loop work (a text chat's template, a job's validation, a video download) uses that one, and
a burst of heavy media requests would otherwise hold all its threads (12 chats with 1080p videos held a
text-only chat 39 s on a 2-CPU host). Its threads may use `map_in_order`; the media pool's never do. A
request abandoned while it waits (its client left: the awaiting task is cancelled) frees its thread: work not
yet started is dropped, and `stop` is set for work under way, whose loops check it (a video's decode, frame
by frame: media/decode_budget.py); what that work ends with is dropped unseen, never logged.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from worldserve.lasting_pool import LastingThreadPool

T = TypeVar("T")
R = TypeVar("R")

MAX_WORKERS = min(8, os.cpu_count() or 1)
"""Threads of the pool (at most 8: a request rarely carries more images; more would only contend)."""

_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _named_pool(name: str) -> ThreadPoolExecutor:
    with _lock:
        if name not in _pools:
            # (serving through the interpreter's exit: an offline Engine's chat in a thread Python waits for)
            _pools[name] = LastingThreadPool(MAX_WORKERS, thread_name_prefix=f"worldserve-{name}")
        return _pools[name]


def media_pool() -> ThreadPoolExecutor:
    """The process's media pool (made on first use): the items of one request's media work."""
    return _named_pool("media")


async def on_request_pool(fn: Callable[..., R], *args: object, stop: threading.Event | None = None) -> R:
    """fn(*args) on the request pool (made on first use), awaited from the event loop; cancelled, `stop` is
    set (fn's loops end at their next check) and fn's outcome, when it comes, is dropped."""
    future = asyncio.get_running_loop().run_in_executor(_named_pool("request"), functools.partial(fn, *args))
    try:
        return await future
    except asyncio.CancelledError:
        if stop is not None:
            stop.set()
        raise


def map_in_order(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """[fn(x) for x in items], the items run at once on the media pool when there are several."""
    if len(items) <= 1 or MAX_WORKERS <= 1:
        return [fn(x) for x in items]
    futures = [media_pool().submit(fn, x) for x in items]
    return [f.result() for f in futures]

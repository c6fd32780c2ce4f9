"""One thread pool for a request's host media work: decoding images and videos, resizing, hashing.

Pillow's decoders and resize, PyAV, hashlib and torch's CPU kernels release the GIL, so the images of one
chat request (several photos, or a clip sent as frames) are prepared on as many cores at once instead of one
after another on the API's worker thread. `map_in_order(fn, items)` runs one item in the calling thread (no
hand-off) and several on the pool, returning the results in order and raising the first failure in order, as
a loop would. Callers must not nest it (pool work never waits on the pool).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_WORKERS = min(8, os.cpu_count() or 1)
"""Threads of the pool (at most 8: a request rarely carries more images; more would only contend)."""

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def media_pool() -> ThreadPoolExecutor:
    """The process's media pool (made on first use)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="worldserve-media")
        return _pool


def map_in_order(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """[fn(x) for x in items], the items run at once on the media pool when there are several."""
    if len(items) <= 1 or MAX_WORKERS <= 1:
        return [fn(x) for x in items]
    futures = [media_pool().submit(fn, x) for x in items]
    return [f.result() for f in futures]

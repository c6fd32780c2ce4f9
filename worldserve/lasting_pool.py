"""`LastingThreadPool`: a ThreadPoolExecutor whose work goes on through the interpreter's exit, until the pool
itself is shut down.

At the interpreter's exit Python first runs `threading`'s exit hooks, among them concurrent.futures' own, which
marks every ThreadPoolExecutor shut ("cannot schedule new futures after interpreter shutdown") and joins their
workers; only then does it wait for the non-daemon threads, and after them it runs `atexit`'s functions. So a
non-daemon thread still generating a video with the offline Engine when the main script ended was waited for,
but the pools its request needs (the MP4 mux, the frame conversion, the engine loop's off-loop work) refused it.
This pool keeps its own queue and daemon worker threads, outside concurrent.futures' exit bookkeeping: it
serves until its own `shutdown()`, and its idle workers never hold the exit up. It is a ThreadPoolExecutor by
type (asyncio's `set_default_executor` requires one), but none of the base class's machinery runs: `submit`,
`shutdown` and `map` (Executor's, through submit) are all it offers.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("worldserve.pool")

_Item = tuple[Future, Callable[..., Any], tuple, dict]


class LastingThreadPool(ThreadPoolExecutor):
    """Up to `max_workers` daemon threads (started as work comes, each running `initializer` first) serving
    `submit`ted calls in order, through the interpreter's exit, until `shutdown()` or the pool's collection."""

    def __init__(
        self,
        max_workers: int | None = None,
        thread_name_prefix: str = "",
        initializer: Callable[..., object] | None = None,
        initargs: tuple = (),
    ) -> None:
        # (the base's __init__ is not called: it would register its workers for concurrent.futures' exit)
        if max_workers is not None and max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        self._most = max_workers or min(32, (os.cpu_count() or 1) + 4)
        self._prefix = thread_name_prefix or f"LastingThreadPool-{id(self):x}"
        self._start = (initializer, initargs)
        self._items: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._guard = threading.Lock()
        self._idle = threading.Semaphore(0)
        self._workers: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with self._guard:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future = Future()
            self._items.put((future, fn, args, kwargs))
            # (an idle worker takes it; else a new one, up to the most)
            if not self._idle.acquire(timeout=0) and len(self._workers) < self._most:
                # (the worker holds the pool weakly: a pool dropped unshut ends its workers, as the base's do)
                items = self._items
                pool = weakref.ref(self, lambda _: items.put(None))
                worker = threading.Thread(
                    target=_serve, args=(pool, items, self._idle, self._start),
                    name=f"{self._prefix}_{len(self._workers)}", daemon=True,
                )  # fmt: skip
                self._workers.append(worker)
                worker.start()
            return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new work; the queued calls run (or, with `cancel_futures`, are cancelled); `wait`: until the
        workers have ended (not the calling one, when a worker shuts its own pool)."""
        with self._guard:
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        item = self._items.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            self._items.put(None)
            workers = list(self._workers)
        if wait:
            for worker in workers:
                if worker is not threading.current_thread():
                    worker.join()


def _serve(
    pool: weakref.ref[LastingThreadPool],
    items: queue.SimpleQueue[_Item | None],
    idle: threading.Semaphore,
    start: tuple[Callable[..., object] | None, tuple],
) -> None:
    """A worker: the initializer, then the queued calls until a None (shutdown, or `pool` collected). It holds
    the pool only weakly (`pool` is unused but for that: its callback queues the None)."""
    initializer, initargs = start
    if initializer is not None:
        try:
            initializer(*initargs)
        except BaseException:  # (the base class marks the pool broken; here the thread works on without it)
            log.exception("%s: its initializer failed", threading.current_thread().name)
    while (item := items.get()) is not None:
        future, fn, args, kwargs = item
        if future.set_running_or_notify_cancel():
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
        del item, future, fn, args, kwargs  # (nothing of the last call kept alive while idle)
        idle.release()
    # (None: shutdown, or the pool collected, queued after the calls already submitted; the next worker ends too)
    items.put(None)

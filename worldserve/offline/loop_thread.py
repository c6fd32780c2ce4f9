"""A private asyncio event loop on a daemon thread: where the offline Engine drives the EngineClient, whose
methods (jobless video requests, chats, start and shutdown) live on an event loop as the HTTP server's do.

Callers on any thread `run(coroutine)` and block for its outcome; an interrupt or exception while they wait
cancels the coroutine (its `finally` blocks abort the engine work it started). `stop()` ends the loop and
joins the thread; idempotent. A call made once `stop()` has begun is refused (RuntimeError), and a call the
stopped loop left unfinished is answered with one rather than waited on forever (a close() on another thread
while a call was being submitted had stranded its caller). The thread is a daemon: an Engine never closed
cannot hold the interpreter's exit. The loop's default executor (`asyncio.to_thread`: the client's off-loop
work) is a LastingThreadPool, serving through the exit as long as the loop runs (lasting_pool.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from worldserve.lasting_pool import LastingThreadPool

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "worldserve-offline-loop"):
        self.loop = asyncio.new_event_loop()
        self._executor = LastingThreadPool(thread_name_prefix=f"{name}-work")
        self.loop.set_default_executor(self._executor)
        # guards _stopping and _calls: a call is submitted before stop() begins, or refused
        self._lock = threading.Lock()
        self._stopping = False
        self._calls: set[concurrent.futures.Future[Any]] = set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # (the tasks still pending were cancelled by stop(); their callbacks ran before the loop ended)
            with self._lock:
                self._stopping = True
                stranded = list(self._calls)
            # a call whose task had not ended when the loop stopped: its caller would wait forever. Cancelled
            # before the loop closes: the cancellation's callback is handed to the loop (never to run), where
            # a closed loop refused it with a logged "Event loop is closed" traceback.
            for future in stranded:
                future.cancel()
            self.loop.close()  # (its default executor shut down with it)

    @property
    def running(self) -> bool:
        """Whether calls are taken (stop() has not begun)."""
        return not self._stopping and self._thread.is_alive() and not self.loop.is_closed()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """The coroutine's result (or its exception), run on the loop; the caller blocks meanwhile. An
        exception in the caller while it waits (KeyboardInterrupt) or `timeout_s` passing (TimeoutError)
        cancels the coroutine first. RuntimeError once stop() has begun, or when it ended the call."""
        with self._lock:
            if self._stopping or not self.running:
                coroutine.close()
                raise RuntimeError("this Engine is closed")
            future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
            self._calls.add(future)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no result within {timeout_s:g} s; the request was aborted") from None
        except concurrent.futures.CancelledError:
            if self._stopping:
                raise RuntimeError("this Engine was closed while the call ran") from None
            raise
        except BaseException:
            future.cancel()
            raise
        finally:
            with self._lock:
                self._calls.discard(future)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel what still runs on the loop, stop it and join the thread (not from the loop's own thread)."""
        with self._lock:
            self._stopping = True
        if self.loop.is_closed() or not self._thread.is_alive():
            return

        def cancel_all() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            # (one more turn lets the cancelled tasks run their finally blocks before the loop stops)
            self.loop.call_soon(self.loop.stop)

        try:
            self.loop.call_soon_threadsafe(cancel_all)
        except RuntimeError:  # (closed meanwhile)
            return
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

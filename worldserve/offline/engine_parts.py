"""What an offline Engine (offline/engine.py) started, stopped once: by close(), when the Engine is collected,
or at the interpreter's exit; and the calls of its caller threads, which the exit must know about.

Python's exit runs `threading`'s exit hooks (newest first), then joins the non-daemon threads, then runs
`atexit`'s. concurrent.futures' hook, registered when it is imported, shuts every ThreadPoolExecutor for good:
from then on the engine's encode pool and the frame conversion pool refuse work, and a request decoding then
failed with "cannot schedule new futures after interpreter shutdown" (its caller's thread printing the
traceback). `stop_open_engines` is registered later, so it runs first: it waits for the non-daemon threads
that called an Engine (Python waits for them anyway: their requests finish with the pools still up), then
stops each Engine still open at once. What daemon threads were still asking is dropped without a word: their
calls end with SystemExit, which ends a thread silently (the interpreter is exiting).
"""

from __future__ import annotations

import collections
import concurrent.futures.thread
import dataclasses
import shutil
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from worldserve.engine.client import EngineClient
from worldserve.offline.loop_thread import LoopThread

T = TypeVar("T")

IDLE_STOP_S = 5.0
"""How long an idle engine stopped at exit may take to drain (it ends at once: nothing runs)."""
ANSWER_WAIT_S = 2.0
"""How long a stop at exit waits for the calls it ended to be answered before it stops their loop."""
EXITED = "the interpreter is exiting: the Engine left open was stopped without waiting for this call"
"""The SystemExit a daemon thread's call ends with when the exit stops the Engine."""

_OPEN: set[EngineParts] = set()
"""The Engines not yet stopped, for the exit hook (the parts hold no reference to their Engine)."""
_hook_lock = threading.Lock()
_hook_registered = False


@dataclasses.dataclass(slots=True, eq=False)
class EngineParts:
    """What an Engine started, to stop once (explicitly, or by its finalizer: no reference to the Engine), and
    the threads calling it."""

    client: EngineClient
    loop: LoopThread
    backend: Any
    storage: str
    closed: bool = False
    stopped_at_exit: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # (guards in_call and callers; notified when a call ends)
    calls: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    in_call: collections.Counter[threading.Thread] = dataclasses.field(default_factory=collections.Counter)
    callers: weakref.WeakSet[threading.Thread] = dataclasses.field(default_factory=weakref.WeakSet)

    def __post_init__(self) -> None:
        _register_exit_hook()
        _OPEN.add(self)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """`loop.run` for a caller thread, counted as in a call meanwhile; its failure because the exit stopped
        the engine is SystemExit."""
        me = threading.current_thread()
        with self.calls:
            self.callers.add(me)
            self.in_call[me] += 1
        try:
            return self.loop.run(coroutine, timeout_s)
        except BaseException:
            if self.stopped_at_exit:
                raise SystemExit(EXITED) from None
            raise
        finally:
            with self.calls:
                self.in_call[me] -= 1
                if self.in_call[me] <= 0:
                    del self.in_call[me]
                self.calls.notify_all()

    def check_open(self) -> None:
        """RuntimeError once closed (SystemExit once the exit stopped it)."""
        if self.stopped_at_exit:
            raise SystemExit(EXITED)
        if self.closed:
            raise RuntimeError("this Engine is closed")

    def _take(self) -> bool:
        """Whether this call is the one that stops them (the first)."""
        with self.lock:
            first, self.closed = not self.closed, True
        _OPEN.discard(self)
        return first

    def close(self, timeout_s: float) -> None:
        """The server's shutdown (EngineClient.shutdown on the loop), then the loop, the peers, the folder."""
        if not self._take():
            return
        try:
            if self.loop.running:
                self.loop.run(self.client.shutdown(timeout_s))
        finally:
            self._release()

    def stop_at_once(self) -> None:
        """At collection or the interpreter's exit: the engine stopped at its next step, synchronously (the
        exit allows no new thread or executor task: EngineClient.shutdown would start both). A call still
        running can only be the exit's (a call holds its Engine): its caller gets SystemExit."""
        with self.lock:
            self.stopped_at_exit = not self.closed
        if not self._take():
            return
        try:
            self.client.accepting = False
            worker = self.client.chat_worker
            if worker is not None:
                worker.stop(0.0)
            engine = self.client.engine
            # idle: it ends as soon as it drains; else at its next step (nobody waits for the results now)
            engine.stop(IDLE_STOP_S if engine.num_running + engine.num_waiting == 0 else 0.0)
            # the calls the stop ended answered before their loop goes (one it stranded is cancelled after
            # the loop closed, which logs a traceback from the cancelled future's callback)
            with self.calls:
                self.calls.wait_for(lambda: not self.in_call, ANSWER_WAIT_S)
        finally:
            self._release()
            self.client.store.close()

    def wait_for_lasting_callers(self) -> None:
        """Until no non-daemon thread (other than this one) is in a call and those that called have ended:
        the interpreter waits for them, so their requests are run, not dropped. Idle executor workers are
        not waited for (only their calls): they end when concurrent.futures' own exit hook tells them to."""
        me = threading.current_thread()
        workers = getattr(concurrent.futures.thread, "_threads_queues", {})
        while True:
            with self.calls:
                calling = [t for t in self.in_call if not t.daemon and t is not me and t.is_alive()]
                lasting = [t for t in self.callers
                           if not t.daemon and t is not me and t.is_alive() and t not in workers]  # fmt: skip
                if not lasting:
                    if not calling:
                        return
                    self.calls.wait(0.1)
                    continue
            lasting[0].join()

    def _release(self) -> None:
        try:
            self.loop.stop()
        finally:
            try:
                if hasattr(self.backend, "close"):  # CFG-parallel / Ulysses / TP: the peer ranks
                    self.backend.close()
            finally:
                shutil.rmtree(self.storage, ignore_errors=True)


def stop_open_engines() -> None:
    """The exit hook: the Engines still open, stopped at once once their non-daemon callers are done."""
    for parts in list(_OPEN):
        parts.wait_for_lasting_callers()
    for parts in list(_OPEN):
        parts.stop_at_once()


def _register_exit_hook() -> None:
    """`stop_open_engines` among threading's exit hooks, once, after concurrent.futures' (so it runs before
    the executors are shut: the hooks run newest first). Once the exit has begun it is too late: atexit's
    finalizer of each Engine still stops it."""
    global _hook_registered
    with _hook_lock:
        if _hook_registered:
            return
        register = getattr(threading, "_register_atexit", None)
        if register is None:
            return
        try:
            register(stop_open_engines)
        except RuntimeError:  # (the exit has begun)
            return
        _hook_registered = True

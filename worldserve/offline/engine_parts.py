"""What an offline Engine (offline/engine.py) started, stopped once: by close(), when the Engine is collected,
or at the interpreter's exit; and the calls in flight, which the exit must know about.

Python's exit runs `threading`'s exit hooks (newest first), then joins the non-daemon threads, then runs
`atexit`'s. concurrent.futures' hook, registered when it is imported, shuts every ThreadPoolExecutor for good:
from then on the engine's encode pool and the frame conversion pool refuse work, and a request decoding then
failed with "cannot schedule new futures after interpreter shutdown" (a wall of tracebacks). `stop_open_engines`
is registered later, so it runs first: it waits for the calls non-daemon threads have in flight (their requests
end with the pools still up, as Python would wait for those threads anyway), then stops each Engine still open
at once. It joins no thread: a thread that waits for the main thread to end (which it does only after these
hooks) would hang the exit. After that, a daemon thread's call ends with SystemExit (silent: that thread dies
with the interpreter, nobody can see its result); a non-daemon thread's later call is a RuntimeError saying the
interpreter is exiting (work that Python waits for is never dropped without a word).
"""

from __future__ import annotations

import collections

# (imported first: its exit hook is registered before ours, so ours runs before it)
import concurrent.futures.thread  # noqa: F401
import dataclasses
import logging
import shutil
import threading
import typing
from collections.abc import Coroutine
from typing import Any, TypeVar

from worldserve.engine.client import EngineClient
from worldserve.offline.loop_thread import LoopThread

T = TypeVar("T")
log = logging.getLogger("worldserve.offline")

IDLE_STOP_S = 5.0
"""How long an idle engine stopped at exit may take to drain (it ends at once: nothing runs)."""
ANSWER_WAIT_S = 2.0
"""How long a stop at exit waits for the calls it ended to be answered before it stops their loop."""
EXITED = "the interpreter is exiting: the Engine left open was stopped without waiting for this call"
"""Why a call ends once the exit stopped the Engine (SystemExit in a daemon thread, else RuntimeError)."""

_OPEN: set[EngineParts] = set()
"""The Engines not yet stopped, for the exit hook (the parts hold no reference to their Engine)."""
_hook_lock = threading.Lock()
_hook_registered = False
_exit_began = False
"""Set by the exit hook as it begins (an Engine built after it is refused: check_not_exiting)."""


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
    # (guards in_call; notified when a call ends)
    calls: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    in_call: collections.Counter[threading.Thread] = dataclasses.field(default_factory=collections.Counter)

    def __post_init__(self) -> None:
        _register_exit_hook()
        _OPEN.add(self)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """`loop.run` for a caller thread, counted as in a call meanwhile; its failure because the exit stopped
        the engine is `_exited`'s."""
        me = threading.current_thread()
        with self.calls:
            self.in_call[me] += 1
        try:
            return self.loop.run(coroutine, timeout_s)
        except BaseException:
            if self.stopped_at_exit:
                _exited()
            raise
        finally:
            with self.calls:
                self.in_call[me] -= 1
                if self.in_call[me] <= 0:
                    del self.in_call[me]
                self.calls.notify_all()

    def check_open(self) -> None:
        """RuntimeError once closed (`_exited`'s once the exit stopped it)."""
        if self.stopped_at_exit:
            _exited()
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
        running can only be the exit's (a call holds its Engine): its caller gets `_exited`'s error."""
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

    def wait_for_lasting_calls(self) -> None:
        """Until no non-daemon thread (other than this one) is inside a call: their requests end with the pools
        still up. Threads are not joined (module docstring)."""
        me = threading.current_thread()
        with self.calls:
            self.calls.wait_for(lambda: not any(not t.daemon and t is not me for t in self.in_call))

    def _release(self) -> None:
        try:
            self.loop.stop()
        finally:
            try:
                if hasattr(self.backend, "close"):  # CFG-parallel / Ulysses / TP: the peer ranks
                    self.backend.close()
            finally:
                shutil.rmtree(self.storage, ignore_errors=True)


def _exited() -> typing.NoReturn:
    """A call the exit's stop ended, or made after it: SystemExit in a daemon thread (it ends silently, as the
    thread would at the exit), RuntimeError in another (Python waits for that thread: its work must not vanish
    without a word)."""
    if threading.current_thread().daemon:
        raise SystemExit(EXITED) from None
    # (also logged: a thread pool's work item keeps its error in a future its caller may never read)
    log.warning("%s: %s", threading.current_thread().name, EXITED)
    raise RuntimeError(EXITED) from None


def stop_open_engines() -> None:
    """The exit hook: the Engines still open, stopped at once once the calls of their non-daemon threads in
    flight have ended."""
    global _exit_began
    with _hook_lock:
        _exit_began = True
    for parts in list(_OPEN):
        parts.wait_for_lasting_calls()
    for parts in list(_OPEN):
        parts.stop_at_once()


def _register_exit_hook() -> bool:
    """`stop_open_engines` among threading's exit hooks, once, after concurrent.futures' (so it runs before
    the executors are shut: the hooks run newest first). False once the exit has begun (too late: the pools
    an Engine needs are shut or about to be)."""
    global _hook_registered
    with _hook_lock:
        if _exit_began:
            return False
        if _hook_registered:
            return True
        register = getattr(threading, "_register_atexit", None)
        if register is None:
            return True
        try:
            register(stop_open_engines)
        except RuntimeError:  # (the exit has begun)
            return False
        _hook_registered = True
        return True


def check_not_exiting() -> None:
    """RuntimeError when the interpreter's exit has begun: an Engine built then could not run one request
    (its pools refuse work), so it is refused before its load."""
    if not _register_exit_hook():
        raise RuntimeError("the interpreter is exiting: no Engine can be built now (build it before the "
                           "main script ends, or join the thread that builds it)")  # fmt: skip

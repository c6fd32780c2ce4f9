"""What an offline Engine (offline/engine.py) started, stopped once: by close(), when the Engine is collected,
or at the interpreter's exit (its finalizer, an `atexit` function); and the calls in flight, which that stop
answers before its loop goes.

Python's exit waits for the non-daemon threads first and runs `atexit`'s functions after them, so the requests
of threads Python waits for are made in full: the pools they need serve through the exit (lasting_pool.py;
concurrent.futures' own pools refuse work from the exit's start: "cannot schedule new futures after interpreter
shutdown"). What is left at the stop can only be daemon threads' calls: each ends with a silent SystemExit (its
thread dies with the interpreter; nobody can see its result), any other thread's with a RuntimeError.
"""

from __future__ import annotations

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


@dataclasses.dataclass(slots=True, eq=False)
class EngineParts:
    """What an Engine started, to stop once (explicitly, or by its finalizer: no reference to the Engine), and
    how many calls it has in flight."""

    client: EngineClient
    loop: LoopThread
    backend: Any
    storage: str
    closed: bool = False
    stopped_at_exit: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # (guards in_flight; notified when a call ends)
    calls: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    in_flight: int = 0

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """`loop.run` for a caller thread, counted in flight meanwhile; its failure because the exit stopped
        the engine is `_exited`'s."""
        with self.calls:
            self.in_flight += 1
        try:
            return self.loop.run(coroutine, timeout_s)
        except BaseException:
            if self.stopped_at_exit:
                _exited()
            raise
        finally:
            with self.calls:
                self.in_flight -= 1
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
            # the calls the stop ended answered before their loop goes (one it strands is cancelled)
            with self.calls:
                self.calls.wait_for(lambda: self.in_flight == 0, ANSWER_WAIT_S)
        finally:
            self._release()
            self.client.store.close()

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
    thread would at the exit), RuntimeError in another (an atexit function's, say: its work must not vanish
    without a word)."""
    if threading.current_thread().daemon:
        raise SystemExit(EXITED) from None
    log.warning("%s: %s", threading.current_thread().name, EXITED)
    raise RuntimeError(EXITED) from None

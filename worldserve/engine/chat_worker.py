"""ChatWorker: runs Reasoner chat completions in one worker thread, sharing the model with the video engine.

Concurrency model: the und weights are shared with video generation, so every model call is serialized by
the engine's `model_lock` (the video loop holds it around prepare / one denoise step / decode; this worker
holds it around a chat's prefill and around each single decode step). Chat tokens and video denoising steps
therefore interleave step by step and a long video never starves a chat (nor the reverse) for more than one
step. Chats run one at a time in FIFO order (no continuous batching of several chats yet).

Events go to the caller's `emit` callback from this thread (EngineClient bridges them into asyncio):
`ChatStarted(prompt_tokens)` once after prefill, then one `ChatDelta` per sampled token, the last one with
its finish_reason; or `ChatFailed(status, message, param)` (400 for a ParamError, 500 otherwise) if the
chat fails. `ChatHandle.cancel()` (client gone) stops a chat at the next step boundary.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from worldserve.engine.outputs import ChatBackend, ChatDelta
from worldserve.params import ChatParams, ParamError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChatStarted:
    prompt_tokens: int
    """Tokens of the rendered prompt (image placeholders expanded)."""


@dataclass(frozen=True, slots=True)
class ChatFailed:
    status: int
    """HTTP-like status: 400 for a bad request, 500 for a server error."""
    message: str
    param: str | None = None


ChatEvent = ChatStarted | ChatDelta | ChatFailed


@dataclass(slots=True, eq=False)
class ChatHandle:
    params: ChatParams
    emit: Callable[[ChatEvent], None]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class ChatWorker:
    def __init__(self, backend: ChatBackend, model_lock: threading.Lock):
        self.backend = backend
        self.model_lock = model_lock
        self._queue: queue.Queue[ChatHandle | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="worldserve-chat", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish the current step, fail whatever is still queued, and join the thread."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, params: ChatParams, emit: Callable[[ChatEvent], None]) -> ChatHandle:
        handle = ChatHandle(params=params, emit=emit)
        self._queue.put(handle)
        return handle

    def _run(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                break
            if not handle.cancelled.is_set():
                self._generate(handle)
        while True:  # stopping: tell the callers still queued
            try:
                handle = self._queue.get_nowait()
            except queue.Empty:
                return
            if handle is not None:
                handle.emit(ChatFailed(503, "The server is shutting down."))

    def _generate(self, handle: ChatHandle) -> None:
        try:
            with self.model_lock:
                session = self.backend.start(handle.params)
            handle.emit(ChatStarted(prompt_tokens=session.prompt_tokens))
            while not handle.cancelled.is_set():
                with self.model_lock:
                    delta = session.step()
                handle.emit(delta)
                if delta.finish_reason is not None:
                    return
        except ParamError as exc:
            handle.emit(ChatFailed(400, exc.message, exc.param))
        except Exception as exc:
            log.exception("chat completion failed")
            handle.emit(ChatFailed(500, f"Chat completion failed: {type(exc).__name__}: {exc}"))

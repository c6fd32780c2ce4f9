"""ChatWorker: runs Reasoner chat completions in one worker thread, sharing the model with the video engine.

Concurrency model: the und weights are shared with video generation, so model calls are serialized by the
engine's `model_lock` (the video loop holds it around prepare / one denoise step / decode; this worker
holds it around a chat's prefill and around each decode step): chat tokens and video denoising steps
interleave step by step. A backend whose `concurrent_with_video` is true (the Reasoner on one CUDA GPU:
its own high-priority stream, SMs left free by the video's kernels, runner/chat_share.py) is called
without the lock, so chats keep decoding while a video step runs (one token per 5.3 s step under the lock;
26 tokens/s a chat beside a 720p step with the default margin, on an H200). Continuous batching: up to
`max_num_seqs` chats are active at once; each loop admits the waiting chats (FIFO, their prefills in one backend call), then runs ONE batched decode step for every active chat
(`backend.step_all`), so N concurrent chats cost about one chat's decode forwards, not N. A chat the backend
cannot take yet (ChatBackpressure: its K/V cache is full) stays first in line and is tried again after the
next step; cancelled and failed chats are closed, which hands their K/V blocks back at once.

Events (engine/chat_events.py) go to the caller's `emit` callback from this thread (EngineClient bridges
them into asyncio): `ChatStarted(prompt_tokens)` once after prefill, then one `ChatDelta` per sampled token,
the last one with its finish_reason (a `coalesce` handle, a non-streaming caller's: the first delta, then the rest as one);
or `ChatFailed(status, message, param)` (400 for a ParamError, 500 otherwise) if the chat fails. `ChatHandle.cancel()` (client gone;
each chat's handle: chat_handle.py) stops a chat at the next step boundary.
`submit_many` queues the `n` choices of one request as one entry, so they are admitted (and prefilled, their
prompt K/V shared by the backend) together. `stop(timeout_s)` (server shutdown) takes no new chats, lets the
running ones finish within the timeout and then fails those still running with a 503, so their callers
answer with an error instead of being cut off when the HTTP server closes their connections. A bug of the loop
itself (a model call's failure fails only its chats) stops the worker for good (`stop_reason`: /health's 503):
its running chats fail with a 500, every chat not started then or later gets an uncounted 503 naming it.
Timings go to `observer` (chat_observer.py: tokens per loop iteration, each chat's time to first token,
inter-token gaps, and each started chat's ChatTimes: end-to-end, queue, prefill, decode and inference time),
measured on this thread with time.monotonic(). `num_running` / `num_waiting` (thread-safe, read by /metrics
at scrape time) are the worker's own state, as vLLM's scheduler queues: a chat runs from its admission to its
end, and a preempted one (the backend took its K/V blocks back) waits again until it resumes.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

from worldserve.chat_params import ChatParams
from worldserve.config import DEFAULT_MAX_NUM_SEQS
from worldserve.engine.chat_events import ChatEvent, ChatFailed, ChatStarted
from worldserve.engine.chat_handle import ChatHandle
from worldserve.engine.chat_observer import ChatObserver, NullChatObserver
from worldserve.engine.outputs import ChatBackend, ChatBackpressure, ChatDelta, ChatSession, error_words
from worldserve.failures import release_frames
from worldserve.params import ParamError

log = logging.getLogger(__name__)


ABORT_JOIN_S = 10.0
"""How long stop() waits, after failing the running chats, for the worker's current step to end."""
SHUTTING_DOWN = "The server is shutting down."


def _receive_all(pairs: Sequence[tuple[Callable[[ChatEvent], None], ChatEvent]]) -> None:
    for receive, event in pairs:
        receive(event)


class ChatWorker:
    call_in_consumer: Callable[[Callable[[], None]], None] | None = None
    """Runs a callable on the consumers' thread (EngineClient sets loop.call_soon_threadsafe): then the deltas
    of one step reach every handle with a `receive` in one hop (32 chats: 1 wake-up of the event loop, not 32)."""
    observer: ChatObserver = NullChatObserver()
    """Where the timings go (EngineClient.observe sets the metrics)."""

    def __init__(
        self, backend: ChatBackend, model_lock: threading.Lock, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.backend = backend
        self.model_lock = model_lock
        self.max_num_seqs = max_num_seqs
        self._queue: queue.Queue[tuple[ChatHandle, ...] | None] = queue.Queue()  # one entry a request
        self._stopping = threading.Event()  # also seen while a deferred chat keeps the queue unread
        self._abort = threading.Event()  # the shutdown timeout passed: fail the running chats
        # what /metrics and the stats line read at any time (under _queues_lock; written by this worker's
        # thread, and by submit_many for _waiting): vLLM's scheduler queues, a preempted chat back to waiting
        self._waiting: set[ChatHandle] = set()  # submitted, not started, failed or dropped yet
        self._running: set[ChatHandle] = set()  # started (prefilled or prefilling), not ended
        self._preempted: set[ChatHandle] = set()  # of _running, those whose K/V the backend took back
        self._queues_lock = threading.Lock()
        self.stop_reason: str | None = None
        """Why the loop failed ("RuntimeError: ..."), set before it stops taking chats; None while it runs, and
        after a stop (the shutdown's)."""
        self._thread = threading.Thread(target=self._run, name="worldserve-chat", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Take no new chats (queued ones get a 503), let the running ones finish within `timeout_s`, then
        fail those still running with a 503 after the current step, and join the thread."""
        self._stopping.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(max(timeout_s, 0.0))
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(ABORT_JOIN_S)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Chats submitted and not yet started (queued, or waiting for K/V room) and started chats preempted
        (waiting to resume, as vLLM moves a preempted request back to its waiting queue): /metrics' waiting
        gauge. Thread-safe, read at scrape time."""
        with self._queues_lock:
            queued = sum(not h.cancelled.is_set() for h in self._waiting)  # a client gone counts no more
            return queued + len(self._preempted)

    @property
    def num_running(self) -> int:
        """Chats started (prefilled, or prefilling in chunks) and not ended, less the preempted ones: /metrics'
        running gauge (vLLM's scheduler's running queue). Thread-safe, read at scrape time."""
        with self._queues_lock:
            return len(self._running) - len(self._preempted)

    def submit(
        self, params: ChatParams, emit: Callable[[ChatEvent], None],
        receive: Callable[[ChatEvent], None] | None = None, *, coalesce: bool = False,
    ) -> ChatHandle:  # fmt: skip
        return self.submit_many([(params, emit, receive)], coalesce=coalesce)[0]

    def submit_many(self, chats: list[tuple], *, coalesce: bool = False) -> list[ChatHandle]:
        """Queue several chats as one entry, (params, emit, receive or None) each: they are admitted in one
        batch when the worker has room for them all (a request's `n` choices: one prefill, shared K/V)."""
        handles = tuple(
            ChatHandle(params=params, emit=emit, receive=receive, coalesce=coalesce)
            for params, emit, receive in chats
        )
        if self._stopping.is_set():  # stopped (or the loop failed): nobody would read the queue
            failed = self.stop_reason is not None  # (set before _stopping: a failed loop is told as one)
            for handle in handles:
                if not failed:
                    self._ended(handle)
                self._tell(handle, self._refused(failed))
        else:
            with self._queues_lock:
                self._waiting.update(handles)
            self._queue.put(handles)
        return list(handles)

    def _not_waiting(self, *handles: ChatHandle) -> None:
        with self._queues_lock:
            self._waiting.difference_update(handles)

    def _refused(self, failed: bool) -> ChatFailed:
        """What a chat not started is told when the worker stops: the shutdown's 503, or (`failed`: the loop
        failed) a 503 naming why, which no meter counts (ChatFailed.refused)."""
        if not failed:
            return ChatFailed(503, SHUTTING_DOWN)
        return ChatFailed(503, f"The Reasoner's chat worker has stopped ({self.stop_reason}); no chat can "
                          "run until the server restarts.", refused=True)  # fmt: skip

    def _run(self) -> None:
        active: list[tuple[ChatHandle, ChatSession]] = []
        deferred: list[ChatHandle] = []  # the backend had no room for them at the last try, in order
        failed = False
        try:
            prepare = getattr(self.backend, "prepare_thread", None)  # (the decode step's per-thread settings)
            if prepare is not None:
                prepare()
            self._loop(active, deferred)
        except BaseException as exc:  # a bug of the loop (a delivery callback raising, ...): never leave
            log.exception("the chat worker stopped")  # sessions open, nor a chat waiting on a dead thread
            self.stop_reason, failed = error_words(exc), True
            self._stopping.set()
            stopped = ChatFailed(500, f"The Reasoner's chat worker stopped ({self.stop_reason}).")
            for handle, session in active:
                self._close(session)
                self._ended(handle)
                self._tell(handle, stopped)
        self._refuse_waiting(deferred, failed)
        with self._queues_lock:
            self._waiting.clear()
            self._running.clear()
            self._preempted.clear()

    def _refuse_waiting(self, deferred: list[ChatHandle], failed: bool = False) -> None:
        """Stopping: the chats not started (`deferred`, emptied, and those still queued) get a 503 now
        (`_refused`; reported ended unless the loop `failed`); none of them would start."""
        handles, deferred[:] = list(deferred), []
        while True:
            try:
                entry = self._queue.get_nowait()
            except queue.Empty:
                break
            handles += entry or ()
        self._not_waiting(*handles)
        for handle in handles:
            if not failed:
                self._ended(handle)
            self._tell(handle, self._refused(failed))

    @staticmethod
    def _tell(handle: ChatHandle, event: ChatEvent) -> None:
        try:
            handle.emit(event)
        except Exception:
            log.exception("could not deliver a chat event")

    def _loop(self, active: list[tuple[ChatHandle, ChatSession]], deferred: list[ChatHandle]) -> None:
        """The worker's loop until stopped and drained; `active` (the running chats) and `deferred` are kept
        up to date in place, for _run to close and tell if the loop fails."""
        stopping = False
        told = False  # the chats not started got their 503 at the stop (not when the running ones end)
        while not stopping or active:
            if self._stopping.is_set() and not told:
                self._refuse_waiting(deferred)
                told = stopping = True
            stopping = stopping or self._stopping.is_set()
            if self._abort.is_set():  # shutting down and out of time: the running chats end with a 503
                for handle, session in active:
                    self._close(session)
                    self._ended(handle)
                    self._tell(handle, ChatFailed(503, SHUTTING_DOWN))
                active.clear()
                return
            batch: list[ChatHandle] = []
            while not stopping and len(active) + len(batch) < self.max_num_seqs:
                if not deferred:
                    try:  # wait for work only when nothing is running or being started
                        entry = self._queue.get(block=not active and not batch)
                    except queue.Empty:
                        break
                    if entry is None:
                        stopping = True
                        break
                    deferred += entry  # a request's choices, in order (admitted as room allows)
                handle = deferred.pop(0)
                if handle.cancelled.is_set():  # its client left while it waited
                    self._not_waiting(handle)
                    self._ended(handle)
                else:
                    batch.append(handle)
            if batch:
                started, refused = self._start(batch)
                active += started
                # retry after this step when running chats will free room, or when others of the batch took
                # the room and failed since; refused alone with nothing running: the pool is too small
                if active or len(refused) < len(batch):
                    deferred[:0] = refused
                else:
                    self._not_waiting(*refused)
                    for handle in refused:
                        self._ended(handle)
                        handle.emit(ChatFailed(503, "The K/V cache has no room for this chat."))
            going_on = []  # (one look at each flag: a cancel landing between two looks left a chat unclosed,
            for handle, session in active:  # its K/V blocks never handed back)
                if handle.cancelled.is_set():
                    self._close(session)
                    self._ended(handle)
                else:
                    going_on.append((handle, session))
            active[:] = going_on
            if active:
                active[:] = self._step(active)

    def _model(self) -> contextlib.AbstractContextManager[object]:
        """The model lock, or nothing when the backend runs beside video steps (re-read every call: a
        Reasoner turns concurrent once its decode graphs are captured)."""
        return contextlib.nullcontext() if self.backend.concurrent_with_video else self.model_lock

    def _start(
        self, batch: list[ChatHandle]
    ) -> tuple[list[tuple[ChatHandle, ChatSession]], list[ChatHandle]]:
        """Prefill several chats in one backend call: (the started (handle, session) pairs, the handles the
        backend had no room for now). Failed chats get their ChatFailed."""
        admitted_at = None  # when the model is ours (vLLM's SCHEDULED): a wait on a video step is queue time
        try:
            with self._model():
                admitted_at = time.monotonic()
                results = self.backend.start_many([h.params for h in batch])
        except Exception as exc:
            results = [exc] * len(batch)
        started: list[tuple[ChatHandle, ChatSession]] = []
        refused: list[ChatHandle] = []
        with self._queues_lock:  # running from now on, before any of them hears of it (the gauges)
            for handle, result in zip(batch, results, strict=True):
                if not isinstance(result, ChatBackpressure):
                    self._waiting.discard(handle)
                if not isinstance(result, Exception):
                    self._running.add(handle)
        for handle, result in zip(batch, results, strict=True):
            if isinstance(result, ChatBackpressure):
                refused.append(handle)
            elif isinstance(result, Exception):
                if not isinstance(result, ParamError):  # (a refused request is no finished one: its 400)
                    self._ended(handle)
                self._fail(handle, result)
            else:
                handle.admitted_at, handle.prompt_tokens = admitted_at, result.prompt_tokens
                ids = tuple(result.prompt_token_ids) if handle.params.return_token_ids else None
                handle.emit(
                    ChatStarted(result.prompt_tokens, result.prompt_logprobs, result.cached_tokens, ids)
                )
                started.append((handle, result))
        return started, refused

    def _close(self, session: ChatSession) -> None:
        try:
            with self._model():
                session.close()
        except Exception:
            log.exception("closing a chat session failed")

    def _step(self, active: list[tuple[ChatHandle, ChatSession]]) -> list[tuple[ChatHandle, ChatSession]]:
        """One batched step of every active chat: the ones still generating. Its tokens (vLLM's tokens per
        engine step: _timed) are counted before any is delivered: a caller that has its answer finds the
        metrics up to date."""
        try:
            with self._model():
                deltas = self.backend.step_all([s for _, s in active])
        except Exception as exc:
            for handle, session in active:
                self._close(session)
                self._ended(handle)
                self._fail(handle, exc)
            return []
        # the preempted chats count as waiting until they resume (set before any delivery: a client that has
        # its answer finds the gauges up to date)
        preempted = {h for h, s in active if s.preempted}
        with self._queues_lock:
            self._preempted = preempted
        # a chat still prefilling (chunked) or preempted idles: no token, nothing to deliver
        idle = [not (d.text or d.logprobs or d.finish_reason) and d.completion_tokens == h._tokens_seen
                for (h, _), d in zip(active, deltas, strict=True)]  # fmt: skip
        if sampled := self._timed(active, deltas):
            self.observer.on_chat_iteration(sampled)
        # a chat its own rules left with no next token (runner/reasoner_session.py `fail`): its ParamError,
        # not its "error" delta (a 400 before a stream starts, an error event in one: vLLM fails the request)
        failed = {
            handle: session.failure
            for (handle, session), delta in zip(active, deltas, strict=True)
            if delta.finish_reason == "error" and session.failure is not None
        }
        pairs = [
            (handle, out)
            for (handle, _), delta, quiet in zip(active, deltas, idle, strict=True)
            if handle not in failed and not quiet and (out := handle.outgoing(delta)) is not None
        ]
        hop = self.call_in_consumer
        if hop is not None and (batched := [(h.receive, d) for h, d in pairs if h.receive is not None]):
            hop(partial(_receive_all, batched))
        for handle, delta in pairs:
            if hop is None or handle.receive is None:
                handle.emit(delta)
        for handle, failure in failed.items():
            self._fail(handle, failure)
        return [(h, s) for (h, s), d in zip(active, deltas, strict=True) if d.finish_reason is None]

    def _timed(self, active: list[tuple[ChatHandle, ChatSession]], deltas: list[ChatDelta]) -> int:
        """Report one step's inter-token gaps and the ends of the chats it finished; its tokens: those it sampled
        and the prompts of the chats whose first token it sampled (vLLM counts a prompt in the step of its
        first token: with chunked prefill, after its last chunk; each of the n choices of one prompt its own,
        as vLLM's child requests do, though they share one prefill: so the iterations' tokens sum to
        prompt_tokens_total + generation_tokens_total, as vLLM's do). A delta carries a new token when its
        count grew or it finished; an idle one carries none."""
        now, gaps, sampled, prompts, generated, firsts = time.monotonic(), [], 0, 0, 0, []
        for (handle, _), delta in zip(active, deltas, strict=True):
            generated += max(delta.completion_tokens - handle._tokens_seen, 0)
            if delta.completion_tokens > handle._tokens_seen or delta.finish_reason is not None:
                sampled += 1
                if handle.last_token_at is None:
                    handle.first_token_at = now
                    firsts.append(now - handle.submitted_at)
                    prompts += handle.prompt_tokens
                else:
                    gaps.append(now - handle.last_token_at)
                handle.last_token_at, handle._tokens_seen = now, delta.completion_tokens
            if delta.finish_reason is not None:
                self._ended(handle, now)
        for seconds in firsts:  # (each choice of an n > 1 request its own, however its caller reads them)
            self.observer.on_chat_first_token(seconds)
        if gaps:
            self.observer.on_chat_token_gaps(gaps)
        if generated:
            self.observer.on_chat_generated(generated)
        return sampled + prompts

    def _ended(self, handle: ChatHandle, now: float | None = None) -> None:
        """A chat ended, started or not (a 400-refused one is not reported: no finished request, as vLLM's):
        no longer running (nor preempted); report its timings and token counts (ChatTimes), once. Every
        chat the API counts under finished_reason is so reported (engine/chat_metering.py): vLLM's success
        counter and its per-request histograms count the same requests."""
        with self._queues_lock:
            self._running.discard(handle)
            self._preempted.discard(handle)
        if handle._ended:
            return
        handle._ended = True
        self.observer.on_chat_finished(handle.times(time.monotonic() if now is None else now))

    @staticmethod
    def _fail(handle: ChatHandle, exc: Exception) -> None:
        if isinstance(exc, ParamError):
            handle.emit(ChatFailed(400, exc.message, exc.param))
        else:
            log.exception("chat completion failed", exc_info=exc)
            release_frames(exc)  # (the record keeps no step's tensors: failures.py)
            handle.emit(ChatFailed(500, f"Chat completion failed: {type(exc).__name__}: {exc}"))

"""ChatWorker with a scripted backend (no model): event order, the model lock held around every model call,
cancellation at a step boundary (the session closed), failures as ChatFailed (400 for ParamError, 500
otherwise), FIFO order, and a chat the backend has no room for (ChatBackpressure) waiting for a running one.
"""

from __future__ import annotations

import queue
import threading

from chat_fakes import ScriptedChatBackend, ScriptedChatSession

from worldserve.chat_params import ChatMessage, ChatParams
from worldserve.engine.chat_events import ChatFailed, ChatStarted
from worldserve.engine.chat_worker import ChatWorker
from worldserve.engine.outputs import ChatBackpressure, ChatDelta
from worldserve.params import ParamError

PARAMS = ChatParams(messages=(ChatMessage(role="user", content="hi"),))


class ScriptedSession(ScriptedChatSession):
    def __init__(self, lock, words, gate=None):
        self.prompt_tokens, self.lock, self.words, self.gate, self.n = 7, lock, words, gate, 0
        self.closed = False

    def step(self) -> ChatDelta:
        assert self.lock.locked()  # every model call runs under the engine's model lock
        if self.gate is not None:
            self.gate.wait(5)
        self.n += 1
        done = "length" if self.n == len(self.words) else None
        return ChatDelta(text=self.words[self.n - 1], finish_reason=done, completion_tokens=self.n)

    def close(self) -> None:
        assert self.lock.locked()
        self.closed = True


class ScriptedBackend(ScriptedChatBackend):
    def __init__(self, lock, words=("a", "b", "c"), gate=None, fail=None):
        self.lock, self.words, self.gate, self.fail = lock, words, gate, fail

    def start(self, params):
        assert self.lock.locked()
        if self.fail is not None:
            raise self.fail
        self.sessions = getattr(self, "sessions", []) + [ScriptedSession(self.lock, self.words, self.gate)]
        return self.sessions[-1]

    def start_many(self, batch):
        self.starts = getattr(self, "starts", []) + [len(batch)]
        out = []
        for params in batch:
            try:
                out.append(self.start(params))
            except Exception as exc:
                out.append(exc)
        return out

    def step_all(self, sessions):
        self.batches = getattr(self, "batches", []) + [len(sessions)]
        return [s.step() for s in sessions]


class SlowGate:
    """A session gate that makes each step take 10 ms."""

    @staticmethod
    def wait(_timeout):
        threading.Event().wait(0.01)


def _collect(worker, params=PARAMS):
    events: queue.Queue = queue.Queue()
    handle = worker.submit(params, events.put)
    return handle, events


def _drain(events, until_done=True):
    out = []
    while True:
        ev = events.get(timeout=5)
        out.append(ev)
        if isinstance(ev, ChatFailed) or (isinstance(ev, ChatDelta) and ev.finish_reason):
            return out


def _two_chats(worker):
    """Queue two chats before the worker starts, run them to the end: their event lists."""
    streams = [_collect(worker)[1] for _ in range(2)]
    worker.start()
    try:
        return [_drain(ev) for ev in streams]
    finally:
        worker.stop()


def test_events_in_order_under_the_lock():
    lock = threading.Lock()
    worker = ChatWorker(ScriptedBackend(lock), lock)
    worker.start()
    try:
        _, ev1 = _collect(worker)
        _, ev2 = _collect(worker)
        first, second = _drain(ev1), _drain(ev2)
        assert first[0] == ChatStarted(prompt_tokens=7)
        assert [e.text for e in first[1:]] == ["a", "b", "c"] and first[-1].finish_reason == "length"
        assert second == first
    finally:
        worker.stop()
    assert not worker.alive


def test_cancel_stops_at_the_next_step_and_failures_are_reported():
    lock, gate = threading.Lock(), threading.Event()
    worker = ChatWorker(ScriptedBackend(lock, words=tuple("abcdefgh"), gate=gate), lock)
    worker.start()
    try:
        handle, events = _collect(worker)
        assert isinstance(events.get(timeout=5), ChatStarted)
        handle.cancel()
        gate.set()
        got = [events.get(timeout=5)]
        session = worker.backend.sessions[0]
        for _ in range(50):
            if session.closed:
                break
            threading.Event().wait(0.05)
        assert session.closed  # a cancelled chat's session is closed (its K/V blocks freed)
        worker.backend = ScriptedBackend(lock, fail=ParamError("messages", "bad image"))
        _, bad = _collect(worker)
        assert _drain(bad) == [ChatFailed(400, "bad image", "messages")]
        assert len(got) + events.qsize() <= 1  # at most the step already running when cancelled
        worker.backend = ScriptedBackend(lock, fail=RuntimeError("boom"))
        _, err = _collect(worker)
        (failed,) = _drain(err)
        assert failed.status == 500 and "boom" in failed.message
    finally:
        worker.stop()


class CancelBetweenLooks(threading.Event):
    """A chat's `cancelled` flag whose cancel lands between the worker's first look at it and any later one:
    once armed, False the first time it is read, True after."""

    def __init__(self):
        super().__init__()
        self.armed, self.looks = False, 0

    def is_set(self) -> bool:
        if not self.armed:
            return super().is_set()
        self.looks += 1
        return self.looks > 1


def test_a_cancel_landing_while_the_worker_looks_still_closes_the_chat():
    """The worker decides once per step whether a chat was cancelled: a cancel between two looks (the soak
    found ~1.6 % of cancelled streams) dropped the chat without closing it, its K/V blocks never returned."""
    lock = threading.Lock()
    worker = ChatWorker(ScriptedBackend(lock, words=tuple("ab" * 200), gate=SlowGate()), lock)
    worker.start()
    try:
        handle, events = _collect(worker)
        handle.cancelled = CancelBetweenLooks()
        assert isinstance(events.get(timeout=5), ChatStarted)
        handle.cancelled.armed = True
        session = worker.backend.sessions[0]
        for _ in range(100):
            if session.closed:
                break
            threading.Event().wait(0.02)
        assert session.closed, "a cancelled chat must be closed (its K/V blocks handed back)"
    finally:
        worker.stop()


def test_concurrent_chats_are_decoded_together_up_to_max_num_seqs():
    lock = threading.Lock()
    backend = ScriptedBackend(lock, words=("a", "b", "c", "d"))
    worker = ChatWorker(backend, lock, max_num_seqs=2)
    streams = [_collect(worker)[1] for _ in range(3)]  # queued before the worker starts: admitted together
    worker.start()
    try:
        outs = [_drain(ev) for ev in streams]
    finally:
        worker.stop()
    for out in outs:
        assert out[0] == ChatStarted(prompt_tokens=7) and "".join(e.text for e in out[1:]) == "abcd"
    # two chats share every step until they finish, then the third runs alone: 4 steps of 2, 4 of 1
    assert backend.batches == [2, 2, 2, 2, 1, 1, 1, 1]
    assert backend.starts == [2, 1]  # the two first chats were prefilled in one backend call


class RoomForOneBackend(ScriptedBackend):
    """Takes a second chat only once the first has finished (a K/V cache with room for one chat)."""

    def start(self, params):
        live = [s for s in getattr(self, "sessions", []) if s.n < len(s.words) and not s.closed]
        if live:
            self.refused = getattr(self, "refused", 0) + 1
            raise ChatBackpressure("no free K/V blocks")
        return super().start(params)


def test_a_chat_without_room_waits_for_a_running_one_instead_of_failing():
    lock = threading.Lock()
    backend = RoomForOneBackend(lock, words=("a", "b", "c"))
    first, second = _two_chats(ChatWorker(backend, lock, max_num_seqs=4))
    assert first == second and "".join(e.text for e in second[1:]) == "abc"
    assert backend.refused >= 1 and backend.batches == [1, 1, 1, 1, 1, 1]  # one after the other


def test_stop_fails_a_deferred_chat_instead_of_serving_it():
    """A chat deferred for lack of room when stop() comes is answered 503 (the running one finishes)."""
    lock = threading.Lock()

    backend = RoomForOneBackend(lock, words=tuple("abcdefghijklmnopqrstuvwxyz" * 4), gate=SlowGate())
    worker = ChatWorker(backend, lock, max_num_seqs=4)
    worker.start()
    try:
        _, first = _collect(worker)
        assert isinstance(first.get(timeout=5), ChatStarted)
        _, second = _collect(worker)
        for _ in range(100):
            if getattr(backend, "refused", 0):
                break
            threading.Event().wait(0.01)
        assert backend.refused >= 1
    finally:
        worker.stop()
    assert _drain(second) == [ChatFailed(503, "The server is shutting down.")]
    assert _drain(first)[-1].finish_reason == "length"


def test_a_step_hands_all_its_deltas_over_in_one_hop():
    """With call_in_consumer set (the server's event loop), the deltas of a step reach every chat's receive()
    in one call, not one per chat; the ChatStarted events still go through emit."""
    lock = threading.Lock()
    backend = ScriptedBackend(lock, words=("a", "b", "c"))
    worker = ChatWorker(backend, lock, max_num_seqs=4)
    hops = []
    worker.call_in_consumer = lambda fn: hops.append(fn) or fn()
    streams = []
    for _ in range(3):
        events: queue.Queue = queue.Queue()
        worker.submit(PARAMS, events.put, receive=events.put)
        streams.append(events)
    worker.start()
    try:
        outs = [_drain(ev) for ev in streams]
    finally:
        worker.stop()
    assert all("".join(e.text for e in out[1:]) == "abc" for out in outs)
    assert len(hops) == len(backend.batches) == 3  # three steps of three chats: three hops


def test_a_chat_refused_behind_one_that_failed_is_retried_not_refused():
    """A was given the room and failed; B, refused because A had it, is retried (and served) instead of
    answered 503 as if the pool could never hold it."""
    lock = threading.Lock()

    class FailFirst(ScriptedBackend):
        calls = 0

        def start_many(self, batch):
            FailFirst.calls += 1
            if FailFirst.calls == 1 and len(batch) == 2:
                return [RuntimeError("boom"), ChatBackpressure("A took the room")]
            return super().start_many(batch)

    first, second = _two_chats(ChatWorker(FailFirst(lock, words=("a", "b")), lock, max_num_seqs=4))
    assert first[0].status == 500 and "boom" in first[0].message
    assert isinstance(second[0], ChatStarted) and second[-1].finish_reason == "length"


class _Unlocked:
    """A stand-in for the model lock whose `locked()` is what ScriptedSession asserts: True while the real lock
    is held by someone else, here never (the backend runs beside video steps)."""

    def locked(self) -> bool:
        return True


def test_a_backend_that_runs_beside_video_steps_is_called_without_the_model_lock():
    """concurrent_with_video (the Reasoner on one CUDA GPU, runner/chat_share.py): the chat decodes while the
    video loop holds the model lock; without it the same chat waits for the lock."""
    lock = threading.Lock()
    backend = ScriptedBackend(_Unlocked())
    backend.concurrent_with_video = True
    worker = ChatWorker(backend, lock)
    with lock:  # a video step in progress
        handle, events = _collect(worker)
        worker.start()
        out = _drain(events)
    assert [type(e).__name__ for e in out] == ["ChatStarted", "ChatDelta", "ChatDelta", "ChatDelta"]
    worker.stop()
    backend.concurrent_with_video = False
    worker = ChatWorker(backend, lock)
    with lock:
        handle, events = _collect(worker)
        worker.start()
        try:
            events.get(timeout=0.5)
            raise AssertionError("a lock-sharing backend ran while the model lock was held")
        except queue.Empty:
            pass
    assert [type(e).__name__ for e in _drain(events)][0] == "ChatStarted"
    worker.stop()


def test_a_failing_loop_closes_its_chats_and_answers_the_queued_and_later_ones():
    """A bug in the loop itself (here the delivery hop raising, as a closed event loop's does) closes the
    running chats' sessions (their K/V back), fails them with a 500, and never leaves a chat waiting: a later
    one gets a 503 saying the worker stopped and why (not "shutting down": nothing is), counted nowhere."""
    lock = threading.Lock()
    backend = ScriptedBackend(lock)
    worker = ChatWorker(backend, lock)

    def closed_loop(fn):
        raise RuntimeError("Event loop is closed")

    worker.call_in_consumer = closed_loop
    events: queue.Queue = queue.Queue()
    worker.submit(PARAMS, events.put, receive=events.put)
    worker.start()
    out = _drain(events)
    why = "RuntimeError: Event loop is closed"
    assert out[0] == ChatStarted(prompt_tokens=7)
    assert out[-1] == ChatFailed(500, f"The Reasoner's chat worker stopped ({why}).")
    assert backend.sessions[0].closed
    worker._thread.join(5)
    assert not worker.alive and worker.stop_reason == why
    _, later = _collect(worker)
    message = f"The Reasoner's chat worker has stopped ({why}); no chat can run until the server restarts."
    assert later.get(timeout=1) == ChatFailed(503, message, refused=True)


def test_a_coalescing_chat_gets_its_first_delta_and_then_the_rest_merged():
    """Non-streaming callers (coalesce=True): the first token's delta at once (time to first token), the
    others merged into one final delta: the same text, token count and finish as token by token."""
    lock = threading.Lock()
    worker = ChatWorker(ScriptedBackend(lock, words=("a", "b", "c", "d")), lock)
    worker.start()
    try:
        events: queue.Queue = queue.Queue()
        worker.submit(PARAMS, events.put, coalesce=True)
        out = _drain(events)
    finally:
        worker.stop()
    assert out[0] == ChatStarted(prompt_tokens=7)
    assert out[1:] == [ChatDelta(text="a", finish_reason=None, completion_tokens=1),
                       ChatDelta(text="bcd", finish_reason="length", completion_tokens=4)]  # fmt: skip


def test_num_waiting_counts_queued_and_deferred_chats():
    """num_waiting (the /metrics waiting gauge): chats queued before the worker runs, then a chat deferred for
    lack of K/V room while another decodes, then none."""
    lock = threading.Lock()

    backend = RoomForOneBackend(lock, words=tuple("abcdefghij" * 4), gate=SlowGate())
    worker = ChatWorker(backend, lock, max_num_seqs=4)
    streams = [_collect(worker)[1] for _ in range(2)]
    assert worker.num_waiting == 2
    worker.start()
    try:
        assert isinstance(streams[0].get(timeout=5), ChatStarted)
        seen = set()
        for _ in range(200):  # the first chat decodes for ~0.4 s; the second waits for its room meanwhile
            if getattr(backend, "refused", 0):  # taken off the queue and refused: only deferral counts it now
                seen.add(worker.num_waiting)
                if 1 in seen:
                    break
            threading.Event().wait(0.005)
        assert 1 in seen  # the second chat, deferred while the first decodes
        for events in streams:
            _drain(events)
        assert worker.num_waiting == 0
    finally:
        worker.stop()


def test_chats_whose_clients_left_stop_counting_as_waiting_at_once():
    """A queued chat cancelled while every slot is busy leaves the waiting gauge at once, not when a slot
    frees (the worker drops it only then); a request's choices count one each."""
    lock = threading.Lock()

    backend = ScriptedBackend(lock, words=tuple("abcdefghij" * 10), gate=SlowGate())
    worker = ChatWorker(backend, lock, max_num_seqs=1)
    worker.start()
    try:
        running, events = _collect(worker)
        assert isinstance(events.get(timeout=5), ChatStarted)
        queued = worker.submit_many([(PARAMS, lambda e: None, None)] * 3)
        assert worker.num_waiting == 3
        for handle in queued[:2]:
            handle.cancel()
        assert worker.num_waiting == 1
        running.cancel()
        queued[2].cancel()
        assert worker.num_waiting == 0
    finally:
        worker.stop()


def test_the_worker_thread_prepares_its_backend_first():
    """The chat worker's thread calls its backend's prepare_thread before its loop (the Reasoner raises the
    decode step's graph limits there: from torch 2.12 the loader thread's setting did not reach it)."""
    lock = threading.Lock()
    threads = []

    class Preparing(ScriptedBackend):
        def prepare_thread(self):
            threads.append(threading.current_thread().name)

    worker = ChatWorker(Preparing(lock), lock)
    worker.start()
    try:
        assert _drain(_collect(worker)[1])[-1].finish_reason == "length"
    finally:
        worker.stop()
    assert threads == ["worldserve-chat"]

"""The Reasoner chats' timings as the metrics get them, without a server: the chat worker's reports
(ChatObserver, engine/chat_observer.py) on a scripted backend (tokens per iteration, inter-token gaps, and each
chat's ChatTimes: vLLM's queue, prefill, decode and inference intervals; idle steps of a preempted chat carry no
token, the stop token does), and each choice's time to first token.
tests/test_api_metrics.py scrapes the same numbers from /metrics after real chats.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import pytest
from chat_fakes import ScriptedChatBackend, ScriptedChatSession
from serving_helpers import wait_until

from worldserve.chat_params import ChatMessage, ChatParams
from worldserve.engine.chat_events import ChatFailed, ChatStarted
from worldserve.engine.chat_worker import ChatWorker
from worldserve.engine.outputs import ChatDelta


class _Session(ScriptedChatSession):
    """Scripted deltas: a token, an idle step (preempted: no token), a token, then the stop token."""

    prompt_tokens = 5

    def __init__(self):
        self.script = [(1, None), (1, None), (2, None), (2, "stop")]

    def close(self) -> None:
        pass


class _Backend(ScriptedChatBackend):
    def start_many(self, batch):
        return [_Session() for _ in batch]

    def step_all(self, sessions):
        return [
            ChatDelta(text="x", finish_reason=f, completion_tokens=n)
            for n, f in (s.script.pop(0) for s in sessions)
        ]


class _Recorder:
    def __init__(self):
        self.iterations, self.gaps, self.finished, self.ttft = [], [], [], []

    def on_chat_iteration(self, tokens):
        self.iterations.append(tokens)

    def on_chat_first_token(self, seconds):
        self.ttft.append(seconds)

    def on_chat_token_gaps(self, seconds):
        self.gaps += seconds

    def on_chat_generated(self, tokens):
        self.generated = getattr(self, "generated", 0) + tokens

    def on_chat_finished(self, times):
        self.finished.append(times)


def test_chat_worker_reports_timings():
    worker, recorder, events = ChatWorker(_Backend(), threading.Lock()), _Recorder(), queue.Queue()
    worker.observer = recorder
    worker.start()
    try:
        worker.submit(ChatParams(messages=(ChatMessage(role="user", content="hi"),)), events.put)
        while not (getattr(event := events.get(timeout=5), "finish_reason", None)):
            pass
        assert event.finish_reason == "stop"
        wait_until(lambda: recorder.finished)
    finally:
        worker.stop(1.0)
    assert recorder.iterations == [5 + 1, 1, 1]  # prefill + first token; the idle step reports nothing
    assert len(recorder.gaps) == 2 and all(g >= 0 for g in recorder.gaps)
    assert recorder.generated == 2  # the completion tokens, counted step by step (the stop step adds none)
    (times,) = recorder.finished
    assert 0 <= times.queue_s <= times.e2e_s


class _SlowBackend(_Backend):
    """A prefill of 50 ms and steps of 20 ms (the second one idle: no token)."""

    def start_many(self, batch):
        time.sleep(0.05)
        return super().start_many(batch)

    def step_all(self, sessions):
        time.sleep(0.02)
        return super().step_all(sessions)


def test_chat_worker_times_the_phases_as_vllm_defines_them():
    """vLLM's stats.py intervals on the worker's clock: prefill from the start of the admitting prefill to the
    first token (the prefill and the step that sampled it), decode from the first token to the last (an idle
    step between them counts: vLLM counts a preemption in the phase it interrupts), inference their sum;
    queue from submission to admission, all within the end-to-end time."""
    worker, recorder = ChatWorker(_SlowBackend(), threading.Lock()), _Recorder()
    worker.observer = recorder
    worker.start()
    try:
        worker.submit(ChatParams(messages=(ChatMessage(role="user", content="hi"),)), lambda event: None)
        wait_until(lambda: recorder.finished)
    finally:
        worker.stop(1.0)
    (times,) = recorder.finished
    assert times.prefill_s >= 0.07 and times.decode_s >= 0.06, times
    assert times.inference_s == pytest.approx(times.prefill_s + times.decode_s)
    assert 0 <= times.queue_s and times.queue_s + times.inference_s <= times.e2e_s + 1e-9


def test_a_wait_for_the_model_lock_is_queue_time_not_prefill():
    """Chats that take turns with video steps (the model lock) are admitted when their prefill gets the model:
    the time a video step held it counts as queue time (vLLM's QUEUED: not scheduled yet), not as prefill."""
    lock = threading.Lock()
    worker, recorder = ChatWorker(_Backend(), lock), _Recorder()
    worker.observer = recorder
    worker.start()
    try:
        with lock:  # a video step runs
            worker.submit(ChatParams(messages=(ChatMessage(role="user", content="hi"),)), lambda event: None)
            time.sleep(0.2)
        wait_until(lambda: recorder.finished)
    finally:
        worker.stop(1.0)
    (times,) = recorder.finished
    assert times.queue_s >= 0.2 and times.prefill_s < 0.1, times


def test_n_choices_count_their_prompt_each_as_vllm_s_child_requests():
    """A request's n choices are prefilled once (shared prompt K/V), yet tokens per iteration count the prompt
    for each, as vLLM's child requests do: the iterations then sum to the prompt and generation token
    counters, which count it per choice (they had counted it once: a metrics audit found the sums apart)."""
    worker, recorder, events = ChatWorker(_Backend(), threading.Lock()), _Recorder(), queue.Queue()
    worker.observer = recorder
    worker.start()
    try:
        params = ChatParams(messages=(ChatMessage(role="user", content="hi"),))
        worker.submit_many([(dataclasses.replace(params, seed=i), events.put, None) for i in range(3)])
        wait_until(lambda: len(recorder.finished) == 3)
    finally:
        worker.stop(1.0)
    assert recorder.iterations == [3 * 5 + 3, 3, 3]  # a prompt of 5 for each choice, then a token each


class _LongBackend(_Backend):
    """Chats of 30 tokens, a step of 10 ms each (a choice takes about 0.3 s)."""

    def start_many(self, batch):
        sessions = super().start_many(batch)
        for s in sessions:
            s.script = [(n, None) for n in range(1, 30)] + [(30, "length")]
        return sessions

    def step_all(self, sessions):
        time.sleep(0.01)
        return super().step_all(sessions)


def test_time_to_first_token_of_each_choice_is_when_the_worker_sampled_it():
    """The n choices of a non-streamed request decode together and are read one after another: each choice's
    time to first token is when the worker sampled it (a step or so after the request), not when its
    reader got to it (the second choice's had been after the whole first one, 0.3 s)."""
    worker, recorder = ChatWorker(_LongBackend(), threading.Lock()), _Recorder()
    worker.observer = recorder
    worker.start()
    try:
        params = ChatParams(messages=(ChatMessage(role="user", content="hi"),))
        worker.submit_many([(dataclasses.replace(params, seed=i), lambda e: None, None) for i in range(3)],
                           coalesce=True)  # fmt: skip
        wait_until(lambda: len(recorder.finished) == 3)
    finally:
        worker.stop(1.0)
    assert len(recorder.ttft) == 3 and max(recorder.ttft) < 0.1, recorder.ttft
    assert all(t.e2e_s > 0.25 for t in recorder.finished)


class _ChunkedBackend(_Backend):
    """A chat whose prompt prefills in chunks: two idle steps (no token, no text) before its first token."""

    def start_many(self, batch):
        sessions = super().start_many(batch)
        for s in sessions:
            s.script = [(0, None), (0, None), (1, None), (2, "stop")]
        return sessions

    def step_all(self, sessions):
        return [
            ChatDelta(text="x" * n if n > 0 else "", finish_reason=f, completion_tokens=n)
            for n, f in (s.script.pop(0) for s in sessions)
        ]


@pytest.mark.parametrize("coalesce", [False, True])
def test_a_chat_still_prefilling_delivers_nothing_before_its_first_token(coalesce):
    """The idle steps of a chat whose prompt is still prefilling (chunked) or which waits preempted carry no
    token: they are not delivered, so the first delta a caller (and the API's time to first token, which
    chat_metering.py takes at the first delta) sees is the first token's, streamed or coalesced."""
    worker, events = ChatWorker(_ChunkedBackend(), threading.Lock()), queue.Queue()
    worker.start()
    try:
        params = ChatParams(messages=(ChatMessage(role="user", content="hi"),))
        worker.submit(params, events.put, coalesce=coalesce)
        got = []
        while not getattr(got[-1] if got else None, "finish_reason", None):
            got.append(events.get(timeout=5))
    finally:
        worker.stop(1.0)
    deltas = [e for e in got if isinstance(e, ChatDelta)]
    assert deltas[0].completion_tokens == 1 and deltas[0].text == "x"
    assert "".join(d.text for d in deltas) == "x" + "xx"
    assert len(deltas) == 2


def test_a_chunked_prompt_counts_in_the_iteration_of_its_first_token():
    """vLLM's tokens per engine step count a prompt in the step that samples its first token (after a chunked
    prefill's last chunk), not when it is admitted: the idle chunk steps report nothing."""
    worker, recorder, events = ChatWorker(_ChunkedBackend(), threading.Lock()), _Recorder(), queue.Queue()
    worker.observer = recorder
    worker.start()
    try:
        worker.submit(ChatParams(messages=(ChatMessage(role="user", content="hi"),)), events.put)
        wait_until(lambda: recorder.finished)
    finally:
        worker.stop(1.0)
    assert recorder.iterations == [5 + 1, 1]  # two idle chunk steps, then the prompt + its first token


class _Endless(_Backend):
    """A token a step (20 ms each) until the chat is closed."""

    def start_many(self, batch):
        sessions = super().start_many(batch)
        for s in sessions:
            s.script = [(n, None) for n in range(1, 10_000)]
        return sessions

    def step_all(self, sessions):
        time.sleep(0.02)
        return super().step_all(sessions)


def test_every_ended_chat_reports_its_lengths_as_the_worker_counted_them():
    """Each chat that ends is reported once with the worker's counts (vLLM's per-request histograms count the
    requests its success counter does): one whose client left mid-answer with the tokens sampled for it
    (the API had counted those it read: 1 for a non-streamed chat's first event), one whose client left
    while it waited with no prompt length and all its time queued."""
    worker, recorder = ChatWorker(_Endless(), threading.Lock(), max_num_seqs=1), _Recorder()
    worker.observer = recorder
    worker.start()
    params = ChatParams(messages=(ChatMessage(role="user", content="hi"),))
    try:
        running = worker.submit(params, lambda event: None, coalesce=True)
        waiting = worker.submit(params, lambda event: None)
        wait_until(lambda: getattr(recorder, "generated", 0) >= 5)
        waiting.cancel()  # (seen when the worker next looks at its queue: once the running one has gone)
        running.cancel()
        wait_until(lambda: len(recorder.finished) == 2)
    finally:
        worker.stop(1.0)
    left, queued = recorder.finished
    assert queued.prompt_tokens is None and queued.generation_tokens == 0
    assert queued.queue_s == queued.e2e_s > 0 and queued.prefill_s == queued.decode_s == 0
    assert left.prompt_tokens == 5 and left.generation_tokens == recorder.generated >= 5


class EndsMeter:
    """A ChatMeter that keeps each chat's end (its finish reason; None: aborted) in `ended`."""

    def __init__(self) -> None:
        self.ended: list[str | None] = []

    def on_chat_started(self, prompt_tokens: int) -> None:
        pass

    def on_chat_ended(self, finish_reason: str | None) -> None:
        self.ended.append(finish_reason)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("events", "ended"),
    [
        ([ChatStarted(prompt_tokens=3), ChatFailed(status=500, message="boom")], ["error"]),
        ([ChatFailed(status=500, message="boom")], ["error"]),
        ([ChatStarted(prompt_tokens=3), ChatFailed(status=503, message="shutting down")], [None]),
        ([ChatFailed(status=400, message="bad")], []),  # refused: the route's 400, not a finished request
    ],
)
async def test_a_server_error_ends_a_chat_as_vllms_error_reason(events, ended):
    """vLLM counts a request its engine failed under finished_reason "error" (it had been "abort", as a client
    leaving); a shutdown's 503 stays an abort, a refusal is not counted."""
    from worldserve.engine.chat_metering import metered

    meter = EndsMeter()

    class Source:
        def __aiter__(self):
            return self._gen()

        async def _gen(self):
            for e in events:
                yield e

        async def aclose(self) -> None:
            pass

    assert [e async for e in metered(Source(), meter)] == events
    assert meter.ended == ended


@pytest.mark.anyio
async def test_closing_a_metered_chat_stops_it_whether_or_not_it_was_read():
    """A reader that closes a metered chat stops the chat, also one it never read (an async generator closed
    before its first step ran none of its body: the chat ran on); counted an abort once it was asked for an
    event, nowhere before, and once however often it is closed."""
    import asyncio

    from worldserve.engine.chat_metering import metered

    class Source:
        def __init__(self) -> None:
            self.closed, self.gate = 0, asyncio.Event()

        def __aiter__(self):
            return self._gen()

        async def _gen(self):
            yield ChatStarted(prompt_tokens=3)
            await self.gate.wait()

        async def aclose(self) -> None:
            self.closed += 1

    unread, meter = Source(), EndsMeter()
    await metered(unread, meter).aclose()
    assert unread.closed == 1 and meter.ended == []

    read, meter = Source(), EndsMeter()
    events = metered(read, meter)
    assert isinstance(await anext(events), ChatStarted)
    await events.aclose()
    await events.aclose()
    assert read.closed == 1 and meter.ended == [None]
    with pytest.raises(StopAsyncIteration):
        await anext(events)

    waiting, meter = Source(), EndsMeter()
    events = metered(waiting, meter)
    await anext(events)
    task = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert waiting.closed == 1 and meter.ended == [None]


@pytest.mark.anyio
async def test_a_client_gone_as_its_answer_is_ready_counts_its_chats_aborted():
    """`start_all`'s `opened` (what a route closes when its client leaves, also just as the answer became
    ready) holds the metered streams: closing them stops the chats and counts the started ones aborted (it
    held the engine's own streams, which stopped them uncounted)."""
    from worldserve.api.chat_stream import close_all, start_all

    meter = EndsMeter()

    class Events:
        def __init__(self) -> None:
            self.closed = False
            self._events = iter([ChatStarted(prompt_tokens=3)])

        def __aiter__(self):
            return self

        async def __anext__(self):
            return next(self._events)

        async def aclose(self) -> None:
            self.closed = True

    engine_streams = [Events(), Events()]

    class Client:
        def chat_many(self, choices, coalesce):
            return engine_streams

    opened: list = []
    streams, firsts = await start_all(Client(), [None, None], meter, coalesce=False, opened=opened)
    assert len(firsts) == 2 and opened == streams
    await close_all(opened)
    assert all(e.closed for e in engine_streams) and meter.ended == [None, None]

"""Counting a chat's events where they are consumed (the API's chats and completions, the prompt upsampling's)
into a `ChatMeter` (the Prometheus metrics implement it; api/metrics.py): started (its prompt tokens) and
ended (its finish reason). A chat that ends before it started (cancelled while queued, failed by a shutdown or
a full K/V cache) is counted ended without a finish reason ("abort", as vLLM counts an aborted waiting
request); one that a server error ended, "error" (vLLM's FinishReason.ERROR); one refused with a 4xx before it
started is the route's 400, not a finished request, and one refused because the chat worker had stopped
(ChatFailed.refused, a 503) none either (vLLM counts nothing once its engine is dead). What the chat worker knows better than a reader of the
events is counted there: running and waiting chats (its queues, read at scrape time: a preempted chat waits),
the time to first token (when the worker sampled it: the n choices of one request are read one after another),
tokens per iteration, inter-token gaps, and each chat's lengths (the tokens it sampled: a reader that left
took fewer) and queue, prefill, decode and inference time (chat_worker.py, chat_observer.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from worldserve.engine.chat_events import ChatEvent, ChatStarted
from worldserve.engine.outputs import ChatDelta


@runtime_checkable
class ChatMeter(Protocol):
    def on_chat_started(self, prompt_tokens: int) -> None: ...

    def on_chat_ended(self, finish_reason: str | None) -> None:
        """finish_reason "error": a server error ended it; None: aborted (client gone, shut down). Its token
        counts are the chat worker's (ChatObserver.on_chat_finished), not the events a reader took."""


class ChatEventSource(Protocol):
    """A chat's events, closed by its reader (chat_events.ChatEvents, or `metered`'s pass-through)."""

    def __aiter__(self) -> AsyncIterator[ChatEvent]: ...

    async def aclose(self) -> None: ...


def metered(events: ChatEventSource, meter: ChatMeter) -> MeteredChatEvents:
    """Pass a chat's events through, counting its prompt tokens and how it ended (tokens, finish reason)."""
    return MeteredChatEvents(events, meter)


class MeteredChatEvents:
    """`events` passed through and counted into `meter`: its start (ChatStarted's prompt tokens) and its end
    (the last delta's finish reason, "error", or None for an abort), once, when the events end, fail, or the
    reader closes it. `aclose()` always closes `events` (stopping the chat at its next step), also on one
    never read: an async generator closed before its first step runs none of its body, so a reader that
    closed an unread one left its chat running (a chat never asked for an event is counted nowhere, as before:
    whether it would have been refused, a 4xx that is the route's and no finished request, is not known).
    Idempotent."""

    def __init__(self, events: ChatEventSource, meter: ChatMeter):
        self._events, self._meter = events, meter
        self._iterator: AsyncIterator[ChatEvent] | None = None
        self._begun = self._started = self._refused = self._closed = False
        self._finish: str | None = None

    def __aiter__(self) -> MeteredChatEvents:
        return self

    async def __anext__(self) -> ChatEvent:
        if self._closed:
            raise StopAsyncIteration
        if self._iterator is None:
            self._iterator = aiter(self._events)
        self._begun = True
        try:
            event = await anext(self._iterator)
        except BaseException:  # (its end, a failure, a cancellation: the chat is over for this reader)
            await self.aclose()
            raise
        self._count(event)
        return event

    def _count(self, event: ChatEvent) -> None:
        if isinstance(event, ChatStarted):
            self._started = True
            self._meter.on_chat_started(event.prompt_tokens)
        elif isinstance(event, ChatDelta):
            self._finish = event.finish_reason
        # (a ChatFailed: its request was refused, or never reached a chat worker that had stopped)
        elif not self._started and (event.status < 500 or event.refused):
            self._refused = True
        elif event.status < 500:  # its rules left no next token mid-answer: vLLM's finish_reason "error"
            self._finish = "error"
        # a server error: vLLM's finished_reason "error" (503, a shutdown's end, stays an abort, as vLLM
        # counts one)
        elif event.status != 503:
            self._finish = "error"

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._events.aclose()
        if self._begun and not self._refused:
            self._meter.on_chat_ended(self._finish)

"""Counting a chat's events where they are consumed (the API's chats and completions, the prompt upsampling's)
into a `ChatMeter` (the Prometheus metrics implement it; api/metrics.py): started (its prompt tokens) and
ended (its finish reason). A chat that ends before it started (cancelled while queued, failed by a shutdown or
a full K/V cache) is counted ended without a finish reason ("abort", as vLLM counts an aborted waiting
request); one that a server error ended, "error" (vLLM's FinishReason.ERROR); one refused with a 4xx before it
started is the route's 400, not a finished request. What the chat worker knows better than a reader of the
events is counted there: running and waiting chats (its queues, read at scrape time: a preempted chat waits),
the time to first token (when the worker sampled it: the n choices of one request are read one after another),
tokens per iteration, inter-token gaps, and each chat's lengths (the tokens it sampled: a reader that left
took fewer) and queue, prefill, decode and inference time (chat_worker.py, chat_observer.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
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


def metered(events: ChatEventSource, meter: ChatMeter) -> AsyncGenerator[ChatEvent, None]:
    """Pass a chat's events through, counting its prompt tokens and how it ended (tokens, finish reason)."""
    return _metered(events, meter)


async def _metered(events: ChatEventSource, meter: ChatMeter) -> AsyncGenerator[ChatEvent, None]:
    started, finish, refused = False, None, False
    try:
        async for event in events:
            if isinstance(event, ChatStarted):
                started = True
                meter.on_chat_started(event.prompt_tokens)
            elif isinstance(event, ChatDelta):
                finish = event.finish_reason
            elif not started and event.status < 500:  # (a ChatFailed: its request was refused)
                refused = True
            elif event.status < 500:  # its rules left no next token mid-answer: vLLM's finish_reason "error"
                finish = "error"
            # a server error: vLLM's finished_reason "error" (503, a shutdown's end, stays an abort, as vLLM
            # counts one)
            elif event.status >= 500 and event.status != 503:
                finish = "error"
            yield event
    finally:
        await events.aclose()
        if not refused:
            meter.on_chat_ended(finish)

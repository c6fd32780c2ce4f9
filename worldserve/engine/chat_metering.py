"""Counting a chat's events where they are consumed (the API's chats and completions, the prompt upsampling's)
into a `ChatMeter` (the Prometheus metrics implement it; api/metrics.py): started (its prompt tokens) and
ended (its prompt and completion tokens and finish reason). What the chat worker knows better than a reader
of the events is counted there: running and waiting chats (its queues, read at scrape time: a preempted chat
waits), the time to first token (when the worker sampled it: the n choices of one request are read one
after another), tokens per iteration, inter-token gaps, and each chat's queue, prefill, decode and inference
time (chat_worker.py, chat_observer.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol, runtime_checkable

from worldserve.engine.chat_worker import ChatEvent, ChatStarted
from worldserve.engine.outputs import ChatDelta


@runtime_checkable
class ChatMeter(Protocol):
    def on_chat_started(self, prompt_tokens: int) -> None: ...

    def on_chat_ended(
        self, completion_tokens: int, finish_reason: str | None, *, prompt_tokens: int = 0
    ) -> None: ...


class ChatEventSource(Protocol):
    """A chat's events, closed by its reader (chat_worker.ChatEvents, or `metered`'s pass-through)."""

    def __aiter__(self) -> AsyncIterator[ChatEvent]: ...

    async def aclose(self) -> None: ...


def metered(events: ChatEventSource, meter: ChatMeter) -> AsyncGenerator[ChatEvent, None]:
    """Pass a chat's events through, counting its prompt tokens and how it ended (tokens, finish reason)."""
    return _metered(events, meter)


async def _metered(events: ChatEventSource, meter: ChatMeter) -> AsyncGenerator[ChatEvent, None]:
    prompt, completion, finish = None, 0, None
    try:
        async for event in events:
            if isinstance(event, ChatStarted):
                prompt = event.prompt_tokens
                meter.on_chat_started(prompt)
            elif isinstance(event, ChatDelta):
                completion, finish = event.completion_tokens, event.finish_reason
            yield event
    finally:
        await events.aclose()
        if prompt is not None:
            meter.on_chat_ended(completion, finish, prompt_tokens=prompt)

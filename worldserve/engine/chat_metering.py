"""Counting a chat's events where they are consumed (the API's chats and completions, the prompt upsampling's)
into a `ChatMeter` (the Prometheus metrics implement it; api/metrics.py): started (its prompt tokens), time to
first token, ended (its completion tokens and finish reason). The chat worker's own timings (tokens per
iteration, inter-token gaps, queue time) go through chat_observer.py.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Protocol

from worldserve.engine.chat_worker import ChatStarted
from worldserve.engine.outputs import ChatDelta


class ChatMeter(Protocol):
    def on_chat_started(self, prompt_tokens: int) -> None: ...

    def on_chat_first_token(self, seconds: float) -> None: ...

    def on_chat_ended(self, completion_tokens: int, finish_reason: str | None) -> None: ...


async def metered(events: AsyncIterator, meter: ChatMeter) -> AsyncIterator:
    """Pass a chat's events through, counting tokens, time to first token and how the chat ended."""
    t0, started, completion, finish, first_token = time.perf_counter(), False, 0, None, True
    try:
        async for event in events:
            if isinstance(event, ChatStarted):
                started = True
                meter.on_chat_started(event.prompt_tokens)
            elif isinstance(event, ChatDelta):
                if first_token:
                    meter.on_chat_first_token(time.perf_counter() - t0)
                    first_token = False
                completion, finish = event.completion_tokens, event.finish_reason
            yield event
    finally:
        await events.aclose()
        if started:
            meter.on_chat_ended(completion, finish)

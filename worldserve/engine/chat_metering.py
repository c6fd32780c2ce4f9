"""Counting a chat's events where they are consumed (the API's chats and completions, the prompt upsampling's)
into a `ChatMeter` (the Prometheus metrics implement it; api/metrics.py): started (its prompt tokens), time to
first token, ended (its prompt and completion tokens and finish reason). The chat worker's own timings (tokens
per iteration, inter-token gaps, and each chat's queue, prefill, decode and inference time) go through
chat_observer.py.
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

    def on_chat_ended(
        self, completion_tokens: int, finish_reason: str | None, *, prompt_tokens: int = 0
    ) -> None: ...


def metered(events: AsyncIterator, meter: ChatMeter) -> AsyncIterator:
    """Pass a chat's events through, counting tokens, time to first token (from now: the n choices of one
    request are wrapped together and read one after another) and how the chat ended."""
    return _metered(events, meter, time.perf_counter())


async def _metered(events: AsyncIterator, meter: ChatMeter, t0: float) -> AsyncIterator:
    prompt, completion, finish, first = None, 0, None, True
    try:
        async for event in events:
            if isinstance(event, ChatStarted):
                prompt = event.prompt_tokens
                meter.on_chat_started(prompt)
            elif isinstance(event, ChatDelta):
                if first:
                    first = False
                    meter.on_chat_first_token(time.perf_counter() - t0)
                completion, finish = event.completion_tokens, event.finish_reason
            yield event
    finally:
        await events.aclose()
        if prompt is not None:
            meter.on_chat_ended(completion, finish, prompt_tokens=prompt)

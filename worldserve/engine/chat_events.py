"""What a chat tells its caller: `ChatStarted(prompt_tokens, ...)` once its prompt is prefilled, then one
`ChatDelta` per sampled token (the last with its finish_reason), or `ChatFailed(status, message, param)`;
and `ChatEvents`, those events as an async iterator whose `aclose()` cancels the chat.

Separate from engine/chat_worker.py, which produces them on its thread: these are the types every reader of
a chat shares (engine/client.py bridges them into asyncio, engine/chat_metering.py and the api/ routes
read them, engine/prompt_upsampling.py waits on one) without the worker itself. `ChatFailed.status` is
HTTP-like: 400 for a bad request (a ParamError, `param` naming its field), 500 for a server error, 503 when
the server is shutting down, the K/V cache has no room or the chat worker has stopped (`refused`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worldserve.engine.outputs import ChatDelta

if TYPE_CHECKING:
    from worldserve.engine.chat_handle import ChatHandle


@dataclass(frozen=True, slots=True)
class ChatStarted:
    prompt_tokens: int
    """Tokens of the rendered prompt (image placeholders expanded)."""
    prompt_logprobs: tuple | None = None
    """With ChatParams.prompt_logprobs: each prompt token's TokenLogprob (the first one's logprob None)."""
    cached_tokens: int = 0
    """Prompt tokens whose K/V came from the prefix cache (usage's cached_tokens)."""
    prompt_token_ids: tuple[int, ...] | None = None
    """With ChatParams.return_token_ids: the rendered prompt's token ids (image placeholders expanded)."""


@dataclass(frozen=True, slots=True)
class ChatFailed:
    status: int
    """HTTP-like status: 400 for a bad request, 500 for a server error."""
    message: str
    param: str | None = None
    refused: bool = False
    """Refused before it reached the model, by no fault of its own (the chat worker had stopped): no finished
    request, counted nowhere (engine/chat_metering.py), as vLLM counts none once its engine is dead."""


ChatEvent = ChatStarted | ChatDelta | ChatFailed


class ChatEvents:
    """One chat's events as an async iterator: ChatStarted, ChatDelta... (the last with its finish_reason), or
    ChatFailed. `aclose()` (also on one never iterated) cancels the chat at its next step; idempotent."""

    def __init__(self, events: asyncio.Queue, handle: ChatHandle):
        self._events, self._handle, self._done = events, handle, False

    def __aiter__(self) -> ChatEvents:
        return self

    async def __anext__(self) -> ChatEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._events.get()
        if isinstance(event, ChatFailed) or (isinstance(event, ChatDelta) and event.finish_reason):
            self._done = True
        return event

    async def aclose(self) -> None:
        self._done = True
        self._handle.cancel()

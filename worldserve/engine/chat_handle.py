"""ChatHandle: one chat on the chat worker (engine/chat_worker.py): its params, where its events go, its
cancellation, the coalescing of a non-streaming caller's deltas, and the worker's timings of it (admitted,
first and last token: `times` gives its ChatTimes, vLLM's intervals).

Created by `ChatWorker.submit_many` on the caller's thread; from then on read and written on the worker's
thread only, except `cancel()` (any thread: a threading.Event) and the deliveries, which `emit` / `receive`
hand to the consumer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worldserve.chat_params import ChatParams
from worldserve.engine.chat_observer import ChatTimes
from worldserve.engine.outputs import ChatDelta

if TYPE_CHECKING:
    from worldserve.engine.chat_events import ChatEvent


@dataclass(slots=True, eq=False)
class ChatHandle:
    params: ChatParams
    emit: Callable[[ChatEvent], None]
    """Thread-safe: called from the worker thread."""
    receive: Callable[[ChatEvent], None] | None = None
    """The same delivery for the consumer's own thread (e.g. an asyncio queue's put_nowait), which lets the
    worker hand all deltas of a step over in one `call_in_consumer` hop instead of one hop per chat."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    coalesce: bool = False
    """Deliver the first delta (time to first token) and then one merged delta at the end, not one a token:
    a non-streaming caller needs nothing in between, and each delivery wakes the consumer's event loop."""
    _held: list[ChatDelta] = field(default_factory=list)  # coalesce: the deltas since the first one
    _first_sent: bool = False
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    """When the prefill that admitted it started (worker thread); None: not started (yet)."""
    prompt_tokens: int = 0
    """Its prompt's tokens, once admitted (counted in the iteration of its first token)."""
    first_token_at: float | None = None
    """When its first token was sampled (worker thread); None: none yet."""
    last_token_at: float | None = None
    """When its latest token was sampled (worker thread)."""
    _tokens_seen: int = 0  # completion_tokens of its latest delta
    _ended: bool = False  # its end was reported to the observer

    def cancel(self) -> None:
        self.cancelled.set()

    def times(self, now: float) -> ChatTimes:
        """Its intervals as vLLM defines them (ChatTimes) and its token counts, the chat having ended at `now`:
        a chat with tokens runs to its last one, one without spent its time up to `now` before a first token,
        one never admitted all of it queued."""
        if self.admitted_at is None:
            return ChatTimes(e2e_s=now - self.submitted_at, queue_s=now - self.submitted_at, prefill_s=0.0,
                             decode_s=0.0, inference_s=0.0)  # fmt: skip
        last = now if self.last_token_at is None else self.last_token_at
        first = last if self.first_token_at is None else self.first_token_at
        return ChatTimes(e2e_s=now - self.submitted_at, queue_s=self.admitted_at - self.submitted_at,
                         prefill_s=first - self.admitted_at, decode_s=last - first,
                         inference_s=last - self.admitted_at, prompt_tokens=self.prompt_tokens,
                         generation_tokens=self._tokens_seen)  # fmt: skip

    def outgoing(self, delta: ChatDelta) -> ChatDelta | None:
        """What to deliver for this step's delta now (None: held, when coalescing)."""
        if not self.coalesce or not self._first_sent:
            self._first_sent = True
            return delta
        self._held.append(delta)
        if delta.finish_reason is None:
            return None
        held, self._held = self._held, []
        return ChatDelta.joined(held)

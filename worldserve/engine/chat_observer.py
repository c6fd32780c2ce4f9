"""Where the chat worker reports its timings (the Prometheus metrics implement it; api/metrics.py).

All calls come from the chat worker's thread, measured with time.monotonic() there:
- `on_chat_iteration(tokens)`: one loop iteration of the worker that did model work: the prompt tokens of the
  chats it admitted (prefilled) plus the tokens its batched decode step sampled (vLLM's tokens per engine step).
- `on_chat_token_gaps(seconds)`: for each token sampled in one batched step by a chat that had sampled one
  before, the time since that chat's previous token (vLLM's inter-token latency; the first token's delay is
  the time to first token, measured by the API).
- `on_chat_finished(e2e_s, queue_s)`: once per started chat when it ends (stop, length, cancelled by its
  client, failed or stopped at shutdown): submit to end, and submit to the start of the prefill that
  admitted it (the time it waited in the queue, including waits for K/V room).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class ChatObserver(Protocol):
    def on_chat_iteration(self, tokens: int) -> None: ...

    def on_chat_token_gaps(self, seconds: Sequence[float]) -> None: ...

    def on_chat_finished(self, e2e_s: float, queue_s: float) -> None: ...


class NullChatObserver:
    def on_chat_iteration(self, tokens: int) -> None:
        pass

    def on_chat_token_gaps(self, seconds: Sequence[float]) -> None:
        pass

    def on_chat_finished(self, e2e_s: float, queue_s: float) -> None:
        pass

"""Where the chat worker reports its timings (the Prometheus metrics implement it; api/metrics.py).

All calls come from the chat worker's thread, measured with time.monotonic() there:
- `on_chat_iteration(tokens)`: one loop iteration of the worker that sampled tokens: those tokens plus the
  prompts of the chats whose first token it sampled (vLLM's tokens per engine step: a prompt counts in the
  step of its first token, after a chunked prefill's last chunk; the n choices of one prompt once).
- `on_chat_generated(tokens)`: the completion tokens one batched step sampled, all chats together (vLLM
  counts its generation tokens per engine step, so a rate over a window shows tokens as they come).
- `on_chat_first_token(seconds)`: a chat's first token sampled: the time since it was submitted (vLLM's time
  to first token; each choice of an n > 1 request its own, whatever order its caller reads them in).
- `on_chat_token_gaps(seconds)`: for each token sampled in one batched step by a chat that had sampled one
  before, the time since that chat's previous token (vLLM's inter-token latency).
- `on_chat_finished(times)`: once per started chat when it ends (stop, length, cancelled by its client,
  failed or stopped at shutdown): its ChatTimes, the intervals vLLM's metrics define.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class ChatTimes:
    """One started chat's intervals on the chat worker's clock, as vLLM defines them for a finished request
    (vllm/v1/metrics/stats.py update_from_finished_request: QUEUED, first SCHEDULED, first and last NEW_TOKEN;
    a preemption changes none of those points). Here a chat is scheduled when the prefill that admits it
    starts, and a token's time is when the worker step that sampled it returns (after the decode forward
    that consumes it, the Reasoner sampling a token before that forward; on_chat_first_token is measured at
    the same point); a chat that ended before its first token spent all its running time in prefill
    (decode 0)."""

    e2e_s: float
    """Submitted to its end."""
    queue_s: float
    """Submitted to the start of the prefill that admitted it (waits for K/V room included)."""
    prefill_s: float
    """Admitted to its first token."""
    decode_s: float
    """Its first token to its last."""
    inference_s: float
    """Admitted to its last token (prefill + decode: vLLM's RUNNING phase)."""
    prompt_tokens: int | None = None
    """Its prompt's tokens as the worker rendered them; None: it ended before it was admitted (its prompt
    was never rendered), its intervals then all queue time."""
    generation_tokens: int = 0
    """The tokens the worker sampled for it (its client may have read fewer: one that left mid-answer)."""


@runtime_checkable
class ChatObserver(Protocol):
    def on_chat_iteration(self, tokens: int) -> None: ...

    def on_chat_first_token(self, seconds: float) -> None: ...

    def on_chat_generated(self, tokens: int) -> None: ...

    def on_chat_token_gaps(self, seconds: Sequence[float]) -> None: ...

    def on_chat_finished(self, times: ChatTimes) -> None: ...


class NullChatObserver:
    def on_chat_iteration(self, tokens: int) -> None:
        pass

    def on_chat_first_token(self, seconds: float) -> None:
        pass

    def on_chat_generated(self, tokens: int) -> None:
        pass

    def on_chat_token_gaps(self, seconds: Sequence[float]) -> None:
        pass

    def on_chat_finished(self, times: ChatTimes) -> None:
        pass

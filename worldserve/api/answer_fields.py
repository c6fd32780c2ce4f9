"""The per-token fields of chat and text completion answers, as vLLM writes them: logprobs, prompt_logprobs,
token ids and usage.

`TokenView` is a request's token-id options (vLLM's return_token_ids, return_tokens_as_token_ids: a logprob
names its token "token_id:<id>"); `logprob_items` turns the engine's TokenLogprobs into OpenAI's
`logprobs.content` items and `prompt_logprob_rows` into vLLM's `prompt_logprobs` rows (log-probabilities
floored at LOGPROB_FLOOR: JSON has no -inf); `make_usage` is an answer's `usage` (the prompt counted once,
with --enable-prompt-tokens-details its cached tokens, with --reasoning-parser the thought tokens) and
`chunk_usage` a streamed chunk's under `continuous_usage_stats`. Used by api/chat_stream.py,
api/completions_stream.py and api/responses.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from worldserve.api.chat_protocol import (
    CompletionTokensDetails,
    PromptLogprob,
    PromptTokensDetails,
    TokenLogprobOut,
    TopLogprob,
    Usage,
)  # fmt: skip

if TYPE_CHECKING:
    from worldserve.api.sampling_request import SamplingRequest
    from worldserve.engine.client import TokenLogprob

LOGPROB_FLOOR = -9999.0
"""Log-probabilities are floored here in JSON answers (JSON has no -inf)."""


@dataclass(frozen=True, slots=True)
class TokenView:
    """vLLM's token-id options of a request."""

    ids: bool = False
    """return_token_ids: the prompt's and the choices' token ids beside the text."""
    as_ids: bool = False
    """return_tokens_as_token_ids: logprobs name their tokens "token_id:<id>"."""

    @classmethod
    def of(cls, body: SamplingRequest, as_ids: bool = False) -> TokenView:
        """A chat or text completion request's (chat_protocol.SamplingRequest) options; `as_ids`: the server's
        --return-tokens-as-token-ids, for a request that sends no return_tokens_as_token_ids."""
        own = body.return_tokens_as_token_ids
        return cls(ids=bool(body.return_token_ids), as_ids=as_ids if own is None else own)

    def names(self, entry: TokenLogprob) -> tuple[str, list[str]]:
        """A TokenLogprob's token and its alternatives as this request shows them."""
        if self.as_ids:
            return f"token_id:{entry.token_id}", [f"token_id:{i}" for i in entry.top_ids]
        return entry.token, [t for t, _ in entry.top]


def logprob_items(entries: Iterable[TokenLogprob], view: TokenView = TokenView()) -> list[TokenLogprobOut]:
    """engine TokenLogprobs -> the OpenAI `logprobs.content` items (with each token's UTF-8 bytes); a token a
    structured output's grammar forbids (-inf) is listed at LOGPROB_FLOOR, as vLLM lists it."""
    items = []
    for e in entries:
        token, tops = view.names(e)
        assert e.logprob is not None  # (a sampled token's: None only for a prompt's first token)
        items.append(TokenLogprobOut(
            token=token, logprob=max(e.logprob, LOGPROB_FLOOR), bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=max(lp, LOGPROB_FLOOR), bytes=list(t.encode()))
                          for t, (_, lp) in zip(tops, e.top, strict=True)],
        ))  # fmt: skip
    return items


def make_usage(
    prompt_tokens: int, completion: int, cached: int | None = None, reasoning: int | None = None
) -> Usage:
    """The `usage` object: the prompt counted once plus `completion` tokens; with `cached` (the prompt's
    tokens found in the prefix cache, --enable-prompt-tokens-details), its prompt_tokens_details; with
    `reasoning` (the thought tokens, --reasoning-parser), its completion_tokens_details."""
    details = None if cached is None else PromptTokensDetails(cached_tokens=cached)
    thoughts = None if reasoning is None else CompletionTokensDetails(reasoning_tokens=reasoning)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=details, completion_tokens_details=thoughts)  # fmt: skip


def chunk_usage(prompt_tokens: int, completion: int, **details: Any) -> Usage:
    """The usage a streamed chunk carries with continuous_usage_stats, set as vLLM sets it: the counts, and
    `details` (a chat's completion_tokens_details); never the prompt's details, which vLLM sets on the final
    usage only (SSEChunk leaves out what is not set)."""
    total = prompt_tokens + completion
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=total, **details)


def prompt_logprob_rows(entries: Sequence | None, k: int | None) -> list | None:
    """vLLM's `prompt_logprobs` from a prompt's TokenLogprobs (ChatStarted.prompt_logprobs): per prompt token
    after the first (None), its own entry first (as vLLM orders them) and the `k` most likely tokens, keyed by
    token id."""
    if k is None or not entries:
        return None
    out: list = [None]
    for e in entries[1:]:
        row = {str(e.token_id): PromptLogprob(logprob=max(e.logprob, LOGPROB_FLOOR), rank=e.rank,
                                              decoded_token=e.token)}  # fmt: skip
        ranked = zip(e.top_ids[:k], e.top[:k], range(1, k + 1), strict=False)
        for i, (t, v), r in ranked:
            row.setdefault(str(i), PromptLogprob(logprob=max(v, LOGPROB_FLOOR), rank=r, decoded_token=t))
        out.append(row)
    return out

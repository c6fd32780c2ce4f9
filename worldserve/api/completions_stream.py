"""From Reasoner event streams to `text_completion` answers: the whole object, or SSE chunks (POST /v1/completions).

Choices are numbered prompt-major, as vLLM numbers them: choice `i * n + j` is sample j of prompt i. Each
choice is one chat on the ChatWorker (all queued together, admitted in order as decode slots free up,
decoded batched). `collect` runs every choice to its end; `sse` (started once the first choice has, as
vLLM streams each prompt's outputs as they come) sends each delta as a chunk `{"choices": [{"index", "text",
"logprobs", "finish_reason"}]}` as it comes (the finish_reason rides on the choice's last chunk), then the
usage chunk when asked and `data: [DONE]`; a failure mid-stream (a later choice that fails to start too) is
`data: {"error": ...}` then `data: [DONE]`. With `echo`, a choice's text starts with its prompt's text. Usage
sums every prompt's tokens and every choice's completion tokens; with `continuous_usage_stats` a chunk
carries its prompt's and its choice's counts so far (no details, as vLLM's). Chunks carry the fields vLLM's
do (chat_protocol.SSEChunk: the final usage chunk has no null field).
Legacy logprobs (`legacy_logprobs`): per token its text (decoded alone), its log-probability, a dict of the
sampled token and the top alternatives, and `text_offset`, the running sum of the token texts' lengths from
the choice's text so far (vLLM's arithmetic); log-probabilities are floored at -9999 (JSON has no -inf).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from worldserve.api.answer_fields import (
    LOGPROB_FLOOR,
    TokenView,
    chunk_usage,
    make_usage,
    prompt_logprob_rows,
)
from worldserve.api.chat_stream import ChatStream, run_all, sse_events
from worldserve.api.completions_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
)

if TYPE_CHECKING:
    from worldserve.api.chat_protocol import Usage
    from worldserve.engine.client import ChatDelta, ChatStarted


def legacy_logprobs(entries: Sequence, offset: int = 0, view: TokenView = TokenView()) -> CompletionLogprobs:
    """engine TokenLogprobs -> OpenAI's legacy logprobs, the first token's text at character `offset` (the
    tokens named as `view` says; offsets count their texts). A prompt's first token (echo) has no
    log-probability: None and no alternatives, as vLLM gives it."""
    out = CompletionLogprobs()
    for e in entries:
        token, tops = view.names(e)
        out.text_offset.append(offset)
        offset += len(e.token)
        out.tokens.append(token)
        if e.logprob is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(max(e.logprob, LOGPROB_FLOOR))
        # the sampled token first, as vLLM lists it
        top = {token: e.logprob, **{t: lp for t, (_, lp) in zip(tops, e.top, strict=True)}}
        out.top_logprobs.append({t: max(lp, LOGPROB_FLOOR) for t, lp in top.items()})
    return out


class Completion:
    """What every choice of one completions request shares: ids, echo texts, prompt sizes, options. Each
    prompt's counts, ids and logprobs come from its choices' ChatStarted (`started`) as they start: a
    stream answers once its first choice has started, so a prompt still queued has the route's count of
    its tokens (`prompt_sizes`) until then, which only the request log line reads."""

    def __init__(
        self, request_id: str, created: int, model: str, *, echoes: Sequence[str | None], n: int,
        logprobs: int | None, echo_only: bool, prompt_logprobs: int | None, prompt_sizes: Sequence[int],
        details: bool = False, view: TokenView = TokenView(),
    ) -> None:  # fmt: skip
        self.request_id, self.created, self.model = request_id, created, model
        self.echoes, self.n, self.logprobs = echoes, n, logprobs  # logprobs: the request's (None: none)
        self.echo_only = echo_only  # `echo` with max_tokens 0: the generated text is left out
        self.prompt_logprobs = prompt_logprobs  # the request's vLLM field
        self.view = view  # vLLM's token-id options
        prompts = len(echoes)
        # per prompt (counted once for its n choices): its tokens, its tokens' TokenLogprobs (when asked
        # for), its token ids (with return_token_ids)
        self.prompt_tokens = list(prompt_sizes)
        self.prompt_entries: list[tuple | None] = [None] * prompts
        self.prompt_ids: list[Sequence[int] | None] = [None] * prompts
        # per prompt, its tokens found in the prefix cache (with --enable-prompt-tokens-details, else None)
        self.cached: list[int] | None = [0] * prompts if details else None
        self._heard = [False] * prompts  # a ChatStarted of the prompt came

    def started(self, index: int, event: ChatStarted) -> None:
        """Choice `index` started: its prompt's counts, logprobs and ids from the first of its choices (the
        one sampled with the prompt's own seed, whose prefill looked up the cached tokens; its other choices'
        are the same prompt's, taken when one of them comes first)."""
        prompt, leader = index // self.n, index % self.n == 0
        if leader or not self._heard[prompt]:
            self._heard[prompt] = True
            self.prompt_tokens[prompt] = event.prompt_tokens
            self.prompt_entries[prompt] = event.prompt_logprobs
            self.prompt_ids[prompt] = event.prompt_token_ids
        if leader and self.cached is not None:
            self.cached[prompt] = event.cached_tokens

    def logprobs_of(self, index: int, entries: Sequence, offset: int) -> CompletionLogprobs | None:
        """Choice `index`'s legacy logprobs: its prompt's (with echo, once: `offset` 0) then its `entries`
        (none with echo_only: the generated token is left out)."""
        if self.logprobs is None:
            return None
        prompt, entries = index // self.n, () if self.echo_only else entries
        prompt_entries = self.prompt_entries[prompt]
        if offset or self.echoes[prompt] is None or not prompt_entries:
            return legacy_logprobs(entries, offset, self.view)
        echoed = [replace(e, top=e.top[: self.logprobs], top_ids=e.top_ids[: self.logprobs])
                  for e in prompt_entries]  # fmt: skip
        return legacy_logprobs((*echoed, *entries), 0, self.view)

    def token_ids(self, index: int, first: bool, sampled: Sequence[int]) -> dict[str, Any]:
        """vLLM's return_token_ids fields of choice `index`'s answer or chunk: its prompt's ids (on its
        `first` one) and the `sampled` ids (none with echo_only); {} without the option."""
        if not self.view.ids:
            return {}
        prompt = {"prompt_token_ids": list(self.prompt_ids[index // self.n] or ())} if first else {}
        return {**prompt, "token_ids": [] if self.echo_only else list(sampled)}

    def vllm_prompt_logprobs(self, index: int) -> list | None:
        """vLLM's `prompt_logprobs` of choice `index` (with the request's field)."""
        return prompt_logprob_rows(self.prompt_entries[index // self.n], self.prompt_logprobs)

    def usage(self, completion: int) -> Usage:
        """Usage of `completion` tokens over every prompt (the prompts' cached tokens in its details)."""
        return make_usage(
            sum(self.prompt_tokens), completion, None if self.cached is None else sum(self.cached)
        )

    def response(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )


async def collect(streams: Sequence[ChatStream], c: Completion) -> CompletionResponse:
    """Run every choice to its end -> the `text_completion` object (APIError if a choice fails)."""
    finished = await run_all(streams)
    choices = [
        CompletionChoice(
            index=index, text=(c.echoes[index // c.n] or "") + ("" if c.echo_only else whole.text),
            finish_reason=whole.finish_reason,
            logprobs=c.logprobs_of(index, whole.logprobs, 0), stop_reason=whole.stop_reason,
            prompt_logprobs=c.vllm_prompt_logprobs(index), **c.token_ids(index, True, whole.token_ids),
        )
        for index, whole in enumerate(finished)
    ]  # fmt: skip
    completion = sum(whole.completion_tokens for whole in finished)
    return c.response(choices, c.usage(completion))


def sse(
    streams: Sequence[ChatStream], c: Completion, include_usage: bool, continuous_usage: bool = False
) -> AsyncIterator[str]:
    """The choices' deltas as SSE chunks as they arrive, then the usage chunk (when asked) and [DONE]; a
    choice's ChatStarted still in its stream (a stream answers once its first choice has started) gives its
    prompt's counts (`c.started`) before any of its chunks."""
    completion = [0] * len(streams)
    sent = [0] * len(streams)  # characters of each choice's text sent so far (its next text_offset)
    started = [False] * len(streams)  # each choice's first chunk sent (its prompt's ids go there)

    def render(index: int, event: ChatDelta) -> Iterator[str]:
        completion[index] = event.completion_tokens
        echo = c.echoes[index // c.n] if not sent[index] else None
        text = (echo or "") + ("" if c.echo_only else event.text)
        if not (text or event.logprobs or event.finish_reason or (c.view.ids and event.token_ids)):
            return
        lps = c.logprobs_of(index, event.logprobs, sent[index])
        ids = c.token_ids(index, not started[index], event.token_ids)
        started[index] = True
        sent[index] += len(text)
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=lps,
            finish_reason=event.finish_reason,
            stop_reason=event.stop_reason,
            **ids,
        )
        # vLLM's chunk usage: the chunk's prompt and choice's counts, no details
        usage = chunk_usage(c.prompt_tokens[index // c.n], completion[index]) if continuous_usage else None
        yield c.response([choice], usage).sse()

    def tail() -> Iterator[str]:
        if include_usage:
            yield c.response([], c.usage(sum(completion))).sse()

    return sse_events(streams, render, tail, started=c.started)

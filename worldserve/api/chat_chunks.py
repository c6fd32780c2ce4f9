"""The SSE chunks of a streamed chat answer (POST /v1/chat/completions with `stream: true`), for n choices.

`sse` merges the choices' events as they come (api/chat_stream.py sse_events): once the request's first
choice has started (api/chat.py), every choice's role chunk (the answer's first also carries the prompt's
ids with return_token_ids; then vLLM's echo, the continued message), as vLLM sends them on the first output
of any choice; then each choice's chunks as its events come (with tools, each text through a ToolStream
into content / tool_calls deltas; with a reasoning parser, reasoning_content deltas), a choice that is still
queued holding back none of the others; each choice ends with a `delta: {}` chunk carrying its
finish_reason; then the usage chunk when asked and `data: [DONE]`. The choices share one prompt, so the
first choice's ChatStarted gives the prompt's counts (and its cached tokens: the leader looked them up);
the later choices' ChatStarted change nothing here. With `continuous_usage_stats` every choice chunk also
carries usage so far, as vLLM's serving_chat.py reports it: the prompt and that chunk's choice's completion
tokens (0 on the role chunk), completion_tokens_details null without a reasoning parser (with one vLLM
counts the thoughts so far; those come at the answer's end here, so the field is left out), no
prompt_tokens_details; only the final chunk sums them (with a reasoning parser, its
completion_tokens_details.reasoning_tokens). Chunks carry the fields vLLM's do (chat_protocol.SSEChunk: what
vLLM does not set is left out, e.g. stop_reason before the final chunk).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from worldserve.api.answer_fields import TokenView, chunk_usage, logprob_items, make_usage
from worldserve.api.chat_protocol import ChatCompletionChunk, ChoiceLogprobs, ChunkChoice
from worldserve.api.chat_stream import AnswerStream, ChatStream, TextParsing, sse_events

if TYPE_CHECKING:
    from worldserve.engine.client import ChatDelta, TokenLogprob


async def sse(
    streams: Sequence[ChatStream], request_id: str, created: int, model: str, prompt_tokens: int,
    include_usage: bool, continuous_usage: bool = False, parsing: TextParsing = TextParsing(),
    cached: int | None = None, view: TokenView = TokenView(), prompt_ids: Sequence[int] | None = None,
) -> AsyncIterator[str]:  # fmt: skip
    """The choices' events merged into SSE chunks as they arrive (`continuous_usage`: usage on each one);
    each choice's text split and parsed as `parsing` says (AnswerStream: reasoning_content, content and
    tool_calls deltas). `prompt_tokens`, `cached` and `prompt_ids` are the first choice's (its ChatStarted
    read by start_all); a later choice's ChatStarted, still in its stream, is passed over (the same prompt)."""
    chunks = _ChoiceChunks(
        request_id=request_id, created=created, model=model, prompt_tokens=prompt_tokens,
        include_usage=include_usage, continuous_usage=continuous_usage, parsing=parsing, cached=cached,
        view=view, prompt_ids=prompt_ids, choices=len(streams),
    )  # fmt: skip
    async for text in sse_events(streams, chunks.render, chunks.tail, head=chunks.head()):
        yield text


@dataclass(slots=True, kw_only=True)
class _ChoiceChunks:
    """The SSE chunks of one streamed chat answer of `choices` choices (sse): each choice's head (its role,
    then vLLM's echo), its events' chunks as they come and the usage chunk at the end. Not frozen: it keeps
    each choice's running token counts (the usage) and text parser."""

    request_id: str
    created: int
    model: str
    prompt_tokens: int
    include_usage: bool
    continuous_usage: bool
    parsing: TextParsing
    cached: int | None
    view: TokenView
    prompt_ids: Sequence[int] | None
    choices: int
    completion: list[int] = field(init=False)
    """Each choice's completion tokens so far."""
    thoughts: list[int] = field(init=False)
    """Each choice's reasoning tokens so far."""
    parsers: list[AnswerStream] = field(init=False)

    def __post_init__(self) -> None:
        self.completion, self.thoughts = [0] * self.choices, [0] * self.choices
        self.parsers = [self.parsing.stream() for _ in range(self.choices)]

    def chunk(
        self, index: int, delta: dict[str, Any], finish: str | None = None,
        logprobs: Sequence[TokenLogprob] = (), stop: str | int | None = None, ids: Sequence[int] | None = None,
        head: bool = False,
    ) -> str:  # fmt: skip
        """One choice chunk's SSE text (`head`: the answer's first, which carries the prompt's ids)."""
        view = self.view
        lp = ChoiceLogprobs(content=logprob_items(logprobs, view)) if logprobs else None
        if "reasoning_content" in delta:  # the thoughts under both names (AssistantMessage)
            delta = {"reasoning": delta["reasoning_content"], **delta}
        # set on the final chunk only, as vLLM
        stop_reason: dict[str, Any] = {} if finish is None else {"stop_reason": stop}
        token_ids: dict[str, Any] = {"token_ids": list(ids or ())} if view.ids else {}
        choice = ChunkChoice(
            index=index, delta=delta, finish_reason=finish, logprobs=lp, **stop_reason, **token_ids
        )
        # vLLM sets completion_tokens_details on a chunk's usage: null without --reasoning-parser, the thought
        # tokens so far with one (not known here before the answer's end: left out then)
        thoughts = {} if self.parsing.reasoning else {"completion_tokens_details": None}
        usage = None
        if self.continuous_usage:
            usage = chunk_usage(self.prompt_tokens, self.completion[index], **thoughts)
        prompt: dict[str, Any] = (
            {"prompt_token_ids": list(self.prompt_ids or ())} if head and view.ids else {}
        )
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                   usage=usage, **prompt).sse()  # fmt: skip

    def head(self) -> list[str]:
        """Every choice's first chunk (its role; the answer's first also carries the prompt's ids), then
        each one's echo chunk."""
        parsing = self.parsing
        roles = [self.chunk(index, {"role": parsing.role, "content": ""}, head=index == 0)
                 for index in range(self.choices)]  # fmt: skip
        if parsing.echo:  # vLLM's chat echo: the continued message right after the role
            roles += [self.chunk(index, {"content": parsing.echo}) for index in range(self.choices)]
        return roles

    def render(self, index: int, event: ChatDelta) -> Iterator[str]:
        """The chunks of choice `index`'s `event`: its parsed deltas, then its final chunk when it ends."""
        parsing, view, parser = self.parsing, self.view, self.parsers[index]
        self.completion[index], self.thoughts[index] = event.completion_tokens, event.reasoning_tokens
        finish = event.finish_reason
        deltas = [d for d in parser.feed(event.text, finish is not None)
                  if parsing.include_reasoning or "reasoning_content" not in d]  # fmt: skip
        if finish is not None:
            finish = parser.finish_reason(finish)
        logprobs = () if parsing.hides_tokens else event.logprobs
        if (logprobs or (view.ids and event.token_ids)) and not deltas:
            deltas = [{"content": ""}]
        for i, delta in enumerate(deltas):
            yield self.chunk(
                index, delta, logprobs=logprobs if i == 0 else (), ids=event.token_ids if i == 0 else ()
            )
        if finish is not None:
            yield self.chunk(index, {}, finish, stop=event.stop_reason)

    def tail(self) -> Iterator[str]:
        """The usage chunk, when the request asked for it (`stream_options.include_usage`)."""
        if self.include_usage:
            usage = make_usage(
                self.prompt_tokens, sum(self.completion), self.cached,
                self.parsing.reasoning_tokens(sum(self.thoughts)),
            )  # fmt: skip
            yield ChatCompletionChunk(
                id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage
            ).sse()

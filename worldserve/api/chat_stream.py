"""From Reasoner event streams to OpenAI chat responses, for n choices: starting them, the non-streaming object.

Each choice is one chat on the ChatWorker (they decode batched together; it admits a request's choices as
decode slots free up, so the later ones may wait). `start_all` starts a request's choices and waits for the
first event of each (a non-streamed answer) or of the first one alone (a stream: a queued choice must not
hold back the others' chunks; the later choices' ChatStarted then come through their streams, which
`sse_events` hands to its `started`); `metered` counts every chat into the metrics; `collect` builds the
`chat.completion` object (with tools, each text's calls parsed out: api/tool_stream.py final_message);
`sse_events` merges the choices' events as they come into SSE text (api/chat_chunks.py renders a chat's
chunks, api/completions_stream.py a text completion's) and closes with `data: [DONE]`. A failure mid-stream
(a later choice that fails to start too) is sent as `data: {"error": ...}` then `data: [DONE]`, the other
choices closed. Closing any of these stops the chats at their next step.
Usage counts the prompt once and the completion tokens of every choice (as vLLM does), and with a reasoning
parser their thought tokens (completion_tokens_details.reasoning_tokens).
vLLM's token-id options (api/answer_fields.py `TokenView`, which also makes the logprobs and usage objects):
return_token_ids puts the prompt's ids on the answer and each choice's sampled ids on it;
return_tokens_as_token_ids names logprobs' tokens "token_id:<id>".
`start_all`, `run_all` and `sse_events` serve the text completions too (api/completions.py,
api/completions_stream.py). `TextParsing` / `AnswerStream` (a streamed answer's text into its parsed
deltas) serve the chat chunks and the Responses API's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from worldserve.api.answer_fields import TokenView, logprob_items, make_usage
from worldserve.api.chat_protocol import AssistantMessage, ChatCompletionResponse, Choice, ChoiceLogprobs
from worldserve.api.errors import APIError, error_body
from worldserve.api.reasoning import ReasoningStream, split_reasoning
from worldserve.api.tool_calls import ToolMode
from worldserve.api.tool_stream import ToolStream, final_message
from worldserve.engine.client import (
    ChatDelta,
    ChatFailed,
    ChatStarted,
    ChatUnavailableError,
    ShuttingDownError,
    metered,
)

if TYPE_CHECKING:
    from worldserve.chat_params import ChatParams
    from worldserve.engine.client import ChatMeter, EngineClient

log = logging.getLogger(__name__)


class ChatStream(Protocol):
    """A chat's events as the routes read and close them (the engine's ChatEvents, `metered`'s MeteredChatEvents)."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    async def aclose(self) -> None: ...


async def start_all(
    client: EngineClient, choices: Sequence[ChatParams], metrics: ChatMeter, *, coalesce: bool,
    opened: list[ChatStream], first_only: bool = False,
) -> tuple[list[ChatStream], list[ChatStarted]]:  # fmt: skip
    """Start `choices` (ChatParams) together on the chat worker (`opened` gets their metered event streams,
    so a caller watching for a disconnect can close them, counted as aborts) and wait for each one's first event: (the metered
    streams, their ChatStarted events). `first_only` (a stream): wait for the first choice's alone (one
    ChatStarted), the others' stay unread in their streams, to come as they are admitted. A failed choice
    waited for (its status), no Reasoner (400) or a shutdown (503) answers the request, after every choice
    started is stopped."""
    streams: list = []
    try:
        # (the metered streams: a client gone just as the answer was ready closes these, its chats counted
        # aborted; closing the engine's own streams had stopped them uncounted)
        streams = [metered(events, metrics) for events in client.chat_many(choices, coalesce=coalesce)]
        opened += streams
        firsts = []
        # admitted in order, as decode slots allow (those admitted together share the prompt's K/V)
        for events in streams[:1] if first_only else streams:
            first = await anext(events)
            if isinstance(first, ChatFailed):
                raise APIError(first.status, first.message, param=first.param)
            assert isinstance(first, ChatStarted)
            firsts.append(first)
    except BaseException as exc:  # stop whatever started: a failed choice, a refusal, a cancellation
        await close_all(streams)
        if isinstance(exc, ChatUnavailableError):
            raise APIError(400, str(exc)) from None
        if isinstance(exc, ShuttingDownError):
            raise APIError(503, str(exc)) from None
        raise
    return streams, firsts


async def close_all(streams: Sequence[ChatStream]) -> None:
    """Close every chat's event stream (stops those still running at their next step)."""
    for events in streams:
        await events.aclose()


async def run_to_end(events: ChatStream) -> ChatDelta:
    """One chat's remaining events as one delta (its text, log-probabilities and token ids, its ending and
    counts: ChatDelta.joined; a ChatStarted still unread is passed over); APIError if it fails."""
    deltas = []
    async for event in events:
        if isinstance(event, ChatFailed):
            raise APIError(event.status, event.message, param=event.param)
        if not isinstance(event, ChatStarted):
            deltas.append(event)
    assert deltas and all(isinstance(d, ChatDelta) for d in deltas)
    return ChatDelta.joined(deltas)


async def run_all(streams: Sequence[ChatStream]) -> list[ChatDelta]:
    """run_to_end of every chat in order; all are closed at the end, also on a failure or a cancellation
    (client gone: the chats stop at their next step)."""
    try:
        return [await run_to_end(events) for events in streams]
    finally:
        await close_all(streams)


async def sse_events(
    streams: Sequence[ChatStream], render: Callable[[int, ChatDelta], Iterable[str]],
    tail: Callable[[], Iterable[str]], head: Iterable[str] = (),
    started: Callable[[int, ChatStarted], None] | None = None,
) -> AsyncIterator[str]:  # fmt: skip
    """The SSE text of n choices: `head`, then `render(index, delta)` of each delta as it comes (a choice's
    ChatStarted still in its stream, start_all's `first_only`, goes to `started(index, event)`), `tail()`
    and `data: [DONE]`; a failure mid-stream (also a choice that fails to start) is `data: {"error": ...}`
    then `data: [DONE]`. Closes the streams."""
    try:
        for text in head:
            yield text
        async with contextlib.aclosing(merged(streams)) as events:
            async for index, event in events:
                if isinstance(event, ChatFailed):
                    yield _error_event(event.status, event.message, event.param)
                    return
                if isinstance(event, ChatStarted):
                    if started is not None:
                        started(index, event)
                    continue
                for text in render(index, event):
                    yield text
        for text in tail():
            yield text
        yield "data: [DONE]\n\n"
    except Exception:  # a bug rendering a chunk: the client still gets an error event and the end marker
        log.exception("a chat stream failed while rendering its chunks")
        yield _error_event(500, "Internal server error while streaming the response")
    finally:
        await close_all(streams)


def _error_event(status: int, message: str, param: str | None = None) -> str:
    """vLLM's mid-stream failure: the error envelope as an event, then the end marker."""
    return f"data: {json.dumps(error_body(status, message, param, vllm=True))}\n\ndata: [DONE]\n\n"


async def merged(streams: Sequence[ChatStream]) -> AsyncGenerator[tuple[int, Any], None]:
    """(index, event) of every stream as its events come, until all have ended; closing it stops the pumps."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, events: ChatStream) -> None:
        async for event in events:
            await queue.put((index, event))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, ev)) for i, ev in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, event = await queue.get()
            if event is None:
                open_streams -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True, slots=True)
class TextParsing:
    """How a chat's text becomes its answer message."""

    tools: ToolMode | None = None
    """The request's tools: their calls parsed out of the content (api/tool_stream.py); None: no tools."""
    reasoning: bool = False
    """--reasoning-parser qwen3: a <think> answer split into reasoning_content and content (api/reasoning.py)."""
    include_reasoning: bool = True
    """vLLM's request field: false drops the reasoning from the answer."""
    echo: str = ""
    """vLLM's chat echo: the continued assistant message, put before the content."""
    role: str = "assistant"
    """The answer's role: --response-role after a generation prompt, else the last message's (vLLM's
    get_chat_request_role)."""

    @property
    def hides_tokens(self) -> bool:
        """Whether the answer's logprobs are left out: thoughts dropped by `include_reasoning: false` (vLLM's
        rule: their tokens would show in the logprobs, so none are sent, streamed or not)."""
        return self.reasoning and not self.include_reasoning

    def reasoning_tokens(self, count: int) -> int | None:
        """usage's completion_tokens_details.reasoning_tokens: `count` with --reasoning-parser (dropped thoughts
        too, as vLLM counts them), else None (no details, as vLLM without a parser)."""
        return count if self.reasoning else None

    def stream(self) -> AnswerStream:
        """A parser of one streamed answer's text as this says."""
        return AnswerStream(self)


class AnswerStream:
    """One streamed answer's text deltas -> its parsed deltas: {"reasoning_content": ...} (the thoughts, under
    --reasoning-parser), {"content": ...} and {"tool_calls": [...]} (the content through the tools' parser),
    adding up to what a finished answer's split_reasoning + final_message give. The chat chunks and the
    Responses API's events (api/responses_output.py) are both made from these."""

    def __init__(self, parsing: TextParsing) -> None:
        tools = parsing.tools
        self.thoughts = ReasoningStream() if parsing.reasoning else None
        self.calls = ToolStream(tools) if tools is not None and tools.parsed else None

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas of this text piece (the last one when `finished`)."""
        pieces = (
            self.thoughts.feed(text, finished) if self.thoughts else ([{"content": text}] if text else [])
        )
        deltas: list[dict[str, Any]] = []
        for piece in pieces:
            if "content" in piece and self.calls is not None:
                deltas += self.calls.feed(piece["content"], False)
            else:
                deltas.append(piece)
        if self.calls is not None and finished:
            deltas += self.calls.feed("", True)
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        """The answer's finish_reason: "tool_calls" once an auto call was parsed out."""
        return self.calls.finish_reason(reason) if self.calls is not None else reason


async def collect(
    streams: Sequence[ChatStream],
    request_id: str,
    created: int,
    model: str,
    prompt_tokens: int,
    logprobs: bool,
    parsing: TextParsing = TextParsing(),
    cached: int | None = None,
    view: TokenView = TokenView(),
) -> ChatCompletionResponse:
    """Run every choice to its end -> the `chat.completion` object (APIError if a chat fails); each text
    split and parsed as `parsing` says."""
    choices, completion, thoughts = [], 0, 0
    for index, whole in enumerate(await run_all(streams)):
        completion += whole.completion_tokens
        thoughts += whole.reasoning_tokens
        reasoning, content = split_reasoning(whole.text) if parsing.reasoning else (None, whole.text)
        content, calls, finish = final_message(content, parsing.tools, whole.finish_reason)
        if parsing.echo:
            content = parsing.echo + (content or "")
        reasoning = reasoning if parsing.include_reasoning else None
        message = AssistantMessage(role=parsing.role, content=content, tool_calls=calls, reasoning=reasoning,
                                   reasoning_content=reasoning)  # fmt: skip
        shown = logprobs and not parsing.hides_tokens
        choices.append(Choice(
            index=index, message=message, finish_reason=finish,
            logprobs=ChoiceLogprobs(content=logprob_items(whole.logprobs, view)) if shown else None,
            stop_reason=whole.stop_reason, token_ids=list(whole.token_ids) if view.ids else None,
        ))  # fmt: skip
    return ChatCompletionResponse(
        id=request_id,
        created=created,
        model=model,
        choices=choices,
        usage=make_usage(prompt_tokens, completion, cached, parsing.reasoning_tokens(thoughts)),
    )

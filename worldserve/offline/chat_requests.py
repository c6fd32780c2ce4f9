"""The offline Engine's chats: `chat` / `stream_chat`'s arguments read by the HTTP route's own code, then run
on the engine's chat worker.

The messages (OpenAI's format: roles, string or part content, `image_url` / `video_url` parts with base64
`data:` URLs, `file://` paths under the engine's `allowed_local_media_path`, http(s) URLs) and the sampling
fields (the chat completion request's: temperature, max_tokens, stop, seed, response_format, tools, ...) are
validated as a `ChatCompletionRequest` body and turned into ChatParams by api/chat.py's `chat_choices`, the code
POST /v1/chat/completions runs: the same checks, media loading and prompt building, and the same sampling
defaults (the checkpoint's generation config). vLLM's `LLM.chat` shares its server's message parsing the same
way (vllm/entrypoints/chat_utils.py). A bad field is a ParamError (a ValueError) naming it as the HTTP 400 would
(`messages[0].content[1].image_url`, `temperature`). A whole ChatParams may be passed instead of sampling
fields: its sampling is used as it is, the messages still read here.

`n` (1 to 16) samples a conversation n times, as the route's `n` choices: started together (one prefill,
batched decode), sample i seeded seed + i, so a seeded call gives the route's choices byte for byte. `best_of`
is refused (REFUSED_FIELDS), and so is n > 1 in a stream (one text stream cannot carry n answers).
`chat_answer` runs one chat to its ChatOutput on the engine's loop, `chat_answers` a batch of them (vLLM's
list of conversations) together: the first failure, or an interrupt of the caller, cancels the rest. Each chat's
events pass through the route's meter (engine/chat_metering.py `metered`) into the Engine's metrics: its prompt
tokens and how it ended, as /metrics counts the route's (offline/metrics.py; the chat worker counts the rest).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from worldserve.chat_params import ChatParams
from worldserve.engine.chat_metering import MeteredChatEvents
from worldserve.engine.client import ChatDelta, ChatFailed, ChatStarted, metered
from worldserve.offline.outputs import ChatChoice, ChatOutput, ChatUsage
from worldserve.param_errors import ParamError

if TYPE_CHECKING:
    from worldserve.api.state import AppState

REFUSED_FIELDS = {
    "stream": "use stream_chat() for a streamed answer",
    "stream_options": "use stream_chat() for a streamed answer",
    "model": "the Engine serves one model",
    "best_of": "every sample is returned: pass n and choose among the ChatOutput's outputs (vLLM's V1 dropped "
    "best_of for the same; the chat route takes none)",
    "timeout": "a chat takes no timeout: bound it with max_tokens (or leave a stream_chat early)",
    **dict.fromkeys(
        ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "return_tokens_as_token_ids"),
        "the Engine's ChatOutput carries no logprobs or echoed prompt: ask /v1/chat/completions for them",
    ),
}
"""Fields with no meaning for an offline call (the chat completion's; vLLM's best_of), and what to do instead."""

STREAMED_SAMPLES = (
    "stream_chat yields one answer's text: for n samples call chat(), whose outputs hold them all"
)
"""Why stream_chat refuses n > 1."""

ChatStream = MeteredChatEvents
"""A started chat's events as the offline calls read them: metered (its start and end counted), closed by
its reader."""


def request_body(messages: str | Sequence[Mapping[str, Any]], sampling: Mapping[str, Any]) -> Any:
    """The call as a ChatCompletionRequest (api/chat_protocol.py), validated as the route validates a JSON
    body: ParamError naming the first bad field; a field the request has no use for (or no such field) too,
    where the route would ignore it: a misspelt keyword argument must not pass in silence."""
    from pydantic import ValidationError

    from worldserve.api.chat_protocol import ChatCompletionRequest
    from worldserve.api.errors import validation_error

    for name in sampling:
        if name in REFUSED_FIELDS:
            raise ParamError(name, f"{name} is not taken here: {REFUSED_FIELDS[name]}")
        if name == "messages" or name not in ChatCompletionRequest.model_fields:
            raise ParamError(name, f"{name!r} is not a chat completion field")
    if isinstance(messages, str):  # (one user turn, as LLM.generate takes a prompt)
        messages = [{"role": "user", "content": messages}]
    elif not isinstance(messages, Sequence) or isinstance(messages, (bytes, bytearray)):
        given = type(messages).__name__
        raise ParamError("messages", f"messages must be a list of messages or a string, got {given}")
    data = {"messages": [_pil_parts(i, m) for i, m in enumerate(messages)], **sampling}
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        param = validation_error(errors).param or "messages"
        # (the first error's words: the HTTP 400's message is the whole list, as JSON reprs)
        raise ParamError(param, f"{param}: {errors[0]['msg']}") from None


def is_conversation_batch(messages: Any) -> bool:
    """Whether chat()'s `messages` is a list of conversations (each a list of messages), vLLM's batched
    `LLM.chat` call, rather than one conversation."""
    if isinstance(messages, (str, bytes, bytearray, Mapping)) or not isinstance(messages, Sequence):
        return False
    return len(messages) > 0 and all(
        isinstance(m, Sequence) and not isinstance(m, (str, bytes, bytearray)) for m in messages
    )


def _pil_parts(index: int, message: Any) -> Any:
    """A message (messages[`index`]) whose `image_pil` parts (vLLM's offline spelling: a PIL image) are PNG
    `data:` URL image_url parts, which the route reads; other messages as they are. A part whose image_pil is
    no PIL image is a ParamError naming it (it was an AttributeError)."""
    content = message.get("content") if isinstance(message, Mapping) else None
    if not isinstance(content, list) or not any(isinstance(p, Mapping) and "image_pil" in p for p in content):
        return message
    import base64
    import io

    from PIL import Image

    parts = []
    for j, part in enumerate(content):
        if isinstance(part, Mapping) and "image_pil" in part:
            if not isinstance(part["image_pil"], Image.Image):
                field = f"messages[{index}].content[{j}].image_pil"
                raise ParamError(
                    field, f"{field} must be a PIL image, got {type(part['image_pil']).__name__}"
                )
            buffer = io.BytesIO()
            part["image_pil"].save(buffer, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
            part = {"type": "image_url", "image_url": {"url": url}}
        parts.append(part)
    return {**message, "content": parts}


async def start_chats(
    st: AppState, body: Any, params: ChatParams | None, *, coalesce: bool
) -> list[ChatStream]:
    """On the client's loop: the route's checks and ChatParams of the body's `n` samples (api/chat.py
    chat_choices: media fetched and decoded, the prompt built, sample i seeded seed + i; `params` given: its
    sampling over the messages read here, its `n` samples made the same way), then all started together on
    the worker (one prefill of their shared prompt, decoded batched); their events, in index order, counted in
    the state's metrics as the route counts its chats (each sample a chat). ParamError naming a bad field."""
    from worldserve.api.chat import MAX_CHOICES, chat_choices, check_rendered_prompt, sent_budget
    from worldserve.api.context_fit import check_output_budget
    from worldserve.api.errors import APIError

    try:
        check_output_budget(*sent_budget(body), st.max_model_len)
        if params is None:
            choices, _ = await chat_choices(st, body)
            check_rendered_prompt(body, choices[0], st.max_model_len)
        else:  # (its own tools / template options: the worker builds its prompt)
            if not 1 <= body.n <= MAX_CHOICES:
                raise ParamError("n", f"n must be between 1 and {MAX_CHOICES}, got {body.n}")
            # (n=1 here: whether n > 1 may sample is the ChatParams' temperature's to say, not the defaults')
            read, _ = await chat_choices(st, body.model_copy(update={"n": 1}))
            chosen = dataclasses.replace(params, messages=read[0].messages, prebuilt=None).validate()
            choices = chosen.request_choices(body.n)
    except APIError as exc:
        if exc.status != 400:
            raise RuntimeError(exc.message) from None
        raise ParamError(exc.param or "messages", exc.message) from None
    return [metered(events, st.metrics) for events in st.client.chat_many(choices, coalesce=coalesce)]


async def next_event(events: ChatStream) -> ChatStarted | ChatDelta | None:
    """The chat's next event (None after its last delta); ParamError / RuntimeError for a ChatFailed."""
    try:
        event = await events.__anext__()
    except StopAsyncIteration:
        return None
    if isinstance(event, ChatFailed):
        if event.status == 400:
            raise ParamError(event.param or "messages", event.message)
        raise RuntimeError(f"the chat failed ({event.status}): {event.message}")
    return event


async def chat_answer(st: AppState, body: Any, params: ChatParams | None) -> ChatOutput:
    """On the client's loop: one whole chat (start_chats, then each sample's events to the last) as a
    ChatOutput: its samples in index order, the prompt counted once and their completion tokens summed (the
    route's usage; cached tokens as the first sample, which prefilled the prompt, found them). A cancellation
    (the caller interrupted; a chat of the same batch failed) or a failed sample stops every sample at its
    next step."""
    streams = await start_chats(st, body, params, coalesce=True)
    try:
        # every sample read at once, as the worker makes them (one read after another, the later ones'
        # deltas would wait in their queues while sample 0 is read)
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_run_sample(index, events)) for index, events in enumerate(streams)]
    except BaseExceptionGroup as failed:  # (a failed sample: its own error, the others cancelled)
        raise failed.exceptions[0] from None
    finally:
        for events in streams:  # (those already ended: nothing to stop)
            await events.aclose()
    samples = [task.result() for task in tasks]
    first = samples[0][0]
    usage = ChatUsage(prompt_tokens=first.prompt_tokens, completion_tokens=sum(n for _, _, n in samples),
                      cached_tokens=first.cached_tokens)  # fmt: skip
    return ChatOutput(outputs=tuple(choice for _, choice, _ in samples), usage=usage)


async def _run_sample(index: int, events: ChatStream) -> tuple[ChatStarted, ChatChoice, int]:
    """Sample `index`'s ChatStarted, its ChatChoice (its deltas joined: ChatDelta.joined) and its completion
    tokens."""
    started: ChatStarted | None = None
    deltas: list[ChatDelta] = []
    while (event := await next_event(events)) is not None:
        if isinstance(event, ChatStarted):
            started = event
        else:
            deltas.append(event)
    assert started is not None and deltas, "a chat's events end with a finished delta"
    last = ChatDelta.joined(deltas)
    assert last.finish_reason is not None
    choice = ChatChoice(index=index, text=last.text, finish_reason=last.finish_reason,
                        stop_reason=last.stop_reason, token_ids=last.token_ids)  # fmt: skip
    return started, choice, last.completion_tokens


def conversation_error(index: int, exc: ParamError) -> ParamError:
    """Conversation `index`'s error in a batch, said of it: a field of its messages is `messages[i]...`
    (the message too, where it starts with the field); a sampling field, every conversation's value, keeps
    its name."""
    if not exc.param.startswith("messages"):
        return exc
    name = f"messages[{index}]{exc.param.removeprefix('messages')}"
    message = exc.message
    if message.startswith(f"{exc.param}: "):
        message = name + message[len(exc.param) :]
    return type(exc)(name, message)


async def chat_answers(
    st: AppState, bodies: Sequence[Any], params: ChatParams | None, at_once: int
) -> list[ChatOutput]:
    """chat_answer of each body (at most `at_once` started at a time; the chat worker batches them), in their
    order. The first failure cancels the others (not left to run to their ends before it is raised), as does
    a cancellation of the whole (an interrupt in the caller)."""
    gate = asyncio.Semaphore(at_once)

    async def one(i: int, body: Any) -> ChatOutput:
        async with gate:
            try:
                return await chat_answer(st, body, params)
            except ParamError as exc:  # (found as it started: its media, its prompt's length)
                raise conversation_error(i, exc) from None

    tasks = [asyncio.ensure_future(one(i, body)) for i, body in enumerate(bodies)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()

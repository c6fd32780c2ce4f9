"""POST /v1/responses: the OpenAI Responses API on the Reasoner, as vLLM serves it for chat models.

The request becomes a chat completion request (api/responses_protocol.py) and goes through the chat route's
checks, media, grammar and prompt (api/chat.py `chat_choices`); its one chat's text deltas become the
Responses output items (`ResponseBuilder`, api/responses_output.py): with `--reasoning-parser` a `reasoning`
item (its thoughts as `reasoning_text`), a `message` item (`output_text`, with logprobs when `include` asks for them), and a
`function_call` item per tool call (the chat's hermes / required / named tool parsing). Non-streaming: the
`response` object; `stream: true`: the semantic events (response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta, ..., response.completed
(as vLLM ends every stream: its response's `status` is "incomplete" when `max_output_tokens` cut it, and the
openai client's `responses.stream(...).get_final_response()` needs that event), response.failed when the chat
failed), each with its
`sequence_number`; usage's `output_tokens_details.reasoning_tokens` is the thought tokens' count the chat's
last delta carries (with --reasoning-parser; 0 without). Errors name the Responses field the client sent; the context is checked as vLLM's renderer checks it, in its words
(api/context_fit.py): `max_output_tokens` past the whole context before any other work, a prompt and budget
past it once the prompt is built (`input_tokens`). A response is stored (`store`, OpenAI's
default; in memory, api/responses_store.py) for `previous_response_id` to continue, `item_reference` input
items to name its output items by id, and GET / DELETE /v1/responses/{id} to find. `truncation: "auto"` drops
whole input items from the conversation's start, as OpenAI's does (api/responses_truncation.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from worldserve.api.bodies import fits_context, read_model
from worldserve.api.chat import chat_choices, check_rendered_prompt, model_not_found, request_options
from worldserve.api.chat_stream import ChatStream, TextParsing, close_all, start_all
from worldserve.api.context_fit import check_output_budget
from worldserve.api.disconnect import unless_disconnected
from worldserve.api.errors import APIError
from worldserve.api.reasoning import split_reasoning
from worldserve.api.responses_input import InputItem
from worldserve.api.responses_items import input_items
from worldserve.api.responses_output import ResponseBuilder
from worldserve.api.responses_protocol import ResponsesRequest, to_chat
from worldserve.api.responses_truncation import fit_by_items, prompt_tokens
from worldserve.api.state import AppState, State
from worldserve.api.tokenize import reasoner_prompts
from worldserve.api.tool_stream import final_message
from worldserve.engine.client import ChatDelta, ChatFailed
from worldserve.params import ParamError
from worldserve.sampling.chat_defaults import ChatDefaults

if TYPE_CHECKING:
    from worldserve.api.chat import RequestOptions
    from worldserve.api.chat_protocol import ChatCompletionRequest
    from worldserve.api.responses_input import ChatPaths
    from worldserve.chat_params import ChatParams

router = APIRouter(tags=["responses"])
NOT_KEPT = "(stored responses live in the server's memory: a restart, --responses-store-mb or store=false leave none)"
"""Why a stored response or item may be gone: the tail of their 404s."""


def _resolved(st: AppState, item: InputItem, where: str) -> InputItem:
    """An input item, an item_reference replaced by the stored output item it names."""
    bare = (
        item.type in (None, "message") and item.role is None and item.content is None and item.id is not None
    )
    if item.type != "item_reference" and not bare:  # (the SDK's ItemReference may leave its type out)
        return item
    if item.id is None:
        raise APIError(400, "an item_reference item needs the id of the item it names", param=f"{where}.id")
    found = st.responses.item(item.id) if st.responses is not None else None
    if found is None:
        raise APIError(404, f"Item with id '{item.id}' not found {NOT_KEPT}",
                       param=f"{where}.id")  # fmt: skip
    return InputItem.model_validate(found)


@router.post("/v1/responses")
async def create_response(request: Request, st: State) -> Response:
    """An OpenAI Responses API answer from the Reasoner (JSON body; `stream: true` answers semantic events)."""
    req = await read_model(
        request, ResponsesRequest, st.settings.max_upload_bytes, fits_context("input", st.max_model_len)
    )
    if req.model is not None and not st.serves(req.model):  # (None: not given, the served model)
        return model_not_found(req.model)
    # vLLM's renderer refusal, in its words, before any other work
    check_output_budget(req.max_output_tokens, "max_output_tokens", st.max_model_len)
    history = _history(st, req)
    if not isinstance(req.input, str):
        req.input = [_resolved(st, item, f"input[{i}]") for i, item in enumerate(req.input or ())]
    chat, paths, conversation = to_chat(req, history)
    context = st.max_model_len
    chat, paths = await _truncated(st, req, chat, paths, context)
    store = st.responses if req.store is not False else None
    choices, options = await _checked_choices(st, req, chat, paths, context)
    opened: list[ChatStream] = []  # the chat's events, to cancel if the client goes away at any point
    parsing = TextParsing(tools=options.tools, reasoning=st.settings.reasoning_parser is not None,
                          include_reasoning=req.include_reasoning)  # fmt: skip

    async def answer() -> StreamingResponse | JSONResponse:
        # per-token deliveries only where they matter: streamed, logprobs to place
        coalesce = not (req.stream or req.logprobs)
        skeleton = _skeleton(req, st.served_model_name, store is not None, st.chat_defaults)
        try:
            streams, firsts = await start_all(
                st.client, choices, st.chat_meter(skeleton["id"]), opened=opened, coalesce=coalesce
            )
        except APIError as exc:
            raise paths.rename(exc) from None

        def builder(parsing: TextParsing) -> ResponseBuilder:
            return ResponseBuilder(
                skeleton, parsing, req.logprobs, firsts[0].prompt_tokens, firsts[0].cached_tokens
            )

        if st.settings.request_log is not None:
            st.settings.request_log.chat(
                skeleton["id"], chat.messages, choices[0], 1, firsts[0].prompt_tokens
            )
        inputs = input_items(req.input) if store is not None else []
        keep = (
            (lambda body: store.put(body, conversation, inputs)) if store is not None else (lambda body: None)
        )
        if req.stream:
            return StreamingResponse(
                _events(streams[0], builder(parsing), keep), media_type="text/event-stream"
            )
        body = await _whole_response(streams, parsing, builder, paths)
        keep(body)
        return JSONResponse(body)

    return await unless_disconnected(request, answer(), lambda: close_all(opened))


def _history(st: AppState, req: ResponsesRequest) -> list:
    """The stored conversation `previous_response_id` continues (none without one); a 404 when it is not
    stored."""
    if req.previous_response_id is None:
        return []
    found = st.responses.get(req.previous_response_id) if st.responses is not None else None
    if found is None:
        raise APIError(404, f"Response with id '{req.previous_response_id}' not found {NOT_KEPT}",
                       param="previous_response_id")  # fmt: skip
    return found[0]


async def _truncated(
    st: AppState, req: ResponsesRequest, chat: ChatCompletionRequest, paths: ChatPaths, context: int | None
) -> tuple[ChatCompletionRequest, ChatPaths]:
    """`chat` (and its `paths`) as `truncation` leaves it: with "auto" (unless the chat truncates its prompt
    itself, or no chat is served: `context` None) cut to fit the `context` with the answer's room; errors
    name the Responses field."""
    if req.truncation == "auto" and chat.truncate_prompt_tokens is None and context is not None:
        # OpenAI's: whole input items dropped from the conversation's start (the instructions stay) until the
        # prompt leaves the answer its room
        room = context - (req.max_output_tokens or min(4096, context // 8))
        prompts, _ = reasoner_prompts(st)
        try:
            # (checked once, no grammar compiled: the counts need the tools' and templates' options only)
            options = await asyncio.to_thread(
                partial(
                    request_options,
                    chat,
                    media=st.settings.media_defaults,
                    template_defaults=st.settings.template_defaults,
                )  # fmt: skip
            )
            chat, paths = await asyncio.to_thread(
                fit_by_items, chat, paths, room, partial(prompt_tokens, prompts, options, room=room)
            )
        except (APIError, ParamError) as exc:
            raise paths.rename(exc) from None
    return chat, paths


async def _checked_choices(
    st: AppState, req: ResponsesRequest, chat: ChatCompletionRequest, paths: ChatPaths, context: int | None
) -> tuple[list[ChatParams], RequestOptions]:
    """The chat route's checks, media and prompt for `chat` (api/chat.py `chat_choices`), then vLLM's check of
    the rendered prompt against the `context`; errors name the Responses field."""
    try:
        choices, options = await chat_choices(st, chat)
        try:
            check_rendered_prompt(chat, choices[0], context)
        except APIError as exc:  # (with truncation "auto", what could not be cut is the input's: OpenAI's)
            exc.param = "input" if req.truncation == "auto" else exc.param
            raise
    except (APIError, ParamError) as exc:
        raise paths.rename(exc) from None
    return choices, options


async def _whole_response(
    streams: Sequence[ChatStream],
    parsing: TextParsing,
    builder: Callable[[TextParsing], ResponseBuilder],
    paths: ChatPaths,
) -> dict[str, Any]:
    """The unstreamed answer's response object, once the chat's deltas are all in (a failed chat: its status,
    naming the Responses field); closes the chat's events."""
    deltas: list[ChatDelta] = []
    try:
        async for event in streams[0]:
            if isinstance(event, ChatFailed):
                raise APIError(event.status, event.message, param=paths.field(event.param))
            if isinstance(event, ChatDelta):
                deltas.append(event)
    finally:
        await close_all(streams)
    whole = builder(_as_answered(parsing, deltas))
    for delta in deltas:
        whole.feed(delta)
    return whole.response()


@router.get("/v1/responses/{response_id}")
async def get_response(
    response_id: str, st: State, stream: bool | None = None, starting_after: int | None = None
) -> JSONResponse:
    """A stored response (`store`, kept in memory: api/responses_store.py). vLLM's `stream` / `starting_after`
    replay a background response's events; this server makes none (`background` is a 400), so `stream` is a
    400 rather than a JSON answer an SDK's stream would read as no events."""
    found = st.responses.get(response_id) if st.responses is not None else None
    if found is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    if stream:
        raise APIError(400, "stream replays a background response's events; this server makes no background "
                       "responses: retrieve it without stream", param="stream")  # fmt: skip
    return JSONResponse(found[1])


@router.post("/v1/responses/{response_id}/cancel", response_model=None)
async def cancel_response(response_id: str, st: State) -> NoReturn:
    """vLLM's cancel: only a background response can be cancelled, and this server makes none (`background`
    is a 400), so a stored response answers vLLM's 400 for a synchronous one; an unknown id a 404."""
    if st.responses is None or st.responses.get(response_id) is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    raise APIError(400, "Cannot cancel a synchronous response.", param="response_id")


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, st: State) -> JSONResponse:
    if st.responses is None or not st.responses.delete(response_id):
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _events(events: ChatStream, builder: ResponseBuilder, keep: Callable) -> AsyncIterator[str]:
    """The streamed answer's SSE text (the finished response handed to `keep`); closes the chat's events."""
    try:
        for text in builder.head():
            yield text
        async for event in events:
            if isinstance(event, ChatFailed):
                yield builder.failed(event.status, event.message)
                return
            for text in builder.feed(event):
                yield text
        yield builder.done()
        keep(builder.body)
    finally:
        await events.aclose()


def _as_answered(parsing: TextParsing, deltas: list[ChatDelta]) -> TextParsing:
    """How a finished, unstreamed answer is parsed: its tool calls as the chat route finds them in its whole
    text (tool_stream.final_message). Fed token by token (as it is when logprobs are placed), the stream's
    parser announces a call once its name is out and cannot take it back when the body then fails to parse:
    such an answer is text, with or without logprobs, as its chat completion is."""
    if parsing.tools is None or not deltas:
        return parsing
    text = "".join(d.text for d in deltas)
    content = split_reasoning(text)[1] if parsing.reasoning else text
    _, calls, _ = final_message(content, parsing.tools, deltas[-1].finish_reason)
    return parsing if calls else dataclasses.replace(parsing, tools=None)


def _skeleton(req: ResponsesRequest, model: str, stored: bool, defaults: ChatDefaults) -> dict[str, Any]:
    """The response object's fields fixed at the start (the request's settings echoed, as OpenAI does; those it
    omits as `defaults` (--generation-config) set them)."""
    tools = [{"type": "function", "name": t["name"], "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict")} for t in req.tools or ()]  # fmt: skip
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    text_format: dict[str, Any] = (
        {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)
    )
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "completed_at": None, "model": model,
        "status": "in_progress", "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {}, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None, "store": stored,
        "background": False,
        "temperature": defaults.temperature if req.temperature is None else req.temperature,
        "top_p": defaults.top_p if req.top_p is None else req.top_p, "text": {"format": text_format},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",  # (OpenAI's and vLLM's default)
        "tools": tools, "truncation": req.truncation or "disabled", "user": req.user, "usage": None,
        "top_logprobs": req.top_logprobs,  # (echoed, as OpenAI and vLLM do)
        "service_tier": req.service_tier,
    }  # fmt: skip

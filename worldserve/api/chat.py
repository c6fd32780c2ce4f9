"""POST /v1/chat/completions: the Reasoner's OpenAI chat completions, non-streaming and SSE (serving-api.md §11).

Request -> checks (served model name else 404 NotFoundError; 1 <= n <= 16; the media / template options,
the tools (api/tool_calls.py) and the structured output constraint (api/structured_fields.py: its grammar
compiled with the Reasoner's tokenizer) as the request is read: `request_options`, before any download; media loaded and decoded here, in the API
process, off the event loop) -> `ChatParams` (choice i of n samples with seed + i) -> the prompt built in the
same worker thread (a rendered text with more bytes than the context can hold is a 400 naming `messages`,
before it is tokenized: runner/chat_prompt.py) ->
`EngineClient.chat_many` starts the choices together (the ChatWorker thread runs their one prefill and the
batched decode steps, so the event loop never waits on the model) -> api/chat_stream.py builds the answer.
A client that disconnects before its answer is complete stops its chats at their next step
(api/disconnect.py; a started SSE stream is watched by Starlette itself), and its videos' decoding at the
next frame (media/decode_budget.py, which also bounds that decoding: --max-video-decode-gpixels).
Media (api/chat_media.py): image_url and video_url parts accept base64 `data:` URLs, `file://` paths under
--allowed-local-media-path and http(s) URLs, downloaded at once on the media fetcher's own threads before
the rest is decoded in a worker thread; videos are sampled as Qwen3-VL's processor samples them (2 fps by
default; per request `media_io_kwargs: {"video": {"fps": F}}`, 0 < F <= 1000, or `{"num_frames": N}`,
1 <= N <= 768, or both: the fewer frames; `{"image": {"rgba_background_color": [R, G, B]}}`: api/media_io_options.py); a bad part is a 400 naming it (`messages[i].content[j].image_url`), before any model work.
`mm_processor_kwargs` are
routed as transformers' processor routes them (a flat key to every modality that takes it): `size`
{shortest_edge, longest_edge} (pixel budgets, images and videos), `min_pixels` / `max_pixels` (images),
`fps` / `num_frames` (videos); any other key is a 400 naming it. `chat_template_kwargs` go to the chat
template (a key it does not use changes nothing, as in vLLM); keys that are apply_chat_template's own
arguments are a 400. Both reach the Reasoner on `ChatParams`. The context is checked as vLLM's renderer checks
it, in its words (api/context_fit.py): a completion budget past the whole context before any other work (a 400
naming the field the client sent: `max_completion_tokens` wins over `max_tokens`, as in vLLM), a prompt and
budget past it once the prompt is built (a 400 naming `input_tokens`).
Streaming (api/chat_chunks.py) answers once the first choice has started (the worker admits the others as
decode slots free up; they stream as they start, as vLLM's do): per choice, the first chunk carries the role
(then, with vLLM's `echo`, the continued message), then one chunk per text piece (with tools: content and
`tool_calls` deltas, api/tool_stream.py ToolStream), a final chunk with `delta: {}` and the finish_reason;
then an optional usage chunk (`stream_options.include_usage`) and `data: [DONE]`; with
`continuous_usage_stats` too, every chunk carries the usage so far. Errors before the first byte (the first
choice's refusal included) use the normal envelope; a failure mid-stream (a later choice's too) is sent as
`data: {"error": ...}` followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from worldserve.api.answer_fields import TokenView, prompt_logprob_rows
from worldserve.api.bodies import fits_context, openapi_body, read_model
from worldserve.api.chat_chunks import sse
from worldserve.api.chat_media import ImageBudget, media_parts, part, prefetch_media
from worldserve.api.chat_messages import ContentPart
from worldserve.api.chat_options import MediaDefaults, pixel_budget, processor_kwargs, template_kwargs
from worldserve.api.chat_protocol import UNTRUSTED_TEMPLATE, ChatCompletionRequest, ChatCompletionResponse
from worldserve.api.chat_stream import ChatStream, TextParsing, close_all, collect, start_all
from worldserve.api.context_fit import check_output_budget, check_prompt_fits
from worldserve.api.disconnect import unless_disconnected
from worldserve.api.errors import APIError, error_body, shown_name
from worldserve.api.media_io_options import image_background, video_sampling
from worldserve.api.state import AppState, State, app_state
from worldserve.api.structured_fields import grammar_compiler, structured_output
from worldserve.api.tool_calls import ToolMode, message_calls, tool_constraint, tool_mode
from worldserve.chat_params import ChatMessage, ChatParams, ChatPart, StructuredOutput, VideoSampling
from worldserve.media.decode_budget import DecodeBudget
from worldserve.media.work_pool import map_in_order, on_request_pool
from worldserve.param_errors import InvalidRequest
from worldserve.sampling.chat_defaults import NEUTRAL, ChatDefaults

if TYPE_CHECKING:
    pass

router = APIRouter(tags=["chat"])


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOptions:
    """A request's media and template options, checked (`request_options`) before any media is fetched."""

    image_pixels: tuple[int | None, int | None]
    """(min, max) image pixel budget; None: the server's."""
    video: VideoSampling
    image_background: tuple[int, int, int]
    """What an image's transparent pixels show (`media_io_kwargs.image.rgba_background_color`)."""
    chat_template_kwargs: dict
    tools: ToolMode | None
    """The request's tools and tool choice (api/tool_calls.py); None: no tools."""
    structured: StructuredOutput | None
    """The output constraint (a structured output's or a required / named tool choice's), its grammar
    compiled once (api/structured_fields.py)."""


def request_options(
    body: ChatCompletionRequest, compiler: Any = None, media: MediaDefaults = MediaDefaults(),
    thinks: bool = False, template_defaults: Mapping[str, Any] | None = None,
) -> RequestOptions:  # fmt: skip
    """`mm_processor_kwargs`, `media_io_kwargs` (over the server's `media` defaults), `chat_template_kwargs`, the
    tools and the structured output fields checked (no media work; a grammar compiles, with the Reasoner's
    `compiler` when given; `thinks`: the answer may open with <think>, --reasoning-parser): ParamError naming
    the field, as soon as the request is read. `template_defaults` (--default-chat-template-kwargs): what the
    request's chat_template_kwargs lay over, key by key, as vLLM merges them."""
    media_io, mm = media.under(body.media_io_kwargs, body.mm_processor_kwargs)
    image_opts, video_opts = processor_kwargs(mm)
    tools = tool_mode(body.tools, body.tool_choice, body.parallel_tool_calls)
    return RequestOptions(
        image_pixels=pixel_budget(image_opts, "images"),
        video=video_sampling(media_io, video_opts),
        image_background=image_background(media_io),
        chat_template_kwargs=template_kwargs(
            {**(template_defaults or {}), **(body.chat_template_kwargs or {})}
        ),
        tools=tools,
        structured=structured_output(body, tool_constraint(tools), compiler, thinks),
    )


def build_params(
    body: ChatCompletionRequest, allowed_local_path: str | None, fetched: Mapping[str, bytes] | None = None,
    options: RequestOptions | None = None, media_cache: Any = None, image_budget: ImageBudget | None = None,
    defaults: ChatDefaults = NEUTRAL, video_budget: DecodeBudget | None = None,
) -> ChatParams:  # fmt: skip
    """The request as ChatParams, media loaded (http(s) URLs from `fetched`: prefetch_media, which also
    checks the media counts) and decoded (blocking: call it off the event loop; media found in the
    Reasoner's `media_cache` is not decoded again; images counted against `image_budget`, by default its
    pixels alone, before they are decoded; videos' decode work against `video_budget`, by default
    --max-video-decode-gpixels's, whose stop signal ends the media work: DecodeCancelled); `options`: its
    request_options, when already checked; `defaults`: what the fields it omits take (--generation-config)."""
    options = options or request_options(body)
    image_budget = image_budget or ImageBudget()
    video_budget = video_budget or DecodeBudget()
    sampling = body.sampling_options(defaults)
    if options.tools is not None and options.tools.choice == "auto":  # vLLM's hermes parser: the call tags
        sampling["skip_special_tokens"] = False  # stay in the text even where a tokenizer marks them special
    roles = ["system" if msg.role == "developer" else msg.role for msg in body.messages]
    calls = _tool_call_fields(body, roles)
    parts = {(i, j): p for i, msg in enumerate(body.messages) if isinstance(msg.content, list)
             for j, p in enumerate(msg.content)}  # fmt: skip

    def load(at: tuple[int, int]) -> ChatPart:
        video_budget.check_stop()  # (an abandoned request decodes no more parts)
        where = f"messages[{at[0]}].content[{at[1]}]"
        return part(parts[at], where, allowed_local_path, options.video, fetched, media_cache, image_budget,
                    options.image_background, video_budget)  # fmt: skip

    loaded = _load_media(parts, load, video_budget)
    messages = _chat_messages(body, roles, calls, loaded, load)
    return _chat_params(body, messages, sampling, options, defaults)


def _tool_call_fields(body: ChatCompletionRequest, roles: list[str]) -> list[dict[str, Any]]:
    """Each message's checked tool-call fields, in message order (no media work yet): ChatMessage keywords."""
    calls: list[dict[str, Any]] = []
    for i, (msg, role) in enumerate(zip(body.messages, roles, strict=True)):
        calls.append({
            "tool_calls": message_calls(msg.tool_calls, f"messages[{i}]"),
            "tool_call_id": msg.tool_call_id,
            # vLLM passes earlier thoughts on for assistant turns only
            "reasoning": msg.reasoning if role == "assistant" else None,
        })  # fmt: skip
    return calls


def _load_media(
    parts: Mapping[tuple[int, int], ContentPart], load: Callable[[tuple[int, int]], ChatPart],
    video_budget: DecodeBudget,
) -> dict[tuple[int, int], ChatPart]:  # fmt: skip
    """The image / video parts of `parts` ((message, part) -> content part) loaded with `load`, all at once;
    the first to fail stops the others' decoding (`video_budget`) and fails the request."""
    media = [at for at, p in parts.items() if p.type != "text"]  # decoded at once (media/work_pool.py)
    try:
        return dict(zip(media, map_in_order(load, media), strict=True))
    except BaseException:  # the request is answered (a bad part): its other videos stop decoding
        video_budget.stop.set()
        raise


def _chat_messages(
    body: ChatCompletionRequest, roles: list[str], calls: list[dict[str, Any]],
    loaded: Mapping[tuple[int, int], ChatPart], load: Callable[[tuple[int, int]], ChatPart],
) -> tuple[ChatMessage, ...]:  # fmt: skip
    """The request's messages as ChatMessages: their `roles`, tool-call fields (`calls`) and content, media
    parts from `loaded`, text parts loaded (checked) here with `load`."""
    messages = []
    for i, (msg, role) in enumerate(zip(body.messages, roles, strict=True)):
        if msg.content is None or isinstance(msg.content, str):
            messages.append(ChatMessage(role=role, content=msg.content or "", **calls[i]))
        else:
            content = tuple(
                loaded[i, j] if (i, j) in loaded else load((i, j)) for j in range(len(msg.content))
            )
            messages.append(ChatMessage(role=role, content=content, **calls[i]))
    return tuple(messages)


def _chat_params(
    body: ChatCompletionRequest, messages: tuple[ChatMessage, ...], sampling: dict[str, Any],
    options: RequestOptions, defaults: ChatDefaults,
) -> ChatParams:  # fmt: skip
    """The validated ChatParams of the request's `messages`, `sampling` options and checked `options`."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return ChatParams(
        messages=messages,
        max_tokens=max_tokens,
        max_tokens_bound=defaults.budget(max_tokens),
        **sampling,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
        prompt_logprobs=body.prompt_logprobs_wanted(body.prompt_logprobs),
        chat_template_kwargs=options.chat_template_kwargs,
        image_min_pixels=options.image_pixels[0],
        image_max_pixels=options.image_pixels[1],
        structured=options.structured,
        tools=options.tools.tools if options.tools is not None else (),
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    ).validate()


def prepared_params(
    st: AppState, body: ChatCompletionRequest, fetched: Mapping[str, bytes], options: RequestOptions,
    stop: threading.Event | None = None,
) -> ChatParams:  # fmt: skip
    """build_params, then the Reasoner's prompt built from them (template, tokens, media) and the bad_words'
    tokens here, in the API's worker thread, not on the chat worker's, which every running chat shares
    (blocking). A text too long for the context by its byte count alone is refused before it is tokenized
    (ParamError("messages")). Its videos may take --max-video-decode-gpixels of decoding; `stop` set (the
    request abandoned) ends their decoding at the next frame (DecodeCancelled)."""
    worker = st.client.chat_worker
    prompts = worker.backend.prompts if worker is not None else None
    cache = prompts.media_cache if prompts is not None else None
    budget = None
    # (the images' share of the context)
    if worker is not None and prompts is not None and prompts.preprocess is not None:
        lo, hi = options.image_pixels
        tokens = partial(prompts.preprocess.tokens, min_pixels=lo, max_pixels=hi)
        budget = ImageBudget(worker.backend.max_model_len, tokens)
    videos = DecodeBudget(st.settings.video_decode_pixels, stop)
    params = build_params(
        body, st.settings.allowed_local_media_path, fetched, options, cache, budget, st.chat_defaults, videos
    )
    params = st.seeded(params)
    if st.settings.reasoning_parser is not None:  # stop strings (and a grammar) start after the thoughts
        params = dataclasses.replace(
            params, stops_after_thoughts=True, think_first=params.structured is not None
        )
    if worker is None or prompts is None:  # (no worker: no prompts)
        return params
    prebuilt = prompts.build(params, max_tokens=body.text_bound(worker.backend.max_model_len))
    return dataclasses.replace(params, prebuilt=prebuilt, bad_word_ids=prompts.bad_word_ids(params.bad_words))


def name_sent_field(body: ChatCompletionRequest, exc: APIError) -> None:
    """Make `exc` name the field the client sent: the Reasoner names the completion budget `max_tokens`,
    which a request may have given as `max_completion_tokens` (that one wins when both are given)."""
    if exc.param == "max_tokens" and body.max_completion_tokens is not None:
        exc.param = "max_completion_tokens"


def sent_budget(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """(the completion budget, the field it came in): max_completion_tokens wins over max_tokens (vLLM's)."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def check_rendered_prompt(body: ChatCompletionRequest, params: ChatParams, max_model_len: int | None) -> None:
    """vLLM's refusal of a prompt and budget past the context (api/context_fit.py), once the prompt is built
    (`params.prebuilt`: none without a Reasoner). With truncate_prompt_tokens the Reasoner cuts the prompt
    first and checks the cut (runner/chat_prompt.py), as vLLM truncates before its check."""
    if params.prebuilt is None or body.truncate_prompt_tokens is not None:
        return
    check_prompt_fits(len(params.prebuilt.input_ids), sent_budget(body)[0], max_model_len)


def model_not_found(model: str) -> JSONResponse:
    return JSONResponse(
        error_body(404, f"The model `{shown_name(model)}` does not exist.", "model", vllm=True),
        status_code=404,
    )


BODY = openapi_body(ChatCompletionRequest)


async def _read_body(request: Request) -> ChatCompletionRequest:
    """The JSON body, validated (400 envelope with `param` on any problem; other content types refused)."""
    st = app_state(request)
    context = fits_context("messages", st.max_model_len)
    return await read_model(request, ChatCompletionRequest, st.settings.max_upload_bytes, context)


MAX_CHOICES = 16
"""Largest `n` (choices per request); they decode batched together."""


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, openapi_extra=BODY)
async def create_chat_completion(
    request: Request, st: State
) -> ChatCompletionResponse | StreamingResponse | JSONResponse:
    """OpenAI chat completion from the Reasoner (JSON body; `stream: true` answers server-sent events)."""
    body = await _read_body(request)
    if body.model is not None and not st.serves(body.model):  # (None: not given, the served model)
        return model_not_found(body.model)
    opened: list[
        ChatStream
    ] = []  # the request's chat streams, to cancel if the client goes away at any point

    async def work() -> (
        ChatCompletionResponse | StreamingResponse
    ):  # (watched from the start: a client leaving during its media's downloads stops them)
        check_output_budget(*sent_budget(body), st.max_model_len)
        choices, options = await chat_choices(st, body)
        check_rendered_prompt(body, choices[0], st.max_model_len)
        answer_id = body.answer_id("chatcmpl", request.headers.get("x-request-id"))
        return await _answer(st, body, choices, opened, options.tools, answer_id)

    return await unless_disconnected(request, work(), lambda: close_all(opened))


async def chat_choices(st: AppState, body: ChatCompletionRequest) -> tuple[list[ChatParams], RequestOptions]:
    """The request's checks, its grammar compiled, its media fetched and decoded, its prompt built: the
    ChatParams of its `n` choices and its options (APIError / ParamError naming the field). The Responses
    API (api/responses.py) answers through the same."""
    if not 1 <= body.n <= MAX_CHOICES:
        raise APIError(400, f"n must be between 1 and {MAX_CHOICES}, got {body.n}", param="n")
    if (refused := body.refused_streaming(body.prompt_logprobs)) is not None:
        raise InvalidRequest(*refused)
    if (refused := body.refused_sampling()) is not None:
        raise APIError(400, refused[1], param=refused[0])
    if body.chat_template is not None:
        raise APIError(400, UNTRUSTED_TEMPLATE, param="chat_template")
    if (field := body.unsupported()) is not None:
        raise APIError(400, f"{field} is not supported (the legacy form of tool calling): send tools and "
                       "tool_choice", param=field)  # fmt: skip
    compiler = grammar_compiler(st.client.chat_worker)
    # a grammar compiles there: off the event loop
    thinks = st.settings.reasoning_parser is not None
    options = await asyncio.to_thread(
        request_options, body, compiler, st.settings.media_defaults, thinks, st.settings.template_defaults
    )
    fetched = await prefetch_media(body, st.media, st.settings.mm_limits)
    if next(media_parts(body), None) is None:
        params = await asyncio.to_thread(prepared_params, st, body, fetched, options)
    else:  # off the default pool (work_pool.py); the client leaving stops the decoding (`stop`)
        stop = threading.Event()
        params = await on_request_pool(prepared_params, st, body, fetched, options, stop, stop=stop)
    return params.request_choices(body.n), options


async def _answer(
    st: AppState,
    body: ChatCompletionRequest,
    choices: list[ChatParams],
    opened: list[ChatStream],
    tools: ToolMode | None,
    request_id: str,
) -> ChatCompletionResponse | StreamingResponse:
    """Start the choices together (`opened` gets their event streams), wait for the first event of each
    (the whole completion) or of the first one alone (SSE: the worker admits the choices as decode slots
    free up, and a choice still queued must not hold back the others' chunks, as in vLLM), then answer (its
    id `request_id`). A failure of a choice waited for is the request's error (a 4xx / 5xx envelope);
    a later choice's, in a stream, is its error event."""
    role = (
        st.settings.response_role if body.add_generation_prompt else body.messages[-1].role
    )  # (vLLM's rule)
    parsing = TextParsing(tools=tools, reasoning=st.settings.reasoning_parser is not None,
                          include_reasoning=body.include_reasoning, echo=body.echo_text(role), role=role)  # fmt: skip
    # a non-streaming answer needs no per-token deliveries: the first (time to first token), the rest
    # merged at the end, which spares the event loop a wake-up per chat and token
    try:
        streams, firsts = await start_all(
            st.client, choices, st.chat_meter(request_id), coalesce=not body.stream, opened=opened,
            first_only=body.stream,
        )  # fmt: skip
    except APIError as exc:
        name_sent_field(body, exc)
        raise
    first = firsts[-1]  # (the choices share the prompt: any one's counts)
    created, model = int(time.time()), st.served_model_name
    cached = (
        firsts[0].cached_tokens if st.settings.prompt_tokens_details else None
    )  # (the choices' leader looked it up)
    if st.settings.request_log is not None:
        st.settings.request_log.chat(request_id, body.messages, choices[0], len(choices), first.prompt_tokens)
    view = TokenView.of(body, st.settings.tokens_as_ids)
    if body.stream:
        include_usage, continuous_usage = body.stream_usage(st.settings.force_include_usage)
        stream = sse(streams, request_id, created, model, first.prompt_tokens, include_usage, continuous_usage,
                     parsing, cached, view, first.prompt_token_ids)  # fmt: skip
        return StreamingResponse(stream, media_type="text/event-stream")
    answer = await collect(
        streams, request_id, created, model, first.prompt_tokens, choices[0].logprobs, parsing, cached, view
    )
    answer.prompt_logprobs = prompt_logprob_rows(first.prompt_logprobs, body.prompt_logprobs)
    if view.ids:
        answer.prompt_token_ids = list(first.prompt_token_ids or ())
    return answer

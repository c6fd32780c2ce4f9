"""POST /v1/chat/completions: the Reasoner's OpenAI chat completions, non-streaming and SSE (serving-api.md §11).

Request -> checks (served model name else 404 NotFoundError; 1 <= n <= 16; media loaded and decoded here, in
the API process, off the event loop) -> `ChatParams` (choice i of n samples with seed + i) ->
`EngineClient.chat_many` starts the choices together (the ChatWorker thread runs their one prefill and the
batched decode steps, so the event loop never waits on the model) -> api/chat_stream.py builds the answer.
A client that disconnects before its answer is complete stops its chats at their next step
(api/disconnect.py; a started SSE stream is watched by Starlette itself).
Media: image_url and video_url parts accept base64 `data:` URLs and `file://` paths under
--allowed-local-media-path. http(s) URLs are refused with a 400: this server does not fetch remote media (it
may run with no network); send the bytes inline as a data URL. Videos are decoded with PyAV and sampled as
Qwen3-VL's processor samples them (2 fps by default; per request `media_io_kwargs: {"video": {"fps": F}}` or
`{"num_frames": N}`), each kept frame resized as it is decoded. Media decoding runs in a worker thread.
Streaming: per choice, the first chunk carries the role, then one chunk per text piece, a final chunk with
`delta: {}` and the finish_reason; then an optional usage chunk (`stream_options.include_usage`) and
`data: [DONE]`; with `continuous_usage_stats` too, every chunk carries the usage so far. Errors before the
first byte use the normal envelope; a failure mid-stream is sent as `data: {"error": ...}` followed by
`data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from pathlib import Path
from typing import Annotated
from urllib.parse import unquote, urlparse

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from worldserve.api.bodies import read_json_object
from worldserve.api.chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ContentPart,
)  # fmt: skip
from worldserve.api.chat_stream import close_all, collect, metered, sse
from worldserve.api.data_urls import data_url_bytes
from worldserve.api.disconnect import unless_disconnected
from worldserve.api.errors import APIError, error_body
from worldserve.api.state import AppState, app_state
from worldserve.engine.client import (
    ChatFailed,
    ChatStarted,
    ChatUnavailableError,
    ShuttingDownError,
)
from worldserve.media.image import decode_image
from worldserve.media.video_input import decode_chat_video
from worldserve.params import ChatMessage, ChatParams, ChatPart, ParamError, VideoSampling

router = APIRouter(tags=["chat"])
State = Annotated[AppState, Depends(app_state)]
REMOTE_REFUSED = (
    "worldserve does not fetch remote media (http/https URLs): send it inline as a base64 data URL "
    "(data:image/png;base64,... or data:video/mp4;base64,...) or as file:///path under --allowed-local-media-path."
)


def load_media_url(url: str, allowed_local_path: str | None, kind: str = "image") -> bytes:
    """The bytes behind an image / video URL (data: or file://); raises ParamError("messages", ...)."""
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        return data_url_bytes(
            url, param="messages", bad_payload=f"Invalid base64 data in the {kind} data URL."
        )
    if scheme == "file":
        if not allowed_local_path:
            raise ParamError("messages", "Cannot load local files without `--allowed-local-media-path`.")
        path = Path(unquote(urlparse(url).path)).resolve()
        root = Path(allowed_local_path).resolve()
        if not path.is_relative_to(root):
            raise ParamError(
                "messages",
                f"The file path {path} must be a subpath of `--allowed-local-media-path {root}`.",
            )
        try:
            return path.read_bytes()
        except OSError as exc:
            raise ParamError("messages", f"Cannot read {path}: {exc.strerror}") from None
    if scheme in ("http", "https"):
        raise ParamError("messages", REMOTE_REFUSED)
    raise ParamError("messages", f"Unsupported {kind} URL scheme {scheme!r}: use a base64 data URL")


def _url(ref, kind: str) -> str:
    url = ref if isinstance(ref, str) else ref.url if ref is not None else ""
    if not url:
        raise ParamError("messages", f"a {kind}_url part needs {kind}_url.url")
    return url


def video_sampling(media_io_kwargs: dict | None) -> VideoSampling:
    """`media_io_kwargs.video` ({"fps": F} or {"num_frames": N}) over Qwen3-VL's defaults (2 fps)."""
    video = (media_io_kwargs or {}).get("video") or {}
    if not isinstance(video, dict) or set(video) - {"fps", "num_frames"}:
        raise ParamError("media_io_kwargs", 'media_io_kwargs.video takes {"fps": F} or {"num_frames": N}')
    fps, num = video.get("fps"), video.get("num_frames")
    if num == -1:  # vLLM's "decode every frame, let the processor sample": the default here
        num = None
    if (fps is not None and not isinstance(fps, int | float)) or (num is not None and type(num) is not int):
        raise ParamError(
            "media_io_kwargs", "media_io_kwargs.video fps must be a number, num_frames an integer"
        )
    if num is not None:
        return VideoSampling(fps=None if fps is None else float(fps), num_frames=num).validate()
    return VideoSampling(fps=2.0 if fps is None else float(fps)).validate()


def _part(part: ContentPart, allowed_local_path: str | None, sampling: VideoSampling) -> ChatPart:
    if part.type == "text":
        return ChatPart(type="text", text=part.text or "")
    if part.type == "image_url":
        data = load_media_url(_url(part.image_url, "image"), allowed_local_path)
        return ChatPart(type="image", image=decode_image(data, param="messages"))
    if part.type == "video_url":
        data = load_media_url(_url(part.video_url, "video"), allowed_local_path, kind="video")
        return ChatPart(type="video", video=decode_chat_video(data, sampling))
    raise ParamError("messages", f"content parts of type {part.type!r} are not supported")


def build_params(body: ChatCompletionRequest, allowed_local_path: str | None) -> ChatParams:
    """The request as ChatParams, media loaded and decoded (blocking: call it off the event loop)."""
    sampling = video_sampling(body.media_io_kwargs)
    messages = []
    for msg in body.messages:
        role = "system" if msg.role == "developer" else msg.role
        if msg.content is None or isinstance(msg.content, str):
            messages.append(ChatMessage(role=role, content=msg.content or ""))
        else:
            parts = tuple(_part(p, allowed_local_path, sampling) for p in msg.content)
            messages.append(ChatMessage(role=role, content=parts))
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return ChatParams(
        messages=tuple(messages),
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        seed=body.seed,
        stop=stop,
        presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
        frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
    ).validate()


def _not_found(model: str) -> JSONResponse:
    body = error_body(404, f"The model `{model}` does not exist.", "model")
    body["error"]["type"] = "NotFoundError"
    return JSONResponse(body, status_code=404)


def _inline_refs(node, defs):
    """A JSON schema with every local `$ref` replaced by its definition (OpenAPI gets no dangling refs)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


_SCHEMA = ChatCompletionRequest.model_json_schema()
BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": _inline_refs(_SCHEMA, _SCHEMA.get("$defs", {}))},
}}}  # fmt: skip


async def _read_body(request: Request) -> ChatCompletionRequest:
    """The JSON body, validated (400 envelope with `param` on any problem; other content types refused)."""
    max_bytes = app_state(request).max_upload_bytes
    return ChatCompletionRequest.model_validate(await read_json_object(request, max_bytes))


MAX_CHOICES = 16
"""Largest `n` (choices per request); they decode batched together."""


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, openapi_extra=BODY)
async def create_chat_completion(request: Request, st: State):
    """OpenAI chat completion from the Reasoner (JSON body; `stream: true` answers server-sent events)."""
    body = await _read_body(request)
    if body.model is not None and body.model != st.served_model_name:
        return _not_found(body.model)
    if not 1 <= body.n <= MAX_CHOICES:
        raise APIError(400, f"n must be between 1 and {MAX_CHOICES}, got {body.n}", param="n")
    if body.misplaced_stream_options():
        raise APIError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    if (field := body.unsupported()) is not None:
        what = "tool calling" if field == "tools" else "constrained decoding (structured outputs)"
        raise APIError(
            400, f"{field} is not supported by this server yet: {what} is not implemented", param=field
        )
    params = await asyncio.to_thread(build_params, body, st.allowed_local_media_path)
    # choice i samples with seed + i: different samples, the same ones on every run
    choices = [params] + [
        dataclasses.replace(params, seed=None if params.seed is None else params.seed + i)
        for i in range(1, body.n)
    ]
    opened: list = []  # the request's ChatEvents, to cancel if the client goes away at any point
    return await unless_disconnected(request, _answer(st, body, choices, opened), lambda: close_all(opened))


async def _answer(st: AppState, body: ChatCompletionRequest, choices: list, opened: list):
    """Start the choices together (`opened` gets their event streams), wait for each one's first event,
    then answer: SSE, or the whole completion."""
    streams: list = []
    try:
        opened += st.client.chat_many(choices, coalesce=not body.stream)
        # a non-streaming answer needs no per-token deliveries: the first (time to first token), the rest
        # merged at the end, which spares the event loop a wake-up per chat and token
        streams = [metered(events, st.metrics) for events in opened]
        for events in streams:  # admitted and prefilled together: their prompt K/V is shared
            first = await anext(events)
            if isinstance(first, ChatFailed):
                raise APIError(first.status, first.message, param=first.param)
            assert isinstance(first, ChatStarted)
    except BaseException as exc:  # stop whatever started: a failed choice, a refusal, a cancellation
        await close_all([*streams, *opened])
        if isinstance(exc, ChatUnavailableError):
            raise APIError(400, str(exc)) from None
        if isinstance(exc, ShuttingDownError):
            raise APIError(503, str(exc)) from None
        raise
    request_id, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), st.served_model_name
    if body.stream:
        include_usage, continuous_usage = body.stream_usage()
        stream = sse(
            streams, request_id, created, model, first.prompt_tokens, include_usage, continuous_usage
        )
        return StreamingResponse(stream, media_type="text/event-stream")
    return await collect(streams, request_id, created, model, first.prompt_tokens, choices[0].logprobs)

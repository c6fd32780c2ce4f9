"""POST /v1/chat/completions: the Reasoner's OpenAI chat completions, non-streaming and SSE (serving-api.md §11).

Request -> checks (served model name else 404 NotFoundError; n == 1; media loaded and decoded here, in the
API process, with Pillow) -> `ChatParams` -> `EngineClient.chat` (the ChatWorker thread runs prefill and
decode steps under the engine's model lock, so the event loop never waits on the model).
Media: image_url and video_url parts accept base64 `data:` URLs and `file://` paths under
--allowed-local-media-path. http(s) URLs are refused with a 400: this server does not fetch remote media (it
may run with no network); send the bytes inline as a data URL. Videos are decoded with PyAV and sampled as
Qwen3-VL's processor samples them (2 fps by default; per request `media_io_kwargs: {"video": {"fps": F}}` or
`{"num_frames": N}`), each kept frame resized as it is decoded. Media decoding runs in a worker thread.
Streaming: the first chunk carries the role, then one chunk per text piece, a final chunk with `delta: {}`
and the finish_reason, an optional usage chunk (`stream_options.include_usage`), then `data: [DONE]`.
Errors before the first byte use the normal envelope; a failure mid-stream is sent as `data: {"error": ...}`
followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated
from urllib.parse import unquote, urlparse

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from worldserve.api.chat_protocol import (
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    ContentPart,
    TokenLogprobOut,
    TopLogprob,
    Usage,
)  # fmt: skip
from worldserve.api.errors import APIError, error_body
from worldserve.api.state import AppState, app_state
from worldserve.engine.client import (
    ChatDelta,
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
        header, sep, payload = url[5:].partition(",")
        if not sep or not header.endswith(";base64"):
            raise ParamError("messages", "Only base64 data URLs are supported for now.")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ParamError("messages", f"Invalid base64 data in the {kind} data URL.") from None
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


def _logprobs(entries) -> list[TokenLogprobOut]:
    """engine TokenLogprobs -> the OpenAI `logprobs.content` items (with each token's UTF-8 bytes)."""
    return [
        TokenLogprobOut(
            token=e.token, logprob=e.logprob, bytes=list(e.token.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in e.top],
        )
        for e in entries
    ]  # fmt: skip


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
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(400, f"Unsupported content type {ctype or 'none'!r}: send application/json")
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object")
    return ChatCompletionRequest.model_validate(data)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, openapi_extra=BODY)
async def create_chat_completion(request: Request, st: State):
    """OpenAI chat completion from the Reasoner (JSON body; `stream: true` answers server-sent events)."""
    body = await _read_body(request)
    if body.model is not None and body.model != st.served_model_name:
        return _not_found(body.model)
    if body.n != 1:
        raise APIError(400, f"n must be 1 (got {body.n}): this server returns a single choice", param="n")
    if (field := body.unsupported()) is not None:
        raise APIError(400, f"{field} is not supported by this server yet", param=field)
    params = await asyncio.to_thread(build_params, body, st.allowed_local_media_path)
    try:
        events = _metered(st.client.chat(params), st.metrics)
        first = await anext(events)
    except ChatUnavailableError as exc:
        raise APIError(400, str(exc)) from None
    except ShuttingDownError as exc:
        raise APIError(503, str(exc)) from None
    if isinstance(first, ChatFailed):
        raise APIError(first.status, first.message, param=first.param)
    assert isinstance(first, ChatStarted)
    request_id, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), st.served_model_name
    if body.stream:
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        stream = _sse(events, request_id, created, model, first.prompt_tokens, include_usage)
        return StreamingResponse(stream, media_type="text/event-stream")
    text, last, logprobs = [], None, []
    try:
        async for event in events:
            if isinstance(event, ChatFailed):
                raise APIError(event.status, event.message, param=event.param)
            text.append(event.text)
            logprobs += _logprobs(event.logprobs)
            last = event
    finally:  # also on cancellation (client gone): stop the chat at its next step
        await events.aclose()
    assert isinstance(last, ChatDelta)
    usage = Usage(
        prompt_tokens=first.prompt_tokens, completion_tokens=last.completion_tokens,
        total_tokens=first.prompt_tokens + last.completion_tokens,
    )  # fmt: skip
    choice = Choice(
        message=AssistantMessage(content="".join(text)), finish_reason=last.finish_reason,
        logprobs=ChoiceLogprobs(content=logprobs) if params.logprobs else None,
    )  # fmt: skip
    return ChatCompletionResponse(id=request_id, created=created, model=model, choices=[choice], usage=usage)


async def _metered(events: AsyncIterator, metrics) -> AsyncIterator:
    """Pass the chat's events through, counting tokens, time to first token and how the chat ended."""
    t0, started, completion, finish, first_token = time.perf_counter(), False, 0, None, True
    try:
        async for event in events:
            if isinstance(event, ChatStarted):
                started = True
                metrics.on_chat_started(event.prompt_tokens)
            elif isinstance(event, ChatDelta):
                if first_token:
                    metrics.on_chat_first_token(time.perf_counter() - t0)
                    first_token = False
                completion, finish = event.completion_tokens, event.finish_reason
            yield event
    finally:
        await events.aclose()
        if started:
            metrics.on_chat_ended(completion, finish)


async def _sse(
    events: AsyncIterator, request_id: str, created: int, model: str, prompt_tokens: int, include_usage: bool
) -> AsyncIterator[str]:
    def chunk(delta: dict[str, str], finish: str | None = None, logprobs=()) -> str:
        lp = ChoiceLogprobs(content=_logprobs(logprobs)) if logprobs else None
        choice = ChunkChoice(delta=delta, finish_reason=finish, logprobs=lp)
        return ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice]).sse()

    completion = 0
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in events:
            if isinstance(event, ChatFailed):
                yield f"data: {json.dumps(error_body(event.status, event.message, event.param))}\n\n"
                yield "data: [DONE]\n\n"
                return
            completion = event.completion_tokens
            if event.text or event.logprobs:
                yield chunk({"content": event.text}, logprobs=event.logprobs)
            if event.finish_reason is not None:
                yield chunk({}, event.finish_reason)
        if include_usage:
            usage = Usage(
                prompt_tokens=prompt_tokens, completion_tokens=completion,
                total_tokens=prompt_tokens + completion,
            )  # fmt: skip
            yield ChatCompletionChunk(
                id=request_id, created=created, model=model, choices=[], usage=usage
            ).sse()
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()

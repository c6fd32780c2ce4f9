"""WebSocket /v1/realtime/video: one video sent as a fragmented MP4 ("m4s") while it is decoded (vLLM-Omni's
streaming video output, serving-api.md §7.5). Here the session once started: its request queued, its parts
streamed beside the client's control messages, its end; its start is api/realtime_start.py's.

The protocol is vLLM-Omni's:
- client -> server: first `{"type": "session.start", "format": "m4s", ...}` within START_TIMEOUT_S, at most
  `--max-upload-mb` (as the JSON body of `POST /v1/videos`, inline references included), holding that body's
  fields (`sampling_params`' keys fill the request fields not given, the rest go to `extra_params`): read and
  checked in api/realtime_start.py; then `session.stop` (abort: `session.done` with `stopped` true) and
  `session.ping` (`session.pong`) at any time.
- server -> client: `video.start {request_id, format, config}` (config: the request as its video is made,
  defaults and overrides resolved: realtime_start.py `stream_config`; with `extra_params.upsample_prompt`,
  also `upsampled_prompt`, the prompt the Reasoner wrote first), then for
  each part a `video.chunk_metadata` JSON message followed by its bytes as one binary message, then
  `session.done {request_id, chunks, stopped}`; `{"type": "error", "message", "code"}` for anything wrong.
  A bad session.start gets an error (code: the HTTP status `POST /v1/videos` would answer, `param` the
  field; a full queue's 429 also `retry_after_s`) and the socket is closed; a bad control message gets an
  error and the session goes on.

Cosmos3 makes a video in one pass, so the parts come after the denoising, as the VAE decodes (frame 0, then
8 frames per part, the decoder's 2 latent frames a chunk; the bytes of a part go out when the next part's
keyframe has been encoded, so each part is whole fragments): the first part is the init segment (a part of its
own, `num_frames` 0, sent just before frame 0's; the file's closing mfra box ends the last part), the joined parts are one MP4 with the AAC track as well (media/fragments.py `encode_fragments`: no B-frames, so `video_codec_options.bf` above 0 is refused;
H.264 `tune zerolatency` unless `video_codec_options` names a tune, whose x264 lookahead then holds parts
back, at slow presets to the end). `session.interaction` (vLLM-Omni's prompt changes inside a streaming
generation) gets an error: there is nothing to change mid-pass. A session whose request is running but has
made no progress (a step or a part) for STALL_TIMEOUT_S gets vLLM-Omni's stall error, then `session.done`
with `stopped` true, and is aborted; a request still waiting in the queue (or for its upsampled prompt) is
not stalled. The client leaving, or reading nothing for SEND_TIMEOUT_S while a part waits, aborts the
request at its next step (or decode chunk) and stops its encode. At a graceful shutdown the socket stays open
(api/ws_protocol.py): a running request streams on within `--shutdown-timeout`; a session not yet started,
or whose request was still queued or is aborted at the deadline, gets the 503 error and a 1012 close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Coroutine
from functools import partial
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from worldserve.api.bodies import parse_json
from worldserve.api.errors import APIError
from worldserve.api.realtime_start import StreamStart, read_start
from worldserve.api.state import AppState
from worldserve.api.ws_protocol import ABORT_AFTER_S, abort_connection
from worldserve.engine.client import (
    SHUTDOWN_REASON,
    EncodeOptions,
    HeldFinish,
    QueueFullError,
    Request,
    ShuttingDownError,
    UpsamplingFailed,
    VideoResult,
    error_for,
)
from worldserve.media.fragments import encode_fragments
from worldserve.media.frame_stream import FramesCancelled, FramesLost, FrameStream
from worldserve.params import ParamError

router = APIRouter(tags=["videos"])
STALL_TIMEOUT_S = 60.0
SEND_TIMEOUT_S = 60.0
MAX_CONTROL_BYTES = 128 * 2**10
OVERSIZE_BYTES = 2**20
"""How far past `--max-upload-mb` a WebSocket message is still read (`ws_max_size`), so that a session.start
just over the limit gets its 413 naming the flag; a larger message closes the socket with the protocol's
1009 (message too big) before it is buffered."""
POLL_S = 1.0
_Started = tuple[str, Request, "asyncio.Future[VideoResult]"]
"""The upsampled prompt, the queued request, its outcome."""

log = logging.getLogger("worldserve.realtime")


def ws_max_size(max_upload_bytes: int) -> int:
    """uvicorn's `ws_max_size` for a server taking bodies of `max_upload_bytes` (uvicorn's own 16 MiB had
    closed a session.start of an inline reference that POST /v1/videos takes with 1009)."""
    return max_upload_bytes + OVERSIZE_BYTES


async def _reaped(task: asyncio.Future) -> None:
    """Wait for a cancelled `task` to end: its cancellation is expected and its own error is logged, not
    raised; a cancellation of the task waiting still ends it (contextlib.suppress(BaseException) swallowed
    both)."""
    outcomes: list[object] = await asyncio.gather(task, return_exceptions=True)
    (outcome,) = outcomes
    if isinstance(outcome, Exception) and not isinstance(outcome, _Stop):  # (not a CancelledError either)
        log.error("a realtime session's task failed: %r", outcome, exc_info=outcome)


class _Stop(Exception):
    """The session ends without a result: `reason` is "stop" (session.stop), "stall", "gone" (the client
    left, or read nothing for SEND_TIMEOUT_S) or "shutdown" (the server began shutting down while the request
    was still queued)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@router.websocket("/v1/realtime/video")
async def realtime_video(websocket: WebSocket) -> None:
    await websocket.accept()
    await _Session(websocket, websocket.app.state.ws).run()


class _Session:
    """One socket, one video: the start, then the parts and the client's control messages side by side."""

    def __init__(self, websocket: WebSocket, st: AppState):
        self.ws, self.st = websocket, st
        self.send_lock = asyncio.Lock()
        self.request_id = f"video_stream-{uuid.uuid4().hex}"
        self.request: Request | None = None
        self.done: asyncio.Future[VideoResult] | None = None
        self.parts: asyncio.Queue[tuple[bytes, int]] = asyncio.Queue()
        self.ended = threading.Event()
        """Set when the session is over, however it ended: an encode still running stops making parts."""
        self.sent = 0
        self.completed = False
        """Set once session.done has been sent for a whole video."""
        self.last_progress = time.monotonic()
        self.unread = False
        """Set when a send timed out: the client reads nothing, its socket is full (it is dropped, not closed)."""

    async def run(self) -> None:
        try:
            start = await read_start(self.ws, self.st)
        except WebSocketDisconnect:
            return
        except (APIError, ParamError) as exc:
            # (the status the same request gets from POST /v1/videos: a ParamError is its 400)
            await self._error(exc.message, exc.status if isinstance(exc, APIError) else 400, exc.param)
            await self._close()
            return
        control = asyncio.create_task(self._control())
        try:
            if await self._queue(start, control):
                await self._stream(control)
        except _Stop as exc:  # stopped, stalled, or the client left
            if exc.reason == "stall" and self.request is not None:  # (a failure: counted as a 504)
                self.request.abort_status = 504
            self._abort()
            if exc.reason == "stall":
                await self._error("Stall timeout: no generation progress", 504)
            if exc.reason == "shutdown":  # (the request is cancelled, not refused: no rejection counted)
                await self._error(f"Video generation was not started: {SHUTDOWN_REASON}", 503)
            if exc.reason in ("stop", "stall"):
                with contextlib.suppress(_Stop):
                    await self._send({"type": "session.done", "request_id": self.request_id,
                                      "chunks": self.sent, "stopped": True})  # fmt: skip
        finally:
            self.ended.set()
            self._abort()
            self._settle(delivered=False)
            control.cancel()
            await _reaped(control)
        await self._close()

    def _settle(self, delivered: bool) -> None:
        """Report the request's finish once its session has sent every part, or as cancelled when the session
        ended first (the client left, or read nothing until the send timed out, with the parts made ahead)."""
        held = self.request.observer if self.request is not None else None
        if isinstance(held, HeldFinish) and delivered:
            held.delivered()
        elif isinstance(held, HeldFinish):
            held.undelivered()

    def _abort(self) -> None:
        """Stop the request unless it has ended (its outcome, unread, was marked read when it was made)."""
        if self.done is not None and not self.done.done():
            self.st.client.jobless.abort(self.request_id)

    async def _queue(self, start: StreamStart, control: asyncio.Task) -> bool:
        """Queue the request (its prompt upsampled first when asked), send video.start; False once an error
        was sent (the queue is full, the server is stopping, the prompt could not be written)."""
        params, config = start.params, start.config
        on_frames = partial(_encode_parts, asyncio.get_running_loop(), self.parts, start.encode, self.ended)
        client = self.st.client
        if params.upsample_prompt:
            started = await self._upsampled(
                client.jobless.stream_upsampled(
                    params, self.request_id, on_frames, self.st.settings.sync_timeout_s
                ),
                control,
            )
            if started is None:
                return False
            prompt, self.request, self.done = started
            config = {**config, "upsampled_prompt": prompt}
        else:
            try:
                self.request, self.done = client.jobless.stream(params, self.request_id, on_frames)
            except (QueueFullError, ShuttingDownError) as exc:
                await self._refused(exc)
                return False
        if self.st.settings.request_log is not None:
            self.st.settings.request_log.video(self.request_id, params)
        await self._send({"type": "video.start", "request_id": self.request_id, "format": "m4s",
                          "config": config})  # fmt: skip
        return True

    async def _upsampled(
        self, start: Coroutine[Any, Any, _Started], control: asyncio.Task
    ) -> _Started | None:
        """`start` (the client's jobless.stream_upsampled: the Reasoner writes the prompt, as `POST /v1/videos`
        upsamples, then the request is queued), or None once an error was sent; the session's end (_Stop)
        cancels the chat."""
        work = asyncio.ensure_future(start)
        await asyncio.wait({work, control}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            await _reaped(work)
            raise _Stop(control.result())
        try:
            return work.result()
        except TimeoutError:
            await self._error(f"Prompt upsampling timed out after {self.st.settings.sync_timeout_s:g}s.", 504)
        except (QueueFullError, ShuttingDownError) as exc:
            await self._refused(exc)
        except UpsamplingFailed as exc:
            await self._error(f"Prompt upsampling failed: {exc}", exc.status, exc.param)
        return None

    async def _refused(self, exc: Exception) -> None:
        refusal = self.st.refusal(exc)
        retry = {"retry_after_s": exc.retry_after_s} if isinstance(exc, QueueFullError) else None
        await self._error(refusal.message, refusal.status, extra=retry)

    async def _stream(self, control: asyncio.Task) -> None:
        """Send the parts as they come until the request ends (its outcome: session.done or an error) or the
        control side stops the session (raises _Stop)."""
        done = self.done
        assert done is not None  # (_queue set it: the request is queued)
        while True:
            get = asyncio.ensure_future(self.parts.get())
            waiting: set[asyncio.Future[Any]] = {get, done, control}
            finished, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if get in finished:
                await self._send_part(*get.result())
                continue
            get.cancel()
            if control in finished:
                raise _Stop(control.result())
            while not self.parts.empty():  # (on_frames queued every part before the result settled)
                await self._send_part(*self.parts.get_nowait())
            if (exc := done.exception()) is not None:
                code, message, param = error_for(exc)
                await self._error(message, code, param)
                return
            await self._send({"type": "session.done", "request_id": self.request_id, "chunks": self.sent,
                              "stopped": False})  # fmt: skip
            self.completed = True
            self._settle(delivered=True)
            return

    async def _send_part(self, data: bytes, frames: int) -> None:
        metadata = {
            "type": "video.chunk_metadata", "request_id": self.request_id,
            "kind": "media", "num_frames": frames,
            "byte_length": len(data), "generation_chunk_index": self.sent, "transport_chunk_index": self.sent,
            "started_event_ids": [], "active_event_ids": [], "completed_event_ids": [],
        }  # fmt: skip
        await self._send(metadata, data)  # the metadata and its bytes go out together
        self.sent += 1
        self.last_progress = time.monotonic()

    async def _control(self) -> str:
        """Read the client's messages until it stops the session ("stop"), leaves ("gone"), the running
        request makes no progress for STALL_TIMEOUT_S ("stall") or the server begins shutting down while the
        request is still queued ("shutdown")."""
        steps = 0
        while True:
            request = self.request
            if request is None or request.steps_done != steps or request.admitted_time is None:
                steps, self.last_progress = request.steps_done if request else 0, time.monotonic()
            if time.monotonic() - self.last_progress > STALL_TIMEOUT_S:
                return "stall"
            # (a queued request runs no more at a shutdown: its 503 at once, not after the running one)
            if request is not None and not request.admitted and not self.st.client.accepting:
                return "shutdown"
            try:
                message = await asyncio.wait_for(self.ws.receive(), POLL_S)
            except TimeoutError:
                continue
            except (WebSocketDisconnect, RuntimeError):
                return "gone"
            if message["type"] == "websocket.disconnect":
                return "gone"
            raw = message.get("text")
            if raw is None:
                await self._error("WebSocket messages must be JSON text", 400)
                continue
            if len(raw) > MAX_CONTROL_BYTES:
                await self._error("control message too large", 413)
                continue
            try:
                msg = parse_json(raw)
            except APIError:
                await self._error("Invalid JSON message", 400)
                continue
            kind = msg.get("type") if isinstance(msg, dict) else None
            if not isinstance(msg, dict):
                await self._error("WebSocket messages must be JSON objects", 400)
            elif kind == "session.stop":
                return "stop"
            elif kind == "session.ping":  # (not progress: a stalled request stays stalled, pinged or not)
                await self._send({"type": "session.pong"})
            elif kind == "session.interaction":
                await self._error("session.interaction is not supported: Cosmos3 generates the whole video in "
                                  "one pass, so its prompt cannot change while it runs", 400, "type")  # fmt: skip
            elif kind == "session.start":
                await self._error("The session has started: one session.start per session", 400, "type")
            else:  # (a missing or unknown type named, as session.start's)
                await self._error(f"Unknown message type: {kind}", 400, "type")

    async def _send(self, *messages: dict[str, Any] | bytes) -> None:
        """Send `messages` together (a dict as JSON text, bytes as one binary message); _Stop("gone") when
        the client has left, or has read nothing for SEND_TIMEOUT_S."""
        async with self.send_lock:
            try:
                await asyncio.wait_for(self._send_now(messages), SEND_TIMEOUT_S)
            except TimeoutError:  # the client reads nothing: its socket is full, no close frame can go out
                self.unread = True
                raise _Stop("gone") from None
            except (WebSocketDisconnect, RuntimeError, OSError):
                raise _Stop("gone") from None  # (uvicorn: RuntimeError once the socket is closed)

    async def _send_now(self, messages: tuple[dict[str, Any] | bytes, ...]) -> None:
        for message in messages:
            if isinstance(message, bytes):
                await self.ws.send_bytes(message)
            else:
                await self.ws.send_json(message)

    async def _error(self, message: str, code: int, param: str | None = None,
                     extra: dict[str, Any] | None = None) -> None:  # fmt: skip
        """An error message (code: the HTTP status the same failure gets there); nothing when the client is
        gone."""
        payload: dict[str, Any] = {"type": "error", "message": message, "code": code}
        if param is not None:
            payload["param"] = param
        payload.update(extra or {})
        with contextlib.suppress(_Stop):
            await self._send(payload)

    async def _close(self) -> None:
        """Close the socket: 1012 (Service Restart, as uvicorn closes its sockets at a shutdown) when the
        session ends without its video because the server is shutting down; a close that cannot be sent
        within ABORT_AFTER_S (a client reading nothing) drops the connection instead."""
        code = 1012 if not self.completed and not self.st.client.accepting else 1000
        if self.unread:  # (a send timed out behind unread parts: dropped at once)
            abort_connection(self.ws)
            return
        try:
            await asyncio.wait_for(self.ws.close(code), ABORT_AFTER_S)
        except TimeoutError:  # a client that reads nothing: the close frame waits behind its unread parts
            abort_connection(self.ws)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass


def _encode_parts(loop: asyncio.AbstractEventLoop, parts: asyncio.Queue, encode: EncodeOptions,
                  ended: threading.Event, result: VideoResult) -> None:  # fmt: skip
    """The request's `on_frames` (in the engine's encode pool): its frames as fragmented MP4 parts, each
    queued for the session as soon as it is muxed; it stops (and so does the decode) once the session
    has `ended`, raising FramesLost from FramesCancelled: the request counts as cancelled, not finished (a
    client that left mid-decode had been counted a success)."""
    assert isinstance(result.frames, FrameStream)  # (hand_streamed hands the frames as they are decoded)
    fragments = encode_fragments(result.frames, result.fps, result.audio, result.sample_rate,
                                 crf=encode.crf, codec_options=encode.codec_options)  # fmt: skip
    with contextlib.closing(fragments):
        for part in fragments:
            if ended.is_set():
                raise FramesLost("the session ended before its last part") from FramesCancelled()
            try:
                loop.call_soon_threadsafe(parts.put_nowait, part)
            except RuntimeError:  # the server's loop has closed
                raise FramesLost("the server stopped before the last part") from FramesCancelled()

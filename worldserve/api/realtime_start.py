"""A realtime session's start (`/v1/realtime/video`, api/realtime.py): its session.start message read, checked
as `POST /v1/videos` checks a JSON body, and turned into the request the session queues plus the `config`
its video.start echoes.

- Reading (`read_start`): the message must come within START_TIMEOUT_S (else 408), as JSON text, within
  `--max-upload-mb` (else 413); the server beginning a shutdown first gets the 503. A message past what the
  socket takes (`ws_max_size`) never reaches the app: uvicorn closes the socket with 1009 (message too big)
  and the app reads a disconnect with that code. Both too-large starts count as
  `request_rejected_total{reason="too_large"}`, as a body too large counts on the video routes.
- Fields (`merged_fields`): vLLM-Omni's merge of the `sampling_params` object into the request (a request
  field the message left out takes its value there, any other key joins `extra_params`, its own
  `extra_params` keys too); an error then names a value as session.start named it (`sent_name`:
  `sampling_params.num_inference_steps`, not the field it filled).
- config (`stream_config`): the request as its video is made, not as it was sent: defaults filled in,
  `extra_params` keys over the top level, `size` / `video_params` / `seconds` resolved into width, height and
  frames, under the request's field names (the HTTP job object's fields with the values it shows).
Errors are APIError / ParamError naming the field; the session sends them as its `error` message.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from worldserve.api.bodies import parse_json, upload_limit
from worldserve.api.errors import APIError
from worldserve.api.protocol import VideoCreateRequest
from worldserve.api.state import AppState
from worldserve.api.video_inputs import (
    VideoInputs,
    build_inputs,
    checked_codec_options,
    json_body_fields,
    json_object_field,
    parse_extra_params,
)
from worldserve.engine.client import SHUTDOWN_REASON, EncodeOptions, ShuttingDownError
from worldserve.params import ParamError, VideoParams

START_TIMEOUT_S = 10.0
START_POLL_S = 0.1
"""How often a session waiting for its session.start looks whether the server began shutting down (its 503
comes within this; at most START_TIMEOUT_S / START_POLL_S looks a session)."""
MESSAGE_TOO_BIG = 1009
"""The WebSocket close code of a message past the socket's size limit (RFC 6455 §7.4.1)."""
STREAM_CODEC_OPTIONS = {"tune": "zerolatency"}
"""x264 hands out each frame's packet at once (no frame threads' delay), as vLLM-Omni's stream encodes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamStart:
    """A session.start as checked: what the session queues, and what video.start echoes."""

    params: VideoParams
    """The request, validated (the model's checks included)."""
    encode: EncodeOptions
    """How its parts are encoded (the stream's codec options under the request's)."""
    config: dict[str, Any]
    """video.start's `config` (stream_config)."""


async def read_start(ws: WebSocket, st: AppState) -> StreamStart:
    """The session's checked session.start. APIError / ParamError: the error to answer (the socket is then
    closed); WebSocketDisconnect: the client left, or its message was too big for the socket (counted)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if not st.client.accepting:
            raise st.refusal(ShuttingDownError(SHUTDOWN_REASON))
        if (left := deadline - time.monotonic()) <= 0:
            raise APIError(408, "Timeout waiting for session.start")
        try:
            message = await asyncio.wait_for(ws.receive(), min(left, START_POLL_S))
            break
        except TimeoutError:
            continue
    if message["type"] == "websocket.disconnect":
        code = message.get("code", 1000)
        if code == MESSAGE_TOO_BIG:
            # (the server's protocol refused the session.start unread: a body too large, as the 413 below)
            st.metrics.on_rejected("too_large")
        raise WebSocketDisconnect(code)
    raw = message.get("text")
    if raw is None:
        raise APIError(400, "session.start must be a JSON text message")
    limit = st.settings.max_upload_bytes
    if len(raw) > limit or len(raw.encode("utf-8", "surrogatepass")) > limit:
        # (as POST /v1/videos counts a body too large)
        st.metrics.on_rejected("too_large")
        raise APIError(413, f"session.start message exceeds {upload_limit(limit)}")
    msg = parse_json(raw, "JSON in session.start")
    if not isinstance(msg, dict):
        raise APIError(400, "session.start must be a JSON object")
    if msg.get("type") != "session.start":
        raise APIError(400, f"Expected session.start, got: {msg.get('type')}", param="type")
    if msg.get("format", "m4s") != "m4s":
        raise APIError(400, "Invalid session.start format: expected 'm4s'.", param="format")
    fields, origins = merged_fields(msg)
    try:
        return await _checked(json_body_fields(fields), st)
    except (APIError, ParamError) as exc:
        # named as session.start named the value
        exc.param = sent_name(exc.param, origins)
        raise


async def _checked(fields: dict[str, Any], st: AppState) -> StreamStart:
    """`fields` built and validated as `POST /v1/videos` builds a job's (the model's checks too), with the
    stream's codec options."""
    inputs = await build_inputs(fields, served_model=st.served_model_name,
                                model_aliases=st.settings.model_aliases, has_sound=st.client.has_sound,
                                defaults=st.settings.video_defaults, fetcher=st.media,
                                decode_pixels=st.settings.video_decode_pixels, lora=st.settings.lora)  # fmt: skip
    codec = {**STREAM_CODEC_OPTIONS, **(inputs.encode.codec_options or {})}
    if int(checked_codec_options(codec, inputs.encode.crf).get("bf", 0)) > 0:
        raise ParamError("extra_params.video_codec_options", "video_codec_options.bf must be 0 on "
                         "/v1/realtime/video: its fragments have no B-frames (they would start the video "
                         "after its audio).")  # fmt: skip
    # tokenises: off the event loop
    await asyncio.to_thread(st.client.validate, inputs.params)
    config = stream_config(inputs, codec, has_sound=st.client.has_sound)
    return StreamStart(params=inputs.params, encode=EncodeOptions(crf=inputs.encode.crf, codec_options=codec),
                       config=config)  # fmt: skip


def stream_config(inputs: VideoInputs, codec_options: dict[str, Any], *, has_sound: bool) -> dict[str, Any]:
    """video.start's `config`: the request as its video is made (vLLM-Omni echoes the request model as sent:
    a value `extra_params` overrode, a default, the frames `seconds` makes were not shown), under the
    request's field names; `model`, `prompt`, `size`, `seconds`, `quality`, `fps` and `num_frames` as the
    HTTP job object shows them. Left out: the references' bytes, the built-in negative prompt (shown only
    when the request or the server gave one), the fields Cosmos3 does not use."""
    params, spec = inputs.params, inputs.spec
    sound = params.generate_sound
    config: dict[str, Any] = {
        "model": spec.model, "prompt": params.prompt, "size": spec.size, "width": params.width,
        "height": params.height, "seconds": spec.seconds, "num_frames": params.num_frames, "fps": params.fps,
        "quality": spec.quality, "num_inference_steps": params.num_inference_steps,
        "guidance_scale": params.guidance_scale, "flow_shift": params.resolved_flow_shift(), "seed": params.seed,
        "max_sequence_length": params.max_sequence_length,
        # (the pipeline's rule for an unset one: on for a video where the checkpoint has sound)
        "generate_sound": sound if sound is not None else has_sound and params.num_frames > 1,
    }  # fmt: skip
    given = {
        "negative_prompt": params.negative_prompt,
        "sound_duration": params.sound_duration,
        "user": spec.user,
    }
    config.update({k: v for k, v in given.items() if v is not None})
    if params.lora is not None:
        # (not its path: a server folder, --lora-path's when the request named no adapter)
        config["lora"] = {"name": params.lora.name, "scale": params.lora.scale}
    config["extra_params"] = _stream_extra_params(inputs, codec_options)
    return config


def _stream_extra_params(inputs: VideoInputs, codec_options: dict[str, Any]) -> dict[str, Any]:
    """The request's `extra_params` as validated, with the Cosmos3 keys the video is made with (the defaults
    too) and the codec options its parts are encoded with."""
    params = inputs.params
    extra = parse_extra_params(inputs.request.extra_params).model_dump(mode="json", exclude_none=True)
    extra.update({
        "use_duration_template": params.add_duration_template,
        "use_resolution_template": params.add_resolution_template,
        "negative_metadata_mode": params.negative_metadata, "use_system_prompt": params.use_system_prompt,
        "upsample_prompt": params.upsample_prompt, "video_codec_options": codec_options,
    })  # fmt: skip
    if params.guidance_interval is not None:
        extra["guidance_interval"] = list(params.guidance_interval)
    if params.video is not None:
        extra["condition_frame_indexes_vision"] = list(params.condition_frame_indexes)
        extra["condition_video_keep"] = params.condition_video_keep
    return extra


def merged_fields(msg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(session.start's request fields with its sampling_params merged in, as vLLM-Omni merges them; each
    merged field's name -> the name session.start gave it). APIError naming a sampling_params that is no
    object."""
    fields = {k: v for k, v in msg.items() if k not in ("type", "format", "sampling_params")}
    sampling = msg.get("sampling_params")
    if sampling is not None and not isinstance(sampling, dict):
        raise APIError(400, "sampling_params must be a JSON object", param="sampling_params")
    origins: dict[str, str] = {}
    if sampling:
        extra = dict(json_object_field(fields.get("extra_params"), "extra_params") or {})
        for key, value in sampling.items():
            # (its extra_params' keys join the top level's)
            if key == "extra_params":
                nested = json_object_field(value, "sampling_params.extra_params") or {}
                extra.update(nested)
                origins.update({f"extra_params.{k}": f"sampling_params.extra_params.{k}" for k in nested})
            elif key in VideoCreateRequest.model_fields and key not in fields:
                fields[key] = value
                origins[key] = f"sampling_params.{key}"
            else:
                extra[key] = value
                origins[f"extra_params.{key}"] = f"sampling_params.{key}"
        if extra:
            fields["extra_params"] = extra
    return fields, origins


def sent_name(param: str | None, origins: dict[str, str]) -> str | None:
    """An error's `param` as session.start named it: a merged field (or a part of it, `.key` / `[i]` below
    it) renamed by `origins` (merged_fields')."""
    if param is None:
        return None
    for merged, sent in origins.items():
        if param == merged or param.startswith((merged + ".", merged + "[")):
            return sent + param[len(merged) :]
    return param

"""The offline Engine's video requests: `video_params` turns `generate_video`'s arguments into a checked
VideoParams, `run_video` runs one through the engine and returns its MP4.

A request is the prompt (or a whole VideoParams) plus VideoParams fields by name; with a text prompt, the fields
it leaves out take the engine's `default_sampling_params` / `flow_shift` (what `worldserve serve` gives the HTTP
requests that omit them), then Cosmos3's defaults; a whole VideoParams keeps its own values. Its adapter is the engine's `lora_path` unless it names one (which needs
`enable_lora`, as the server's routes check: api/lora_field.py). An image for image-to-video may be a uint8
(H, W, 3) array, a PIL image, encoded bytes or a file path: files and bytes are decoded as the HTTP route's
`input_reference` is (Pillow, EXIF orientation: media/image.py).

`run_video` queues the request in the engine without a job (engine/ephemeral.py, the realtime route's way):
the engine's scheduler batches it with the other requests in flight, and its frames stream, chunk by chunk as
the VAE decodes them, into the same MP4 encoder the server's jobs use, in the engine's encode pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from worldserve.engine.client import EncodeOptions, EngineClient, VideoResult
from worldserve.engine.endings import default_encoder
from worldserve.engine.refusals import CancelledRequest
from worldserve.offline.outputs import VideoOutput
from worldserve.param_types import is_real
from worldserve.params import LoraRequest, ParamError, VideoParams

INTERNAL_FIELDS = frozenset({"field_names", "server_negative_prompt"})
"""VideoParams fields the request layer sets (which field a value came in; the server's negative prompt)."""
FIELDS = frozenset(f.name for f in dataclasses.fields(VideoParams)) - INTERNAL_FIELDS
"""The VideoParams fields a request may set by name."""


def video_params(
    request: str | VideoParams,
    fields: Mapping[str, Any],
    *,
    defaults: Mapping[str, Any],
    static_lora: LoraRequest | None = None,
    per_request_lora: bool = False,
) -> VideoParams:
    """The request's VideoParams, validated: ParamError (a ValueError) naming the first bad field, an unknown
    one included."""
    for name in fields:
        if name not in FIELDS:
            known = ", ".join(sorted(FIELDS))
            raise ParamError(name, f"{name!r} is not a VideoParams field (fields: {known})")
    given = {**fields}
    if "image" in given:
        given["image"] = conditioning_image(given["image"])
    if isinstance(request, VideoParams):
        params = dataclasses.replace(request, **given)
    elif isinstance(request, str):
        omitted = {k: v for k, v in defaults.items() if k in FIELDS and k not in given}
        # the engine's default negative prompt is not capped by max_sequence_length (as the server's)
        server_negative = "negative_prompt" in omitted
        params = VideoParams(prompt=request, **omitted, **given, server_negative_prompt=server_negative)
    else:
        raise ParamError("prompt", f"prompt must be a string or a VideoParams, got {type(request).__name__}")
    # (numpy scalars as Python's: the request's JSON, logs and outputs see plain ints, floats and bools)
    params = dataclasses.replace(params, **python_scalars(params))
    if params.lora is None and static_lora is not None:
        params = dataclasses.replace(params, lora=static_lora)
    # (an adapter of its own needs enable_lora, as the server's routes require: the same check)
    from worldserve.api.lora_field import LoraSettings

    LoraSettings(per_request_lora, static_lora).check_restored(params)
    return params.validate()


def check_timeout(timeout: Any) -> None:
    """generate_video's `timeout`: None or a positive number of seconds; ParamError naming `timeout`."""
    if timeout is None:
        return
    if not is_real(timeout):
        raise ParamError(
            "timeout", f"timeout must be a number of seconds or None, got {type(timeout).__name__}"
        )
    if not timeout > 0 or timeout == float("inf"):
        raise ParamError(
            "timeout", f"timeout={timeout} must be a positive finite number of seconds (or None)"
        )


def python_scalars(params: VideoParams) -> dict[str, Any]:
    """The fields of `params` that are numpy scalars (`seed=np.int64(3)`, `guidance_scale=np.float32(5)`), as
    the Python int / float / bool of the same kind (`.item()`: np.float64(64.0) stays a float, refused as a
    width). VideoParams takes them as they are; kept, they would reach VideoOutput.seed, the engine's JSON
    and logs as numpy values."""
    return {
        f.name: value.item()
        for f in dataclasses.fields(params)
        if isinstance(value := getattr(params, f.name), np.generic)
    }


def conditioning_image(image: Any) -> np.ndarray | None:
    """An image-to-video frame as uint8 (H, W, 3): an array as it is (VideoParams checks it), a PIL image in
    RGB (turned upright by its EXIF orientation), encoded bytes or a file path decoded as the HTTP route's
    input_reference. ParamError naming `image` for anything else or an unreadable file."""
    if image is None or isinstance(image, np.ndarray):
        return image
    from worldserve.media.image import decode_image

    if isinstance(image, (bytes, bytearray, memoryview)):
        return decode_image(bytes(image), param="image")
    if isinstance(image, (str, os.PathLike)):
        try:
            with open(image, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ParamError("image", f"cannot read {os.fspath(image)!r}: {exc.strerror or exc}") from None
        return decode_image(data, param="image")
    from PIL import Image, ImageOps

    if isinstance(image, Image.Image):
        return np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    given = type(image).__name__
    raise ParamError(
        "image", f"image must be a uint8 (H, W, 3) array, a PIL image, bytes or a path, got {given}"
    )


async def run_video(client: EngineClient, params: VideoParams, encode: EncodeOptions) -> VideoOutput:
    """Run `params` through the engine (client's loop): its MP4 and timings. The model's own checks first
    (prompt length, sound: ParamError naming the field); QueueFullError / ShuttingDownError when it cannot
    queue; a cancellation (the caller interrupted, or its timeout) aborts it at the next step."""
    t0 = time.monotonic()
    await asyncio.to_thread(client.validate, params)  # (tokenizes the prompt: off the loop)
    request_id = f"offline-video-{uuid.uuid4().hex}"
    encoded: dict[str, Any] = {}

    def on_frames(result: VideoResult) -> None:
        """The engine's encode pool: the frames as the VAE makes them, into the server's encoder."""
        started = time.monotonic()
        encoded["video"] = default_encoder(
            result.frames, result.fps, result.audio, sample_rate=result.sample_rate,
            crf=encode.crf, codec_options=encode.codec_options,
        )  # fmt: skip
        encoded["encode"] = time.monotonic() - started

    if params.upsample_prompt:  # the Reasoner writes the prompt first, as for the server's requests
        prompt, request, future = await client.jobless.stream_upsampled(params, request_id, on_frames, 1e9)
        params = dataclasses.replace(params, prompt=prompt, upsample_prompt=False)
    else:
        request, future = client.jobless.stream(params, request_id, on_frames)
    try:
        result = await future
    except CancelledRequest as exc:  # the engine stopped (close(), or a crash) before it finished
        raise RuntimeError(f"the video request was cancelled: {exc}") from None
    except BaseException:  # the caller went away (interrupt, timeout): stop it at its next step
        client.jobless.abort(request_id)
        raise
    delivered = getattr(request.observer, "delivered", None)
    if delivered is not None:  # (its finish, held for the stream's delivery: it was delivered)
        delivered()
    stages = {**result.stage_seconds, "encode": encoded["encode"]}
    return VideoOutput(
        video=encoded["video"], params=params, seconds=time.monotonic() - t0,
        stage_seconds={k: round(float(v), 4) for k, v in stages.items()}, peak_memory_mb=float(result.peak_memory_mb),
    )  # fmt: skip

"""The offline Engine's video requests: `video_params` turns `generate_video`'s arguments into a checked
VideoParams, `run_video` runs one through the engine and returns its MP4; `video_params_list` and `run_videos`
do the same for a list of requests (vLLM's `LLM.generate(prompts)`).

A request is the prompt (or a whole VideoParams) plus VideoParams fields by name; with a text prompt, the fields
it leaves out take the engine's `default_sampling_params` / `flow_shift` (what `worldserve serve` gives the HTTP
requests that omit them), then Cosmos3's defaults; a whole VideoParams keeps its own values. Its adapter is the
engine's `lora_path` unless it names one, a LoraRequest or the routes' `lora` object as a dict (which needs
`enable_lora`, as the server's routes check: api/lora_field.py). An image for image-to-video may be a uint8
(H, W, 3) array, a PIL image, encoded bytes or a file path: files and bytes are decoded as the HTTP route's
`input_reference` is (Pillow, EXIF orientation: media/image.py).

`run_video` queues the request in the engine without a job (engine/ephemeral.py, the realtime route's way):
the engine's scheduler batches it with the other requests in flight, and its frames stream, chunk by chunk as
the VAE decodes them, into the same MP4 encoder the server's jobs use, in the engine's encode pool.

A list: the keyword fields apply to every item (as one SamplingParams to every prompt); every item is checked
(the model's checks included) before any is queued; an item's error is named `prompt[i]` / `prompt[i].<field>`,
a keyword's as the keyword (the same value for every item). They are queued grouped by output shape (first
appearance first) so that same-shape items batch, at most `at_once` at a time; the first failure, a timeout
or an interrupt aborts the others at their next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from worldserve.engine.client import EncodeOptions, EngineClient, VideoResult
from worldserve.engine.endings import default_encoder
from worldserve.engine.prompt_upsampling import UpsamplingFailed
from worldserve.engine.refusals import CancelledRequest
from worldserve.engine.request import Request
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
    given = keyword_fields(fields)
    return _checked_params(request, given, defaults, static_lora, per_request_lora)


def video_params_list(
    requests: Sequence[str | VideoParams],
    fields: Mapping[str, Any],
    *,
    defaults: Mapping[str, Any],
    static_lora: LoraRequest | None = None,
    per_request_lora: bool = False,
) -> list[VideoParams]:
    """`video_params` of each request, `fields` applied to every one (an image decoded once): ParamError
    naming the keyword (an unknown one, or an image that cannot be read) or the first bad item's
    (`item_error`)."""
    given = keyword_fields(fields)
    checked = []
    for i, request in enumerate(requests):
        try:
            checked.append(_checked_params(request, given, defaults, static_lora, per_request_lora))
        except ParamError as exc:
            raise item_error(i, exc, fields) from None
    return checked


def is_request_list(prompt: Any) -> bool:
    """Whether generate_video's `prompt` is a list (or tuple) of requests rather than one."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes, bytearray))


def item_error(index: int, exc: ParamError, keywords: Collection[str]) -> ParamError:
    """Item `index`'s error, said of it: a keyword field (every item's value) keeps its name, the item's prompt
    is `prompt[i]`, its other fields `prompt[i].<field>`; the message starts with `prompt[i]: `."""
    if exc.param in keywords:
        param = exc.param
    elif exc.param == "prompt":
        param = f"prompt[{index}]"
    else:
        param = f"prompt[{index}].{exc.param}"
    return type(exc)(param, f"prompt[{index}]: {exc.message}")


def check_field_names(fields: Mapping[str, Any], known: frozenset[str] = FIELDS) -> None:
    """ParamError naming the first keyword that is no VideoParams field (`known`: the ones listed as taken)."""
    for name in fields:
        if name not in FIELDS:
            raise ParamError(
                name, f"{name!r} is not a VideoParams field (fields: {', '.join(sorted(known))})"
            )


def keyword_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword fields, each a VideoParams field (ParamError naming one that is not), the image decoded."""
    check_field_names(fields)
    given = {**fields}
    if "image" in given:
        given["image"] = conditioning_image(given["image"])
    return given


def _checked_params(
    request: str | VideoParams,
    given: Mapping[str, Any],
    defaults: Mapping[str, Any],
    static_lora: LoraRequest | None,
    per_request_lora: bool,
) -> VideoParams:
    """The VideoParams of `request` with the keyword fields `given` (keyword_fields), validated."""
    if isinstance(request, VideoParams):
        params = dataclasses.replace(request, **given)
        if "image" not in given and request.image is not None:  # (a PIL image, bytes or a path, as image=)
            params = dataclasses.replace(params, image=conditioning_image(request.image))
    elif isinstance(request, str):
        omitted = {k: v for k, v in defaults.items() if k in FIELDS and k not in given}
        # the engine's default negative prompt is not capped by max_sequence_length (as the server's)
        server_negative = "negative_prompt" in omitted
        params = VideoParams(prompt=request, **omitted, **given, server_negative_prompt=server_negative)
    else:
        raise ParamError("prompt", f"prompt must be a string or a VideoParams, got {type(request).__name__}")
    # (numpy scalars as Python's: the request's JSON, logs and outputs see plain ints, floats and bools)
    params = dataclasses.replace(params, **python_scalars(params))
    from worldserve.api.lora_field import ENGINE_PER_REQUEST_OFF, LoraSettings

    # (a dict is the HTTP routes' lora object, read as they read it; an adapter of its own needs enable_lora,
    # as the server's routes require: the same check)
    settings = LoraSettings(per_request_lora, static_lora, ENGINE_PER_REQUEST_OFF)
    params = dataclasses.replace(params, lora=settings.for_argument(params.lora))
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
        f.name: python_scalar(value)
        for f in dataclasses.fields(params)
        if isinstance(value := getattr(params, f.name), np.generic)
    }


def python_scalar(value: Any) -> Any:
    """A numpy scalar as the Python int / float / bool of its kind (`.item()`), anything else as it is."""
    return value.item() if isinstance(value, np.generic) else value


def upsampling_error(exc: UpsamplingFailed) -> Exception:
    """A failed prompt upsampling as the Python API raises it: a ParamError naming the field when the
    request's own limits refused it (the route's 400), else a RuntimeError."""
    if exc.status == 400:
        return ParamError(exc.param or "prompt", f"prompt upsampling failed: {exc}")
    return RuntimeError(f"prompt upsampling failed ({exc.status}): {exc}")


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
    return await _finish(client, await _start(client, params, encode, t0))


async def run_videos(
    client: EngineClient, params_list: Sequence[VideoParams], encode: EncodeOptions, *, at_once: int,
    keywords: Collection[str],
) -> list[VideoOutput]:  # fmt: skip
    """`run_video` of every request, their outputs in order: all of them through the model's checks first
    (ParamError: item_error, `keywords` the fields given for every item), then queued grouped by output shape
    (`submission_order`), at most `at_once` in the engine at a time (queued or running; the next one queued as
    one ends, joining a running batch of its shape at a step boundary). The first `at_once` (those whose
    prompt is not written by the Reasoner first) are queued in one piece (Engine.add_requests), so the
    scheduler admits same-shape ones together: they batch from their first step whatever the threads'
    timing. The first failure is raised and aborts the others at their next step, as does a cancellation (an
    interrupt, the timeout) of the whole."""

    def check_all() -> None:
        for i, params in enumerate(params_list):
            try:
                client.validate(params)
            except ParamError as exc:
                raise item_error(i, exc, keywords) from None

    await asyncio.to_thread(check_all)  # (tokenizes the prompts: off the loop)
    order = submission_order(params_list)
    wave = [i for i in order[:at_once] if not params_list[i].upsample_prompt]
    now = time.monotonic()
    first = dict(zip(wave, _start_together(client, [params_list[i] for i in wave], encode, now), strict=True))
    gate = asyncio.Semaphore(at_once - len(wave))  # (the wave's slots are released as its requests end)

    async def one(i: int) -> VideoOutput:
        try:
            if i in first:
                try:
                    return await _finish(client, first[i])
                finally:
                    gate.release()
            async with gate:  # (its waiters are woken first come, first served: in submission order)
                return await _finish(client, await _start(client, params_list[i], encode, time.monotonic()))
        except ParamError as exc:  # (found as it ran: the prompt the Reasoner wrote for it)
            raise item_error(i, exc, keywords) from None

    tasks = {i: asyncio.ensure_future(one(i)) for i in order}
    try:
        await asyncio.gather(*tasks.values())
    except BaseException:  # a failure, or the whole cancelled: the others stop, each aborting its request
        for task in tasks.values():
            task.cancel()
        for started in first.values():  # (queued: a task cancelled before it ran would not abort its own)
            _abandon(client, started)
        # (their aborts sent before the failure reaches the caller)
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        raise
    return [tasks[i].result() for i in range(len(params_list))]


def submission_order(params_list: Sequence[VideoParams]) -> list[int]:
    """The indexes of `params_list` grouped by output shape (the shapes in order of first appearance, each
    group's items in list order): the scheduler admits requests first come, first served and steps the oldest
    one's shape, so [A, B, A, B] queued as they are would not batch at all, [A, A, B, B] does. The key is the
    shape of the latents and sound the backend's batch key is made of (width, height, frames, the sound's
    length and the adapter); one it splits further only orders them differently."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params_list):
        key = (p.width, p.height, p.num_frames, p.generate_sound, p.sound_duration, p.fps, p.lora)
        groups.setdefault(key, []).append(i)
    return [i for members in groups.values() for i in members]


@dataclasses.dataclass(slots=True)
class _Started:
    """A request queued in the engine: what `_finish` waits for and makes its VideoOutput of."""

    request_id: str
    params: VideoParams
    request: Request
    future: asyncio.Future[VideoResult]
    encoded: dict[str, Any]
    """What `on_frames` wrote: the MP4 bytes ("video") and the encode's seconds ("encode")."""
    t0: float
    """When its VideoOutput's `seconds` start."""


def _frames_sink(encode: EncodeOptions, encoded: dict[str, Any]) -> Callable[[VideoResult], None]:
    """A request's `on_frames` (the engine's encode pool): the frames, as the VAE makes them, into the
    server's encoder; the MP4 and the encode's seconds into `encoded`."""

    def on_frames(result: VideoResult) -> None:
        started = time.monotonic()
        encoded["video"] = default_encoder(
            result.frames, result.fps, result.audio, sample_rate=result.sample_rate,
            crf=encode.crf, codec_options=encode.codec_options,
        )  # fmt: skip
        encoded["encode"] = time.monotonic() - started
        # (the request's stage times, as a server job's mux reports its own: Engine.get_metrics counts it)
        result.stage_seconds["encode"] = encoded["encode"]

    return on_frames


def _start_together(
    client: EngineClient, params_list: Sequence[VideoParams], encode: EncodeOptions, t0: float
) -> list[_Started]:
    """Queue `params_list` (checked; none with upsample_prompt) in the engine in one piece."""
    ids = [f"offline-video-{uuid.uuid4().hex}" for _ in params_list]
    sinks: list[dict[str, Any]] = [{} for _ in params_list]
    items = [
        (p, request_id, _frames_sink(encode, sink))
        for p, request_id, sink in zip(params_list, ids, sinks, strict=True)
    ]
    queued = client.jobless.stream_many(items) if items else []
    return [_Started(request_id, p, request, future, sink, t0)
            for p, request_id, sink, (request, future) in zip(params_list, ids, sinks, queued, strict=True)]  # fmt: skip


async def _start(client: EngineClient, params: VideoParams, encode: EncodeOptions, t0: float) -> _Started:
    """Queue `params` (checked) in the engine, its prompt written by the Reasoner first when it asks. That
    failing is a ParamError naming the field when the request's own limits refused it (400), else a
    RuntimeError."""
    if not params.upsample_prompt:
        return _start_together(client, [params], encode, t0)[0]
    request_id = f"offline-video-{uuid.uuid4().hex}"
    encoded: dict[str, Any] = {}
    try:
        prompt, request, future = await client.jobless.stream_upsampled(
            params, request_id, _frames_sink(encode, encoded), 1e9
        )
    except UpsamplingFailed as exc:
        raise upsampling_error(exc) from None
    written = dataclasses.replace(params, prompt=prompt, upsample_prompt=False)
    return _Started(request_id, written, request, future, encoded, t0)


def _abandon(client: EngineClient, started: _Started) -> None:
    """Its caller will not take `started`'s MP4: the request aborted at its next step (unless it ended), and
    counted as cancelled whenever the engine finishes it (HeldFinish.undelivered: an abort that came while its
    last frames were encoded is too late to stop them; an item of a list that finished before another failed is
    not the caller's either). Idempotent."""
    # (whatever its future says: a task cancelled while awaiting it cancels the future too; a request that
    # already ended takes the abort as a no-op)
    client.jobless.abort(started.request_id)
    undelivered = getattr(started.request.observer, "undelivered", None)
    if undelivered is not None:
        undelivered()


async def _finish(client: EngineClient, started: _Started) -> VideoOutput:
    """Wait for a queued request's MP4: its VideoOutput. A cancellation of the caller (an interrupt, its
    timeout) aborts the request at its next step."""
    try:
        result = await started.future
    except CancelledRequest as exc:  # the engine stopped (close(), or a crash) before it finished
        raise RuntimeError(f"the video request did not finish: {exc}") from None
    # the caller went away (interrupt, timeout, a failing list): stop it at its next step
    except BaseException:
        _abandon(client, started)
        raise
    delivered = getattr(started.request.observer, "delivered", None)
    if delivered is not None:  # (its finish, held for the stream's delivery: it was delivered)
        delivered()
    stages = {**result.stage_seconds, "encode": started.encoded["encode"]}
    return VideoOutput(
        video=started.encoded["video"], params=started.params, seconds=time.monotonic() - started.t0,
        stage_seconds={k: round(float(v), 4) for k, v in stages.items()}, peak_memory_mb=float(result.peak_memory_mb),
    )  # fmt: skip

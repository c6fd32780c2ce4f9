"""From an HTTP request body to validated `VideoParams` (+ what the job echoes), before any GPU work.

Bodies: multipart/form-data (the recipe's `curl -F`, the OpenAI SDK), x-www-form-urlencoded, and, beyond
vLLM-Omni, application/json with the same field names (there `prompt` may also be a JSON object: it is sent
as its compact serialisation). The body is read through a byte counter: above `--max-upload-mb` -> 413.
Resolution order (vLLM-Omni's): top-level fields, then `extra_params` over them, `size` over width/height,
fps default 24, and `num_frames` from `seconds` x fps only when absent, rounded to the nearest 4k+1 (the
model's frame grid). Everything omitted takes the model defaults of `VideoParams`. Any problem raises an
APIError / ParamError that becomes a 400 naming the field; nothing here touches the engine but `validate`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.formparsers import FormParser, MultiPartException, MultiPartParser
from starlette.requests import Request

from worldserve.api.errors import APIError, validation_error
from worldserve.api.protocol import ExtraParams, VideoCreateRequest
from worldserve.engine.client import EncodeOptions, JobSpec
from worldserve.media.image import INVALID_REFERENCE_MESSAGE, decode_image
from worldserve.params import ParamError, VideoParams

QUALITY_CRF = {"default": 18, "high": 10, "lossless": 0}
REFERENCE_CONFLICT = (
    "Provide only one of input_reference, image_reference, or video_reference when using input_reference; "
    "image_reference and video_reference may be combined."
)
UNSUPPORTED_EXTRA = ("action_mode", "edge", "blur", "depth", "seg", "wsm", "control_guidance")
TEXT_FIELDS = ("prompt", "negative_prompt")


@dataclass(frozen=True, slots=True)
class VideoInputs:
    params: VideoParams
    spec: JobSpec
    encode: EncodeOptions
    reference: bytes | None
    """The raw reference image bytes, persisted so the job can be re-run after a restart."""


async def read_fields(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request's fields as a dict (form values are str or UploadFile), whatever the content type."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _too_large(max_bytes)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    stream = _bounded(request, max_bytes)
    try:
        if ctype == "multipart/form-data":
            form = await MultiPartParser(
                request.headers, stream, max_files=8, max_fields=200, max_part_size=max_bytes
            ).parse()
        elif ctype == "application/x-www-form-urlencoded":
            form = await FormParser(request.headers, stream, max_fields=200, max_part_size=max_bytes).parse()
        elif ctype == "application/json" or ctype.endswith("+json"):
            return _json_fields(b"".join([chunk async for chunk in stream]))
        elif not ctype and not [chunk async for chunk in stream if chunk]:
            return {}
        else:
            raise APIError(400, f"Unsupported Content-Type {ctype!r}: send multipart/form-data, "
                           "application/x-www-form-urlencoded or application/json.")  # fmt: skip
    except MultiPartException as exc:
        raise APIError(400, f"Invalid form body: {exc.message}") from None
    except (APIError, ParamError):
        raise
    except Exception as exc:  # python-multipart's own parse errors
        raise APIError(400, f"Invalid form body: {exc}") from None
    # Empty form values mean "not given" for every typed field (FastAPI's Form semantics).
    return {k: v for k, v in form.items() if not (v == "" and k not in TEXT_FIELDS)}


async def _bounded(request: Request, max_bytes: int) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise _too_large(max_bytes)
        yield chunk


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"Request body exceeds the {max_bytes / 2**20:g} MiB limit (--max-upload-mb).")


def _json_fields(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body) if body.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"The JSON body must be an object, got {type(data).__name__}.")
    for key in TEXT_FIELDS:
        if isinstance(data.get(key), dict | list):  # a structured prompt sent as JSON: keep it compact
            data[key] = json.dumps(data[key], separators=(",", ":"), ensure_ascii=False)
    return data


async def build_inputs(fields: dict[str, Any], *, served_model: str, has_sound: bool) -> VideoInputs:
    upload = fields.pop("input_reference", None)
    try:
        req = VideoCreateRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    if req.model is not None and req.model != served_model:
        raise APIError(400, f"Model mismatch: request specifies '{req.model}' but server is running "
                       f"'{served_model}'.", param="model")  # fmt: skip
    extra = _extra_params(req.extra_params)
    reference = await _reference_bytes(req, upload)
    if req.num_outputs_per_prompt != 1:
        raise ParamError("num_outputs_per_prompt", "worldserve makes one video per job; submit several jobs")
    quality = req.quality or "default"
    if quality not in QUALITY_CRF:
        raise ParamError("quality", f"quality must be one of {sorted(QUALITY_CRF)}")
    source = "image_reference" if upload is None else "input_reference"
    image = await asyncio.to_thread(decode_image, reference, param=source) if reference is not None else None
    params = _video_params(req, extra, image)
    sound = params.generate_sound if params.generate_sound is not None else has_sound
    duration = req.sound_duration or extra.sound_duration or extra.audio_duration
    if sound and duration is not None and abs(duration - params.num_frames / params.fps) > 1 / params.fps:
        raise ParamError("sound_duration", "sound_duration must equal num_frames / fps in this version")
    seconds = req.seconds or str(max(1, round(params.num_frames / params.fps)))
    spec = JobSpec(model=served_model, prompt=params.prompt, size=f"{params.width}x{params.height}",
                   seconds=seconds, quality=quality, fps=params.fps, num_frames=params.num_frames,
                   user=req.user)  # fmt: skip
    codec = dict(extra.video_codec_options) if extra.video_codec_options else None
    if codec is not None:
        from worldserve.media.video import h264_options

        h264_options(codec, QUALITY_CRF[quality])  # a bad option is a 400 now, not a failed job later
    return VideoInputs(params, spec, EncodeOptions(crf=QUALITY_CRF[quality], codec_options=codec), reference)


def _extra_params(raw: str | dict | None) -> ExtraParams:
    if raw is None:
        return ExtraParams()
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise APIError(400, "Invalid JSON in form field.", param="extra_params") from None
    if not isinstance(raw, dict):
        raise APIError(400, f"Invalid JSON in form field: expected dict, got {type(raw).__name__}.",
                       param="extra_params")  # fmt: skip
    for key in UNSUPPORTED_EXTRA:
        if raw.get(key) not in (None, False):
            raise ParamError(
                f"extra_params.{key}", f"extra_params.{key}: transfer/action modes are not supported yet"
            )
    try:
        return ExtraParams.model_validate(raw)
    except ValidationError as exc:
        errors = [{**e, "loc": ("extra_params", *e["loc"])} for e in exc.errors()]
        raise validation_error(errors) from None


async def _reference_bytes(req: VideoCreateRequest, upload: Any) -> bytes | None:
    if isinstance(upload, str) and upload == "":
        upload = None
    if upload is not None and (req.image_reference is not None or req.video_reference is not None):
        raise APIError(400, REFERENCE_CONFLICT, param="input_reference")
    if req.video_reference is not None:
        raise ParamError("video_reference", "video_reference (video-to-video) is not supported yet")
    if isinstance(upload, UploadFile):
        data = await upload.read()
        if not data:
            raise ParamError("input_reference", INVALID_REFERENCE_MESSAGE)
        return data
    if upload is not None:  # a plain text field named input_reference
        raise ParamError("input_reference", "input_reference must be a file upload (multipart/form-data)")
    if req.image_reference is not None:
        return _image_reference_bytes(req.image_reference)
    return None


def _image_reference_bytes(raw: str | dict) -> bytes:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise APIError(400, "Invalid JSON in form field.", param="image_reference") from None
    if not isinstance(raw, dict):
        raise APIError(400, f"Invalid JSON in form field: expected dict, got {type(raw).__name__}.",
                       param="image_reference")  # fmt: skip
    if "file_id" in raw:
        raise ParamError("image_reference", "Invalid image_reference: file_id is not supported yet.")
    url = raw.get("image_url")
    if isinstance(url, dict):  # OpenAI-style {"image_url": {"url": ...}}
        url = url.get("url")
    if not isinstance(url, str) or not url.startswith("data:"):
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            raise ParamError("image_reference", "Invalid image_reference.image_url: this server does not download "
                             "URLs; send a data URL or an input_reference upload.")  # fmt: skip
        raise ParamError(
            "image_reference", "Invalid image_reference.image_url: must be an http(s) URL or data URL."
        )
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ParamError("image_reference", "Only base64 data URLs are supported for now.")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ParamError(
            "image_reference", "Invalid image_reference.image_url: bad base64 payload."
        ) from None


def _video_params(req: VideoCreateRequest, extra: ExtraParams, image: np.ndarray | None) -> VideoParams:
    kw: dict[str, Any] = {"prompt": req.prompt}
    top = ("negative_prompt", "num_inference_steps", "guidance_scale", "flow_shift", "seed", "max_sequence_length",
           "generate_sound", "fps", "num_frames")  # fmt: skip
    for name in top:
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    for name in ("negative_prompt", "num_inference_steps", "guidance_scale", "flow_shift", "seed",
                 "max_sequence_length", "generate_sound"):  # fmt: skip
        if getattr(extra, name) is not None:
            kw[name] = getattr(extra, name)
    if extra.sound_gen is not None and extra.generate_sound is None:
        kw["generate_sound"] = extra.sound_gen
    if req.size is not None:
        kw["width"], kw["height"] = (int(v) for v in req.size.split("x"))
    elif (req.width is None) != (req.height is None):
        raise ParamError(
            "height" if req.height is None else "width", "width and height must be given together"
        )
    elif req.width is not None:
        kw["width"], kw["height"] = req.width, req.height
    fps = kw.setdefault("fps", VideoParams.__dataclass_fields__["fps"].default)
    if "num_frames" not in kw and req.seconds is not None:
        frames = int(req.seconds) * fps
        kw["num_frames"] = 4 * max(0, round((frames - 1) / 4)) + 1
    return VideoParams(**kw, image=image).validate()

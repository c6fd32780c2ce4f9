"""From an HTTP request body to validated `VideoParams` (+ what the job echoes), before any GPU work.

Bodies: multipart/form-data (the recipe's `curl -F`, the OpenAI SDK), x-www-form-urlencoded, and, beyond
vLLM-Omni, application/json with the same field names (there `prompt` may also be a JSON object: it is sent
as its compact serialisation). The body is read through a byte counter: above `--max-upload-mb` -> 413.
References (api/video_references.py): an `input_reference` upload is sniffed image first (I2V), then video
(PyAV, V2V: `max(condition_frame_indexes_vision)*4+1` frames from the `condition_video_keep` end); an
`input_references` upload (vLLM-Omni's plural field, which it keeps as reference videos for models such as
Cosmos3) is a reference video, one file, alone (vLLM-Omni's 400 beside any other reference); JSON
`image_reference` / `video_reference` take base64 data URLs or http(s) URLs (downloaded:
api/media_urls.py). Fields holding JSON are parsed by api/json_form_fields.py. The fields then resolve into VideoParams as vLLM-Omni resolves them
(api/video_fields.py); everything omitted takes the model defaults of `VideoParams`. Any problem raises an
APIError / ParamError that becomes a 400 naming the field the value came in. Nothing here touches the
engine but `validate`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import python_multipart.multipart as multipart_parser
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from worldserve.api.bodies import (
    MAX_FORM_FIELDS,
    FormParts,
    bounded_stream,
    check_unicode,
    log_ignored_fields,
    parse_json_body,
    parse_urlencoded,
)
from worldserve.api.errors import APIError, model_mismatch, validation_error
from worldserve.api.form_brackets import BRACKETED, fold_brackets
from worldserve.api.json_form_fields import json_object_field
from worldserve.api.lora_field import LoraSettings
from worldserve.api.media_urls import MediaFetcher
from worldserve.api.protocol import ExtraParams, VideoCreateRequest, VideoParamsObject
from worldserve.api.video_fields import frames_from_seconds, resolve_video_params
from worldserve.api.video_references import decode_reference_media, reference_bytes, references_upload
from worldserve.engine.client import EncodeOptions, JobSpec
from worldserve.media.decode_budget import DEFAULT_MAX_PIXELS, DecodeBudget
from worldserve.media.work_pool import on_request_pool
from worldserve.params import (
    ParamError,
    VideoParams,
)

_Model = TypeVar("_Model", bound=BaseModel)

QUALITY_CRF = {"default": 18, "high": 10, "lossless": 0}
"""x264 crf per job quality; a request names "high" or "lossless" (vLLM-Omni's levels), else "default"."""
UNSUPPORTED_EXTRA = ("action_mode", "edge", "blur", "depth", "seg", "wsm", "control_guidance")
TEXT_FIELDS = ("prompt", "negative_prompt")


@dataclass(frozen=True, slots=True)
class VideoInputs:
    params: VideoParams
    spec: JobSpec
    encode: EncodeOptions
    reference: bytes | None
    """The raw reference image or video bytes, persisted so the job can be re-run after a restart."""
    request: VideoCreateRequest
    """The fields as validated (/v1/realtime/video echoes them in video.start)."""


FILE_FIELDS = frozenset(("input_reference", "control_reference", "input_references"))
"""The form fields that take file parts (serving-api.md §4); a file in another field of the request is a 400
naming it, a file in a field the request does not have is ignored as any unknown field is."""


def _multipart_message(exc: MultiPartException) -> str:
    """Starlette's message, with python-multipart's reason where Starlette's hides it ("Invalid multipart
    data." for a header line over the parser's limit, a 60 kB filename's)."""
    cause = exc.__cause__
    if exc.message != "Invalid multipart data." or cause is None or not str(cause):
        return exc.message
    reason = f"Invalid multipart data: {str(cause).rstrip('.')}"
    limit = getattr(multipart_parser, "DEFAULT_MAX_HEADER_SIZE", None)  # (python-multipart >= 0.0.22)
    if "header size" in str(cause) and limit:
        reason += f" (a part's header line, its filename's included, may be at most {limit:,} bytes)"
    return reason + "."


async def read_fields(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request's fields as a dict (form values are str or UploadFile), whatever the content type."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    stream = bounded_stream(request, max_bytes)
    try:
        if ctype == "multipart/form-data":
            form = await FormParts(
                request.headers, stream, max_files=8, max_fields=MAX_FORM_FIELDS, max_part_size=max_bytes
            ).parse()
        elif ctype == "application/x-www-form-urlencoded":
            form = parse_urlencoded(b"".join([chunk async for chunk in stream]))
        elif ctype == "application/json" or ctype.endswith("+json"):
            return await _json_fields(b"".join([chunk async for chunk in stream]))
        elif not ctype and not [chunk async for chunk in stream if chunk]:
            return {}
        else:
            raise APIError(400, f"Unsupported Content-Type {ctype!r}: send multipart/form-data, "
                           "application/x-www-form-urlencoded or application/json.")  # fmt: skip
    except MultiPartException as exc:  # (Starlette's own words, as FastAPI, and so vLLM-Omni, answer them,
        raise APIError(400, _multipart_message(exc)) from None  # with the parser's reason after them)
    except (APIError, ParamError):
        raise
    except Exception as exc:  # python-multipart's own parse errors
        raise APIError(400, f"Invalid form body: {exc}") from None
    for key, value in form.items():  # (a file's repr, in a validation error, would echo its headers)
        if (
            isinstance(value, UploadFile)
            and key not in FILE_FIELDS
            and key in VideoCreateRequest.model_fields
        ):
            raise APIError(400, f"{key} must be a text field, not a file upload", param=key)
    # a field the request takes once, sent more: which one was meant?
    counts = Counter(key for key, _ in form.multi_items() if key != "input_references")
    known = VideoCreateRequest.model_fields.keys() | FILE_FIELDS
    if repeated := next((key for key, n in counts.items() if n > 1 and key in known), None):
        raise APIError(400, f"{repeated} was sent {counts[repeated]} times: send it once (FastAPI, and so "
                       "vLLM-Omni, would take the last one and drop the others unsaid)", param=repeated)  # fmt: skip
    # Empty form values mean "not given" for every typed field (FastAPI's Form semantics).
    fields: dict[str, Any] = {k: v for k, v in form.items() if not (v == "" and k not in TEXT_FIELDS)
              and (k in FILE_FIELDS or not isinstance(v, UploadFile))}  # fmt: skip
    folded = fold_brackets(form.multi_items(), known)  # (the OpenAI SDK's extra_body={"extra_params": {...}})
    for head, nested in folded.items():
        if head in fields:
            raise APIError(
                400, f"{head} was sent both whole and as {head}[...] fields: send it once", param=head
            )
        fields[head] = nested
    fields = {
        k: v for k, v in fields.items() if (m := BRACKETED.fullmatch(k)) is None or m.group(1) not in known
    }
    log_ignored_fields(VideoCreateRequest, {k: v for k, v in fields.items() if k not in FILE_FIELDS})
    if files := [v for v in form.getlist("input_references") if v != ""]:
        fields["input_references"] = files  # (a repeatable field: every part, where items() keeps the last)
    check_unicode({k: v for k, v in fields.items() if isinstance(v, str)})  # (form text is decoded UTF-8)
    return fields


async def _json_fields(body: bytes) -> dict[str, Any]:
    data = await parse_json_body(body) if body.strip() else {}
    if not isinstance(data, dict):
        raise APIError(400, f"The JSON body must be an object, got {type(data).__name__}.")
    # (undeclared fields are ignored, as vLLM-Omni's, and said, as on the other JSON routes: a misplaced
    # field, such as a top-level lora_path, would go unnoticed; a form's too)
    log_ignored_fields(VideoCreateRequest, {k: v for k, v in data.items() if k not in FILE_FIELDS})
    return json_body_fields(data)


def json_body_fields(data: dict[str, Any]) -> dict[str, Any]:
    """A JSON object's fields as a create request takes them: a structured prompt (a JSON object, Cosmos3's
    JSON prompt) as its compact serialisation (also /v1/realtime/video's session.start); a list is a 400 (a
    request has one prompt: a list of prompts was one video of the list's text); an empty string is "not
    given" for every other field, as in a form (a JSON `"model": ""` had been a model mismatch, a form's the
    default)."""
    data = {k: v for k, v in data.items() if not (v == "" and k not in TEXT_FIELDS)}
    structured_texts(data)
    return data


def structured_texts(data: dict[str, Any]) -> None:
    """A JSON body's `prompt` / `negative_prompt` given as a JSON object (Cosmos3's structured prompt) made its
    compact serialisation, in place (the video and image routes); a list, or an empty object as the prompt,
    is a 400 naming the field."""
    if data.get("prompt") == {}:  # (not a structured prompt: nothing in it)
        raise ParamError("prompt", "prompt must be a non-empty string or JSON object, got an empty one")
    for key in TEXT_FIELDS:
        if isinstance(data.get(key), list):
            raise ParamError(key, f"{key} must be a string or a JSON object (a structured prompt), got a list: "
                             "one prompt a request")  # fmt: skip
        if isinstance(data.get(key), dict):
            data[key] = json.dumps(data[key], separators=(",", ":"), ensure_ascii=False)


async def build_inputs(
    fields: dict[str, Any], *, served_model: str, has_sound: bool, defaults: Mapping[str, Any] | None = None,
    fetcher: MediaFetcher | None = None, model_aliases: tuple[str, ...] = (),
    decode_pixels: int | None = DEFAULT_MAX_PIXELS, lora: LoraSettings = LoraSettings(),
) -> VideoInputs:  # fmt: skip
    """The validated params, job spec, encoding and reference of a create request's fields (`model` may name
    the served model or one of its `model_aliases`; the job carries the served name);
    `defaults` (the server's: --default-sampling-params, --flow-shift) stand in for the fields it omits; `fetcher`
    downloads http(s) reference URLs (None: they are refused); a video reference's decoding may take
    `decode_pixels` of work (--max-video-decode-gpixels: media/decode_budget.py) and stops when the request
    is abandoned; `lora` (--enable-lora, --lora-path) picks the adapter it runs with (api/lora_field.py)."""
    upload = fields.pop("input_reference", None)
    uploads = fields.pop("input_references", None)
    req = _create_request(fields, served_model, model_aliases)
    extra = parse_extra_params(req.extra_params)
    video_params = parse_video_params(req.video_params)
    # vLLM-Omni's JSON check of audio_reference, which Cosmos3 has no use for
    json_object_field(req.audio_reference, "audio_reference")
    refuse_unsupported(req)
    adapter = lora.for_request(req.lora)
    quality = _quality(req)
    # everything that needs no reference is checked before a reference URL is downloaded (a placeholder
    # image stands in for image_reference's: the size it implies is checked again with the real one; an
    # upload, image or video, is here already and is checked once decoded)
    by_url = req.image_reference is not None or isinstance(upload, dict)
    placeholder = np.zeros((9, 16, 3), np.uint8) if by_url else None
    ref_field = "image_reference" if req.image_reference is not None else "input_reference"
    defaults = defaults or {}
    resolve_video_params(req, video_params, extra, placeholder, None, ref_field, defaults, adapter)
    source, reference, image, video = await _reference_media(
        req, upload, uploads, fetcher, extra, decode_pixels
    )
    params = resolve_video_params(req, video_params, extra, image, video, source, defaults, adapter)
    if params.generate_sound is None and defaults.get("generate_sound") is not None and params.num_frames > 1:
        # the server's sound default: for videos only (an image has none), and "on" only where there is sound
        params = dataclasses.replace(params, generate_sound=defaults["generate_sound"] and has_sound)
    spec = _job_spec(req, params, served_model, quality)
    return VideoInputs(params, spec, _encode_options(extra, quality), reference, req)


def _create_request(
    fields: dict[str, Any], served_model: str, model_aliases: tuple[str, ...]
) -> VideoCreateRequest:
    """The fields validated as a create request whose `model`, if given, is the served one or an alias."""
    try:
        req = VideoCreateRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    if req.model is not None and req.model != served_model and req.model not in model_aliases:
        raise model_mismatch(req.model, served_model)
    return req


def _quality(req: VideoCreateRequest) -> str:
    """The job's quality, a QUALITY_CRF key: "high" or "lossless" as named, else "default"."""
    quality = req.quality or "default"
    if req.quality is not None and req.quality not in ("high", "lossless"):
        raise ParamError(
            "quality", "quality must be one of ['lossless', 'high'] (omit it for the default, crf 18)"
        )
    return quality


async def _reference_media(
    req: VideoCreateRequest, upload: Any, uploads: Any, fetcher: MediaFetcher | None, extra: ExtraParams,
    decode_pixels: int | None,
) -> tuple[str, bytes | None, np.ndarray | None, np.ndarray | None]:  # fmt: skip
    """(the field the reference came in, its bytes, its decoded image, its decoded video) of the request's
    reference, if any: an `input_references` upload, else an `input_reference` upload or a reference URL
    (downloaded by `fetcher`); decoded off the event loop within `decode_pixels` of work."""
    reference: bytes | None
    if uploads not in (None, []):  # (an empty string never gets here: the body readers drop them)
        source, reference = "input_references", await references_upload(req, upload, uploads)
    else:
        source, reference = await reference_bytes(req, upload, fetcher)
    image = video = None
    if reference is not None:
        budget = DecodeBudget(decode_pixels)
        image, video = await on_request_pool(
            decode_reference_media, source, reference, extra, budget, stop=budget.stop
        )
    return source, reference, image, video


def _job_spec(req: VideoCreateRequest, params: VideoParams, served_model: str, quality: str) -> JobSpec:
    """What the job records and echoes (the served model's name, its size, seconds and quality): the
    request's `seconds` where they are the frames run, else the frames' length (num_frames won over them)."""
    seconds = str(max(1, round(params.num_frames / params.fps)))
    if req.seconds is not None:
        with contextlib.suppress(ParamError):  # (seconds that give no video: num_frames won over them)
            seconds = (
                req.seconds if frames_from_seconds(req.seconds, params.fps) == params.num_frames else seconds
            )
    return JobSpec(model=served_model, prompt=params.prompt, size=f"{params.width}x{params.height}",
                   seconds=seconds, quality=quality, fps=params.fps, num_frames=params.num_frames,
                   user=req.user)  # fmt: skip


def _encode_options(extra: ExtraParams, quality: str) -> EncodeOptions:
    """The MP4 encoding: the quality's crf and `extra_params.video_codec_options`, checked now."""
    codec = dict(extra.video_codec_options) if extra.video_codec_options else None
    if codec is not None:  # a bad option is a 400 now, not a failed job later
        checked_codec_options(codec, QUALITY_CRF[quality])
    return EncodeOptions(crf=QUALITY_CRF[quality], codec_options=codec)


def checked_codec_options(codec: Mapping[str, Any], crf: int) -> dict[str, str]:
    """The libx264 options of `extra_params.video_codec_options` at `crf` (media/video.py h264_options); a
    bad one is a ParamError naming `extra_params.video_codec_options`."""
    from worldserve.media.video import h264_options

    try:
        return h264_options(codec, crf)
    except ParamError as exc:
        raise ParamError("extra_params.video_codec_options", exc.message) from None


CONTROL_TYPES = ("blur", "depth", "edge", "seg", "wsm")
"""Cosmos3 transfer control kinds vLLM-Omni names (serving-api.md §4.1, §12)."""
CONTROL_UPLOAD_LIMIT = 512 * 2**20
"""vLLM-Omni's cap on a control upload's bytes."""


def refuse_unsupported(req: VideoCreateRequest) -> None:
    """400s, with vLLM-Omni's messages where it has them, for declared fields this server cannot honour
    yet (transfer controls, RIFE interpolation): never a plain text-to-video job in their place.
    `num_outputs_per_prompt` 2..10 is accepted: vLLM-Omni's bytes paths return only the first video, and
    a job here makes that one."""
    has_upload = req.control_reference not in (None, "")
    if has_upload and not req.control_type:
        raise ParamError("control_reference", "control_reference requires control_type.")
    if req.control_type and not has_upload:
        raise ParamError("control_type", "control_type requires a control_reference upload.")
    if req.control_type:
        size = getattr(req.control_reference, "size", None)  # (an UploadFile's byte count)
        if size == 0:
            raise ParamError("control_reference", "control_reference must not be empty.")
        if size is not None and size > CONTROL_UPLOAD_LIMIT:
            raise ParamError("control_reference", "control_reference exceeds the 512 MiB size limit.")
        if req.control_type not in CONTROL_TYPES:
            raise ParamError("control_type", f"Control upload type '{req.control_type}' is not supported by this "
                             f"model. Supported control upload types: {', '.join(CONTROL_TYPES)}.")  # fmt: skip
        raise ParamError(
            "control_type", "Cosmos3 transfer (control uploads) is not supported by this server yet"
        )
    if req.enable_frame_interpolation:
        raise ParamError(
            "enable_frame_interpolation", "RIFE frame interpolation is not supported by this server yet"
        )


def _validated(model: type[_Model], raw: dict, field: str) -> _Model:
    """`model` validated from `raw`, pydantic's errors as a 400 located under `field`."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise validation_error([{**e, "loc": (field, *e["loc"])} for e in exc.errors()]) from None


def parse_video_params(raw: str | dict | None) -> VideoParamsObject:
    """The `video_params` object (its width / height / fps / num_frames fill the top-level gaps)."""
    return _validated(VideoParamsObject, json_object_field(raw, "video_params") or {}, "video_params")


def parse_extra_params(raw: str | dict | None) -> ExtraParams:
    """The `extra_params` object (Cosmos3's keys, a serialised one's text checked for lone surrogates;
    transfer / action modes refused)."""
    was_text, raw = isinstance(raw, str), json_object_field(raw, "extra_params") or {}
    if was_text:
        check_unicode({"extra_params": raw}, raw=None)
    for key in UNSUPPORTED_EXTRA:
        if raw.get(key) not in (None, False):
            raise ParamError(
                f"extra_params.{key}", f"extra_params.{key}: transfer/action modes are not supported yet"
            )
    return _validated(ExtraParams, raw, "extra_params")

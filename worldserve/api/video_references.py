"""A video request's reference (serving-api.md §4.3): where its bytes come from, and how they decode.

- `reference_bytes(req, upload, fetcher)`: (source field, bytes) of an `input_reference` upload or OpenAI's
  `{"image_url": ...}` object form, or a JSON `image_reference` / `video_reference` (a base64 data URL, or an
  http(s) URL downloaded by `fetcher`: api/media_urls.py, vLLM-Omni's 60 s); at most one of them
  (REFERENCE_CONFLICT: vLLM-Omni's message), an image and a video reference never together.
- `references_upload(req, upload, uploads)`: vLLM-Omni's plural `input_references` field, kept as reference
  videos for models such as Cosmos3: one file, alone (REFERENCES_ALONE beside any other reference).
- `decode_reference_media(source, data, extra, budget)`: (image, video) arrays, off the event loop: the image
  path for image_reference, the video path for video_reference / input_references, an upload sniffed image
  first then video (media/video_input.py), `max(condition_frame_indexes_vision)*4+1` frames from the
  `condition_video_keep` end, the decode's work counted against `budget`.
Every problem is an APIError / ParamError naming the field the reference came in.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from starlette.datastructures import UploadFile

from worldserve.api.data_urls import data_url_bytes, is_data_url
from worldserve.api.errors import APIError
from worldserve.api.json_form_fields import json_field
from worldserve.api.media_urls import MediaFetcher, is_http_url
from worldserve.api.protocol import ExtraParams, VideoCreateRequest
from worldserve.media.decode_budget import DecodeBudget
from worldserve.media.image import INVALID_REFERENCE_MESSAGE, decode_image
from worldserve.media.video_input import condition_budget, decode_reference, decode_video
from worldserve.params import ParamError

REFERENCE_CONFLICT = (
    "Provide only one of input_reference, image_reference, or video_reference when using input_reference; "
    "image_reference and video_reference may be combined."
)
REFERENCES_ALONE = (
    "Provide input_references alone, without input_reference, image_reference, or video_reference."
)


async def references_upload(req: VideoCreateRequest, upload: Any, uploads: Any) -> bytes:
    """The bytes of an `input_references` upload: one reference video (vLLM-Omni keeps these uploads as
    reference videos on models that take no mixed references, as Cosmos3); ParamError / APIError naming
    the field for a text value, more than one file, or another reference beside it."""
    files = uploads if isinstance(uploads, list) else [uploads]
    if not all(isinstance(f, UploadFile) for f in files):
        raise ParamError("input_references", "input_references must be file uploads (multipart/form-data)")
    if upload is not None or req.image_reference is not None or req.video_reference is not None:
        raise APIError(400, REFERENCES_ALONE, param="input_references")
    if len(files) > 1:
        raise ParamError("input_references", f"Cosmos3 conditions on one reference video: send one "
                         f"input_references file, got {len(files)}")  # fmt: skip
    data = await files[0].read()
    if not data:
        raise ParamError("input_references", INVALID_REFERENCE_MESSAGE)
    return data


async def reference_bytes(
    req: VideoCreateRequest, upload: Any, fetcher: MediaFetcher | None
) -> tuple[str, bytes | None]:
    """(source field, raw bytes) of the request's reference, or ("", None) without one."""
    if upload is not None and (req.image_reference is not None or req.video_reference is not None):
        raise APIError(400, REFERENCE_CONFLICT, param="input_reference")
    if isinstance(upload, UploadFile):
        data = await upload.read()
        if not data:
            raise ParamError("input_reference", INVALID_REFERENCE_MESSAGE)
        return "input_reference", data
    if isinstance(upload, dict):  # OpenAI's object form, {"image_url": ...} (a JSON body, or SDK brackets)
        return "input_reference", await url_reference(upload, "image", "input_reference", fetcher)
    if upload is not None:  # a plain text field named input_reference
        raise ParamError("input_reference", "input_reference must be a file upload (multipart/form-data) or "
                         'an object {"image_url": "data:... or http(s) URL"}')  # fmt: skip
    if req.image_reference is not None and req.video_reference is not None:
        raise ParamError(
            "video_reference", "Cosmos3 non-action generation accepts either image or video input, not both."
        )
    for raw, kind in ((req.image_reference, "image"), (req.video_reference, "video")):
        if raw is not None:
            field = f"{kind}_reference"
            return field, await url_reference(raw, kind, field, fetcher)
    return "", None


async def url_reference(raw: Any, kind: str, field: str, fetcher: MediaFetcher | None) -> bytes:
    """The bytes of `{"<kind>_url": URL}` in `field`: a data URL's payload, or the http(s) URL downloaded (on
    a budget of the fetcher's own making: cancelled with the request, its client gone, the download stops)."""
    url = reference_url(raw, kind, field)
    if is_data_url(url):
        return data_url_bytes(
            url, param=field, bad_payload=f"Invalid {field}.{kind}_url: bad base64 payload."
        )
    if fetcher is None:
        raise ParamError(field, f"Invalid {field}.{kind}_url: this server does not download URLs; send a "
                         "data URL or an input_reference upload.")  # fmt: skip
    return await fetcher.fetch(
        url, param=field, what=f"{field}.{kind}_url", kind=kind, timeout_s=REFERENCE_FETCH_TIMEOUT_S
    )


def decode_reference_media(
    source: str, data: bytes, extra: ExtraParams, budget: DecodeBudget
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(image, video) of a reference: the image path for image_reference, the video path for
    video_reference, image-then-video sniffing for an upload."""
    if source == "image_reference":
        return decode_image(data, param=source), None
    indexes = extra.condition_frame_indexes_vision
    if indexes is not None and (not indexes or min(indexes) < 0):
        raise ParamError(
            "extra_params.condition_frame_indexes_vision",
            "condition_frame_indexes_vision must be a non-empty list of non-negative ints, e.g. [0, 1]",
        )
    frames = min(condition_budget(indexes or (0, 1)), MAX_CONDITION_FRAMES)
    keep = extra.condition_video_keep or "first"
    if source in ("video_reference", "input_references"):
        return None, decode_video(data, frames, keep, param=source, budget=budget)
    return decode_reference(data, max_frames=frames, keep=keep, param=source, budget=budget)


MAX_CONDITION_FRAMES = 401
"""A decode cap above any tier's frame limit; larger index lists fail validation anyway."""


REFERENCE_FETCH_TIMEOUT_S = 60.0
"""vLLM-Omni's download timeout for http(s) reference URLs."""


def reference_url(raw: str | dict | list, kind: str, field: str) -> str:
    """The URL of `{"<kind>_url": "data:..." | "http(s)://..."}` in `field` (image_reference /
    video_reference, or OpenAI's input_reference object; an image reference may also be a list of one such
    object)."""
    raw = json_field(raw, field)
    if isinstance(raw, list) and kind == "image":  # newer vLLM-Omni builds take a list of references
        if len(raw) != 1:
            raise ParamError(
                field, f"Cosmos3 image-to-video takes one image_reference; got a list of {len(raw)}."
            )
        raw = raw[0]
    if not isinstance(raw, dict):
        raise APIError(400, f"Invalid JSON in form field: expected dict, got {type(raw).__name__}.",
                       param=field)  # fmt: skip
    if "file_id" in raw:
        raise ParamError(field, f"Invalid {field}: file_id is not supported yet.")
    url = raw.get(f"{kind}_url")
    if isinstance(url, dict):  # OpenAI-style {"image_url": {"url": ...}}
        url = url.get("url")
    if not isinstance(url, str) or not (is_data_url(url) or is_http_url(url)):
        raise ParamError(field, f"Invalid {field}.{kind}_url: must be an http(s) URL or data URL.")
    return url

"""Base64 `data:` URLs: the inline media transport of both the video API (image_reference /
video_reference) and the chat API (image_url / video_url parts)."""

from __future__ import annotations

import base64
import binascii

from worldserve.params import ParamError

NOT_BASE64 = "Only base64 data URLs are supported for now."


URL_BLANKS = "".join(map(chr, range(0x21)))
"""What a URL parser strips before the scheme (WHATWG's C0 controls and space: urllib.parse's urlsplit)."""


def is_data_url(url: str) -> bool:
    """Whether `url` is a `data:` URL, its scheme in any case and blanks before it (as the chat routes read
    them through urlsplit: `DATA:` and ` data:` were refused by the video routes only)."""
    return url.lstrip(URL_BLANKS)[:5].lower() == "data:"


def data_url_bytes(url: str, *, param: str, bad_payload: str) -> bytes:
    """The bytes of `data:<mime>;base64,<payload>`; ParamError(param, ...) when it is not base64 (or has no
    comma) or `bad_payload` when the payload does not decode. A payload wrapped into lines (MIME base64, as
    `base64 file.mp4` writes it; vLLM's video path takes it) decodes with its whitespace dropped; any other
    character outside the alphabet is refused."""
    header, sep, payload = url.lstrip(URL_BLANKS)[len("data:") :].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ParamError(param, NOT_BASE64)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        pass
    unwrapped = payload.translate(_NO_WHITESPACE)  # (only after the strict decode failed: a copy)
    try:
        if len(unwrapped) < len(payload):
            return base64.b64decode(unwrapped, validate=True)
    except (binascii.Error, ValueError):
        pass
    raise ParamError(param, bad_payload)


_NO_WHITESPACE = dict.fromkeys(map(ord, " \t\r\n\v\f"))


FRAME_LIST_HEADER = "data:video/jpeg;base64,"
"""vLLM's video of separate frames: `data:video/jpeg;base64,<frame>,<frame>,...`, each an image in base64."""


def frame_list_bytes(url: str, *, param: str) -> list[bytes] | None:
    """The frames of a FRAME_LIST_HEADER URL (vLLM's VideoMediaIO splits it on commas), None for any other
    URL; ParamError(param) when a frame is not base64."""
    if url[: len(FRAME_LIST_HEADER)].lower() != FRAME_LIST_HEADER:
        return None
    frames = url[len(FRAME_LIST_HEADER) :].split(",")
    try:
        return [base64.b64decode(frame, validate=True) for frame in frames]
    except (binascii.Error, ValueError):
        raise ParamError(param, "Invalid base64 data in a frame of the video/jpeg data URL.") from None

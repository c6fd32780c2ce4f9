"""Request fields that hold JSON (`video_params`, `extra_params`, the references' `{"image_url": ...}`
objects): a JSON body's value taken as it is, a form field's text parsed, each failure a 400 in vLLM-Omni's
words naming the field. Used by the video routes (api/video_inputs.py, api/video_references.py) and
/v1/realtime/video's session.start."""

from __future__ import annotations

import json
from typing import Any

from worldserve.api.bodies import check_depth
from worldserve.api.errors import APIError


def json_field(raw: Any, field: str) -> Any:
    """A field that holds JSON: a JSON body's value as it is, a form field's text parsed (a 400 with
    vLLM-Omni's message when it is not JSON, or nested too deep to parse)."""
    if not isinstance(raw, str):
        return raw
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # bad JSON, or a number past Python's int-from-text digit limit
        raise APIError(400, "Invalid JSON in form field.", param=field) from None
    check_depth(value, field)  # as deep as the same value sent as an object may be
    return value


def json_object_field(raw: str | dict | None, field: str) -> dict | None:
    """A field that holds a JSON object (json_field); a non-object is a 400 with vLLM-Omni's message. A JSON
    body's null is the field left out; a form's text `null` is a non-object (NoneType), as for the references."""
    value = json_field(raw, field)
    if not isinstance(value, dict) and (value is not None or isinstance(raw, str)):
        raise APIError(400, f"Invalid JSON in form field: expected dict, got {type(value).__name__}.",
                       param=field)  # fmt: skip
    return value

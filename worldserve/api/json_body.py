"""The JSON-only routes' body reader (chat completions, image generations): vLLM's `validate_json_request`."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from worldserve.api.errors import APIError


async def read_json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object; a 400 for another content type, bad JSON or a non-object."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(400, f"Unsupported content type {ctype or 'none'!r}: send application/json")
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object")
    return data

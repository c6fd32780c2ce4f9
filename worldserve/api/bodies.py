"""Request-body readers shared by the routes: a size-bounded stream (413 past `--max-upload-mb`) and the JSON
object of the JSON-only routes (chat completions, image generations; vLLM's `validate_json_request`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from worldserve.api.errors import APIError


def too_large(max_bytes: int) -> APIError:
    return APIError(413, f"Request body exceeds the {max_bytes / 2**20:g} MiB limit (--max-upload-mb).")


async def bounded_stream(request: Request, max_bytes: int) -> AsyncIterator[bytes]:
    """The body's chunks; a 413 as soon as they pass `max_bytes` (a declared Content-Length fails first)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large(max_bytes)
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise too_large(max_bytes)
        yield chunk


def check_unicode(value: Any, path: str = "") -> None:
    """A 400 naming the field when a string in `value` (a parsed body) is not encodable text: JSON may
    escape a lone UTF-16 surrogate ("\\ud800"), which no tokenizer or UTF-8 response can carry."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = path or "body"
            raise APIError(
                400,
                f"{where}: not valid Unicode text (a lone surrogate at character {exc.start})",
                param=where,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, path or "body")
            check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{path}[{i}]")


async def read_json_object(request: Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; a 400 for another content type, bad JSON or a non-object, a 413 past
    `max_bytes`."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise APIError(400, f"Unsupported content type {ctype or 'none'!r}: send application/json")
    body = b"".join([chunk async for chunk in bounded_stream(request, max_bytes)])
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object")
    check_unicode(data)
    return data

"""A `--middleware` for tests/test_serve_http_flags.py (not a test module): stamps every answer."""

from __future__ import annotations


async def stamp(request, call_next):
    response = await call_next(request)
    response.headers["X-Stamped"] = request.url.path
    return response

"""vLLM's server-load tracking (`--enable-server-load-tracking`): `GET /load` answers `{"server_load": N}`,
the requests that use the model in flight right now, for load balancers that route by it. Counted:
- the HTTP requests of the routes vLLM decorates with `load_aware_call` that worldserve serves (chat and text
  completions, POST /v1/responses) and the generation routes (POST /v1/videos and /v1/videos/sync, image
  generation), and realtime video sessions: +1 when such a request arrives, -1 when its response is finished
  (a streamed one included) or it fails, or its socket closes (an ASGI middleware);
- beyond vLLM (serving-api.md leaves /load unspecified for vLLM-Omni's video routes), every async video job
  created by POST /v1/videos, from its creation until it completes, fails or is deleted: the create answers
  at once, and a balancer that saw only HTTP requests would pile jobs onto a busy server (a sync request's
  job is its HTTP request, counted once; after its 504 the job runs on, counted as an async job's). Jobs
  queued before a restart are not counted again.
Off (vLLM's default), the count stays 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from starlette.types import ASGIApp, Receive, Scope, Send

from worldserve.api.auth import route_path

LOAD_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/videos", "/v1/videos/sync",
     "/v1/images/generations"}
)  # fmt: skip
"""The paths whose POSTs count (the job API's GET / DELETE of /v1/videos, GET / cancel / DELETE of a stored
response do not: as vLLM, only the create routes)."""
STREAM_PATH = "/v1/realtime/video"
"""The WebSocket whose sessions count too, each for as long as its socket is open."""


class ServerLoad:
    """The in-flight count (touched on the event loop only)."""

    def __init__(self) -> None:
        self.value = 0
        self._jobs: set[asyncio.Future] = set()  # the async jobs' waits (kept referenced)

    def count_until(self, done: Awaitable[object]) -> None:
        """Count one more until `done` settles (an async job: EngineClient.wait of its id; also on a failure,
        e.g. the shutdown's ShuttingDownError)."""
        self.value += 1
        future = asyncio.ensure_future(done)
        self._jobs.add(future)

        def ended(future: asyncio.Future) -> None:
            self.value -= 1
            self._jobs.discard(future)
            if not future.cancelled():
                future.exception()  # read: asyncio must not log it

        future.add_done_callback(ended)


class ServerLoadMiddleware:
    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        counted = (scope["type"] == "http" and scope.get("method") == "POST" and path in LOAD_PATHS) or (
            scope["type"] == "websocket" and path == STREAM_PATH
        )
        if not counted:
            await self.app(scope, receive, send)
            return
        self.load.value += 1
        try:
            await self.app(scope, receive, send)  # returns once the whole response, streamed or not, is sent
        finally:
            self.load.value -= 1

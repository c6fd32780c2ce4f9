"""vLLM's server-load tracking (`--enable-server-load-tracking`): `GET /load` answers `{"server_load": N}`,
the requests that use the model in flight right now (chat and text completions, video and image
generation, realtime video sessions), for load balancers that route by it. The count is kept by an ASGI
middleware: +1 when such a request arrives, -1 when its response is finished (a streamed one included) or it
fails, or its socket closes. Off (vLLM's
default), the count stays 0.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

LOAD_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/videos", "/v1/images/generations")
"""Path prefixes of the routes whose requests count (the job API's GET / DELETE of /v1/videos do not)."""
STREAM_PATH = "/v1/realtime/video"
"""The WebSocket whose sessions count too, each for as long as its socket is open."""


class ServerLoad:
    """The in-flight count (touched on the event loop only)."""

    def __init__(self) -> None:
        self.value = 0


class ServerLoadMiddleware:
    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        counted = (
            scope["type"] == "http" and scope.get("method") == "POST" and path.startswith(LOAD_PATHS)
        ) or (scope["type"] == "websocket" and path == STREAM_PATH)
        if not counted:
            await self.app(scope, receive, send)
            return
        self.load.value += 1
        try:
            await self.app(scope, receive, send)  # returns once the whole response, streamed or not, is sent
        finally:
            self.load.value -= 1

"""`--h11-max-header-count N` (vLLM's flag): a request carrying more than N headers is answered 431 in the error
envelope before any route, middleware or API key check sees it; a WebSocket handshake with more is refused
(a 431 where the server can answer a handshake with a response, else closed before it is accepted).

uvicorn's h11 protocol has no count of its own (vLLM hands its value to uvicorn, which has no such option);
the bytes of a request's headers are capped at 64 KiB below the app either way (api/http_protocol.py), which
bounds the count too. Installed outermost by commands/serve_http.install, only when the flag is given.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from worldserve.api.auth import refuse
from worldserve.api.errors import error_body

TOO_MANY_HEADERS = 431


class HeaderCountLimit:
    """ASGI middleware: HTTP requests and WebSocket handshakes with more than `limit` headers refused."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and len(scope["headers"]) > self.limit:
            message = (f"The request carries {len(scope['headers'])} headers, more than the "
                       f"{self.limit} this server takes (--h11-max-header-count)")  # fmt: skip
            answer = JSONResponse(error_body(TOO_MANY_HEADERS, message), status_code=TOO_MANY_HEADERS)
            await refuse(scope, receive, send, answer, "Too many headers")
            return
        await self.app(scope, receive, send)

"""`--allowed-origins` enforced, not only advertised: a pure-ASGI middleware that refuses a request a browser
page of another origin sent, when the list is not ["*"].

CORS alone (Starlette's middleware, vLLM's) only keeps such a page from reading the answer: a form POST
(`/v1/videos`, `/v1/videos/sync` take multipart and urlencoded bodies, which a browser sends cross-site without
a preflight) still created a job, and a WebSocket handshake (`/v1/realtime/video`) is never checked against
the list. Here, with a list of origins, any request (but the OPTIONS preflight, CORS's own) whose `Origin`
header is neither one of them nor the server's own origin (scheme and Host of the request, the Host an IP
address or localhost: its /docs page; a name could be another site's under DNS rebinding) is answered 403 with the error envelope naming the origin; a WebSocket handshake is refused the same way
(HTTP 403). Requests without `Origin` (curl, SDKs, servers) pass: browsers send it on every cross-origin
POST and every WebSocket handshake. ["*"] (the default, vLLM's) leaves every request through.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from worldserve.api.auth import refuse
from worldserve.api.errors import error_response

HTTP_SCHEMES = {"ws": "http", "wss": "https"}
"""A WebSocket scope's scheme -> the scheme of the page origin that opened it on the same server."""


class OriginGuardMiddleware:
    def __init__(self, app: ASGIApp, allowed_origins: Sequence[str] = ("*",)):
        self.app = app
        self._allowed = None if "*" in allowed_origins else frozenset(o.rstrip("/") for o in allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self._allowed is not None
            and scope["type"] in ("http", "websocket")
            and scope.get("method") != "OPTIONS"
        ):
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            if origin is not None and origin not in self._allowed and origin != _own_origin(scope, headers):
                message = f"Origin {origin!r} is not allowed (--allowed-origins)"
                await refuse(scope, receive, send, error_response(403, message), message)
                return
        await self.app(scope, receive, send)


def _own_origin(scope: Scope, headers: Headers) -> str | None:
    """The origin of a page this server served (its /docs): the request's scheme (http for ws) and its Host
    header, when that Host is an IP address or `localhost`. A name is not taken on its word: under DNS
    rebinding another site's name resolves to this server, and its page's Origin and Host then match
    (`http://evil.example:8000` both); a server reached by name lists that origin in --allowed-origins."""
    host = headers.get("host", "")
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.removeprefix("[").removesuffix("]").lower()
    try:
        ipaddress.ip_address(name)
    except ValueError:
        if name != "localhost":
            return None
    scheme = scope.get("scheme", "http")
    return f"{HTTP_SCHEMES.get(scheme, scheme)}://{host}"

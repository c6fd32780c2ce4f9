"""Bearer-key check for /v1/* and the X-Request-Id header, as two small pure-ASGI middlewares.

Auth follows vLLM: with API keys configured, any request whose route path (less the root path, as the router
matches it) starts with /v1 (and, beyond vLLM, /tokenize and /detokenize: they run the Reasoner's tokenizer
and a chat's whole media pipeline, downloads, local files and decodes, which vLLM leaves open; and
/invocations, SageMaker's route to the same chats, which vLLM leaves open for SageMaker to guard) must carry
`Authorization: Bearer KEY`, KEY one of them (the scheme in any case, as vLLM's), else 401 with the bare body
{"error": "Unauthorized"} (not the envelope; a WebSocket handshake gets that response where the server can
send one, else it is refused: HTTP 403). OPTIONS, /health, /metrics, /version, /docs and /openapi.json
stay open. Keys are compared in constant time, as SHA-256 digests (the time tells nothing of the key's length).
Request ids: the incoming X-Request-Id is echoed, otherwise a uuid4 hex is generated; a route that sets its
own (the sync route's `video_sync-<hex>`) keeps it. The id is also kept in the request's scope, where the
error handlers find it (`request_id_of`: their log lines, and the X-Request-Id of an unhandled error's 500,
which Starlette answers outside every middleware).
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from collections.abc import Sequence

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/invocations")


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: Sequence[str] = ()):
        self.app = app
        self._expected = tuple(_digest(k) for k in api_keys if k)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self._expected
            and scope["type"] in ("http", "websocket")
            and scope.get("method") != "OPTIONS"
            and route_path(scope).startswith(PROTECTED_PREFIXES)
        ):
            scheme, _, key = Headers(scope=scope).get("authorization", "").partition(" ")
            given = _digest(key)
            # every key compared (the time tells not which one matched)
            matched = [secrets.compare_digest(given, expected) for expected in self._expected]
            if scheme.lower() != "bearer" or not any(matched):
                unauthorized = JSONResponse({"error": "Unauthorized"}, status_code=401)
                await refuse(scope, receive, send, unauthorized, "Unauthorized")
                return
        await self.app(scope, receive, send)


async def refuse(scope: Scope, receive: Receive, send: Send, response: Response, reason: str) -> None:
    """Answer `scope` with `response`; a WebSocket handshake too where the server can send a response (the
    websocket.http.response extension), else it is closed before it is accepted (the client sees HTTP 403)."""
    if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
        await send(
            {"type": "websocket.close", "code": 1008, "reason": reason[:120]}
        )  # (the frame's limit: 123)
        return
    await response(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The path the router matches: Starlette strips the scope's root_path (FastAPI's, `--root-path`) once
    when the path starts with it, so the key is checked on the same path (vLLM checks the URL path less the
    root path). Checking scope["path"] alone would let a path the router matches less its prefix through
    unchecked."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (path == root or path[len(root)] == "/"):
        return path[len(root) :]
    return path


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


REQUEST_ID_KEY = "worldserve.request_id"
"""Where RequestIdMiddleware keeps a request's id in its ASGI scope (the same dict every layer sees)."""


def request_id_of(scope: Scope) -> str | None:
    """A request's id: its route's own (request.state.request_id), else the one RequestIdMiddleware echoed or
    generated (None: neither, request ids off)."""
    return scope.get("state", {}).get("request_id") or scope.get(REQUEST_ID_KEY)


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = scope[REQUEST_ID_KEY] = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if "x-request-id" not in headers:  # a route's own id (request.state.request_id) first
                    headers["X-Request-Id"] = request_id_of(scope) or request_id
            await send(message)

        await self.app(scope, receive, send_with_id)

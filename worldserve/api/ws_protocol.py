"""The server's WebSocket protocol: uvicorn's own (websockets' sans-I/O one, or wsproto's), except at a
graceful shutdown.

uvicorn closes every open WebSocket with 1012 the moment a shutdown begins, so a /v1/realtime/video stream
whose video was being generated lost it, although `--shutdown-timeout` gives running requests time to finish
(a sync request over HTTP keeps its connection until its answer). Here an open WebSocket is left to the app:
the realtime session finishes its stream while its request runs on in the engine's grace, or sends an error
and closes with 1012 when the request is aborted at the deadline, was still queued, or had not started
(api/realtime.py). CLOSE_MARGIN_S before uvicorn cancels the app's tasks (`timeout_graceful_shutdown`) a
socket still open is closed as uvicorn closes it, and its connection dropped ABORT_AFTER_S later if the
close could not be flushed (a client that reads nothing), so nothing outlives the shutdown. Without a
`timeout_graceful_shutdown` (uvicorn then waits for ever) the close is uvicorn's, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

CLOSE_MARGIN_S = 5.0
ABORT_AFTER_S = 2.0
"""How long a closed socket may take to flush before its connection is dropped (a client that reads nothing
never lets it flush: the socket and the app's task had outlived the session, and the shutdown waited for
uvicorn's task cancellation)."""


TRANSPORT_KEY = "worldserve.transport"
"""The scope key under which GracefulWebSocketProtocol hands the app its connection's transport."""


def abort_connection(ws: Any) -> bool:
    """Drop the connection under the Starlette WebSocket `ws` at once (its transport aborted, the unsent
    bytes discarded): for a client that reads nothing, whose close frame can never be sent. False where the
    server gave no transport (another ASGI server)."""
    transport = ws.scope.get(TRANSPORT_KEY)
    if transport is None:
        return False
    _drop(transport)
    return True


def _drop(transport: Any) -> None:
    """Reset the connection at once: SO_LINGER 0 on its socket, then the transport aborted (a plain close
    leaves the kernel sending the bytes it holds, for ever to a client that reads nothing)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def graceful_ws_protocol() -> type | str:
    """The WebSocket protocol class for uvicorn.Config(ws=...): "auto" where no WebSocket library is there."""
    from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

    if AutoWebSocketsProtocol is None:
        return "auto"
    base: type = AutoWebSocketsProtocol  # type: ignore[assignment]

    class GracefulWebSocketProtocol(base):
        _late_close: asyncio.TimerHandle | None = None

        def shutdown(self) -> None:
            grace = self.config.timeout_graceful_shutdown
            if grace is None or not self._open_session():
                self._close_then_abort()
            elif self._late_close is None:
                self._late_close = asyncio.get_running_loop().call_later(
                    max(grace - CLOSE_MARGIN_S, 0.0), self._close_then_abort
                )

        async def run_asgi(self) -> None:
            self.scope[TRANSPORT_KEY] = self.transport  # type: ignore[literal-required]  # (abort_connection)
            await super().run_asgi()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._late_close is not None:
                self._late_close.cancel()
            self._lost = True
            super().connection_lost(exc)

        def _close_then_abort(self) -> None:
            """uvicorn's close, then the connection dropped ABORT_AFTER_S later if it has not flushed."""
            super().shutdown()
            asyncio.get_running_loop().call_later(ABORT_AFTER_S, self._abort_unless_lost)

        def _abort_unless_lost(self) -> None:
            transport = getattr(self, "transport", None)
            if not getattr(self, "_lost", False) and transport is not None:
                _drop(transport)

        def _open_session(self) -> bool:
            """Accepted, not closing, and not answered over HTTP instead (a refused handshake)."""
            return (
                not getattr(self, "_lost", False)  # (dropped by abort_connection: nothing left to close)
                and bool(getattr(self, "handshake_complete", False))
                and not getattr(self, "close_sent", False)
                and getattr(self, "initial_response", None) is None  # (websockets' sans-I/O)
                and not getattr(self, "response_started", False)  # (wsproto)
            )

    return GracefulWebSocketProtocol

"""The server's WebSocket protocol: uvicorn's own (websockets' sans-I/O one, or wsproto's), except at a
graceful shutdown.

uvicorn closes every open WebSocket with 1012 the moment a shutdown begins, so a /v1/realtime/video stream
whose video was being generated lost it, although `--shutdown-timeout` gives running requests time to finish
(a sync request over HTTP keeps its connection until its answer). Here an open WebSocket is left to the app:
the realtime session finishes its stream while its request runs on in the engine's grace, or sends an error
and closes with 1012 when the request is aborted at the deadline, was still queued, or had not started
(api/realtime.py). CLOSE_MARGIN_S before uvicorn cancels the app's tasks (`timeout_graceful_shutdown`) a
socket still open is closed as uvicorn closes it, so nothing outlives the shutdown. Without a
`timeout_graceful_shutdown` (uvicorn then waits for ever) the close is uvicorn's, at once.
"""

from __future__ import annotations

import asyncio

CLOSE_MARGIN_S = 5.0


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
                super().shutdown()
            elif self._late_close is None:
                self._late_close = asyncio.get_running_loop().call_later(
                    max(grace - CLOSE_MARGIN_S, 0.0), super().shutdown
                )

        def connection_lost(self, exc: Exception | None) -> None:
            if self._late_close is not None:
                self._late_close.cancel()
            super().connection_lost(exc)

        def _open_session(self) -> bool:
            """Accepted, not closing, and not answered over HTTP instead (a refused handshake)."""
            return (
                bool(getattr(self, "handshake_complete", False))
                and not getattr(self, "close_sent", False)
                and getattr(self, "initial_response", None) is None  # (websockets' sans-I/O)
                and not getattr(self, "response_started", False)  # (wsproto)
            )

    return GracefulWebSocketProtocol

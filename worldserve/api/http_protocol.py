"""uvicorn's HTTP protocol with a deadline on request headers (a slow-loris guard uvicorn and vLLM lack).

uvicorn closes a keep-alive connection idle past its timeout, but not one that was opened and never sent a
request, nor one that sends a request's headers a byte at a time: each holds a file descriptor for as long
as the client likes, and enough of them (a few hundred slow clients, or a leak in a client pool) use up the
process's descriptors, after which the server accepts no connection at all. `header_deadline_protocol` gives
every request `header_timeout_s` (envs.http_header_timeout_s) from the connection's opening, or from its first
byte after the previous response, until uvicorn has parsed the request's headers; past it the connection gets
a 408 and is closed. A request whose headers arrived is never timed here (its body and response take as
long as they take). Built on uvicorn's own choice of HTTP implementation (httptools when installed, else h11),
whose `cycle` attribute (the request-response cycle it starts once a request's headers are parsed) tells the
two apart.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class HeaderDeadline:
    """The deadline, mixed in before one of uvicorn's HTTP protocol classes (header_deadline_protocol)."""

    header_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        idle = self.cycle is None or self.cycle.response_complete  # bytes of a next request's headers
        if idle and self._header_deadline is None:
            self._arm()
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # its headers are parsed: the request runs untimed from here
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()


def header_deadline_protocol(header_timeout_s: float, base: type = AutoHTTPProtocol) -> type:
    """`base` (uvicorn's choice by default, or its H11Protocol / HttpToolsProtocol) with this deadline, for
    uvicorn.Config(http=...)."""
    return type("HeaderDeadlineProtocol", (HeaderDeadline, base), {"header_timeout_s": header_timeout_s})

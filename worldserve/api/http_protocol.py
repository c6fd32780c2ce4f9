"""The server's HTTP/1.1 protocol: uvicorn's h11 one, with deadlines on request headers and bodies and a size
cap on headers (slow-loris and header-bloat guards uvicorn and vLLM lack).

h11, not httptools (which uvicorn picks when installed, and vLLM installs): fuzzing both with the same raw
requests (twenty-fifth session) found httptools' uvicorn protocol reading on while a request runs, so a
pipelined next request's headers (or a chunked body's trailers) grew without bound in memory past any cap
(2 GB from 100 MB of small headers) and stalled the event loop; it parsed the body of a request with
`Connection: Upgrade` or of a CONNECT as a new request (smuggling past a proxy's routing); it merged chunked
trailers into the request's headers; and a bad pipelined request lost the answer of the good one before it.
h11 stops reading until a response is done and refuses those shapes; it was 3-6 % slower on streamed chats
of the tiny checkpoint (`bench/results/README.md`).

uvicorn closes a keep-alive connection idle past its timeout, but not one that was opened and never sent a
request, nor one that sends a request's headers a byte at a time: each holds a file descriptor for as long
as the client likes, and enough of them (a few hundred slow clients, or a leak in a client pool) use up the
process's descriptors, after which the server accepts no connection at all. `header_guard_protocol` gives
every request `header_timeout_s` (envs.http_header_timeout_s) from the connection's opening, or from its first
byte after the previous response (from that response's end for bytes pipelined while it ran), until h11 has
parsed the request's headers; past it the connection gets a 408. Its body then gets the same time between two of its bytes (a request that declared more body than it
sends, or a chunked body without its last chunk, held the connection open forever): silent that long while
the server waits for it, the connection gets a 408 and is closed (a slow but steady upload, an app slow to
read, and the answer's own time are never cut).
An answer the client reads nothing of gets the same time: writing paused (the socket's and the transport's
buffers full) for `header_timeout_s` without a byte taken, the connection is dropped (a client that never
read a video's content held its descriptors, and the file of a deleted video, for as long as it liked; a
slow reader that takes bytes now and then is never cut).
Headers are also capped at MAX_HEADER_BYTES (request line included) with a 431; bytes h11 cannot read as a
request get their 400 in the error envelope, naming h11's reason (uvicorn's was bare text). After a 408 or a 431, and
whenever the connection closes while its client still sends a request's body (an answer given before the body
was read, such as a 401 or a 413, on a `Connection: close` request), the client's bytes are read and dropped
until it has been silent for LINGER_S (at most LINGER_MAX_S) before the close, so the client reads the answer
instead of a reset: closing with unread bytes resets the connection, and a client that sends its whole body
before reading (Python's urllib) got a broken pipe instead of the 401 to an 8 MB upload (as nginx's lingering
close does; over TLS, which has no half-close, the connection closes outright). A body a kept-alive client
still owes after such an early answer has LINGER_MAX_S to end (a client that sent a byte more and then
nothing held the connection for good); a server shutdown cuts a lingering connection's wait to its client's
next LINGER_S of silence. Every close that still has answer bytes to write is aborted once the client has
taken none of them for `header_timeout_s` (the close waits for them, and a client that read nothing held
the connection for good). A WebSocket upgrade leaves all of this behind: the connection is the WebSocket's.
The end of what the client sends (EOF) is its leaving, as uvicorn has it: the app gets `http.disconnect`
and stops the request's work (a server cannot tell a half-close from a close on the wire, and abandoned
chats and videos must not run on; the twenty-fifth session's answers after a half-close kept them
running). The protocol's `cycle` attribute (the request-response cycle uvicorn starts once a request's
headers are parsed) tells a request being read from one running.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from worldserve.api.errors import error_body, reason_phrase

MAX_HEADER_BYTES = 64 * 1024
"""A request's line and headers, at most."""
HEAD_END = re.compile(rb"\n\r?\n")
"""h11's end of headers (bare LFs too): what follows it in a read is the body, not counted."""


def _closing_error(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 answer with the error envelope (api/errors.py) that closes its connection: written
    into the socket below the app, where no route answers."""
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {reason_phrase(status)}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")  # fmt: skip
    return head.encode() + body


TIMEOUT_RESPONSE = _closing_error(
    408, "The request did not arrive in time (its headers or body stopped coming)"
)
TOO_LARGE_RESPONSE = _closing_error(431, f"The request's line and headers are over {MAX_HEADER_BYTES} bytes")
MAX_REASON_CHARS = 200
"""At most this much of h11's reason for refusing a request goes into its 400 (it may quote the request)."""
H11_BUFFER_BYTES = MAX_HEADER_BYTES + 2**20
"""uvicorn.Config's h11_max_incomplete_event_size (serve_http.uvicorn_options): h11 refuses headers past it with
a 400 and an abrupt close; above the cap plus one socket read (256 KiB), the cap answers first."""
LINGER_S = 2.0
"""After a refusal or an early answer, how long a client may be silent while what it still sends is read and
dropped, before the connection closes: closing with unread bytes would reset it, and the client could lose the
answer."""
LINGER_MAX_S = 10.0
"""That lingering's end however much the client still sends."""


class HeaderGuard(H11Protocol):
    """uvicorn's h11 protocol with the deadline and the cap (header_guard_protocol sets the deadline)."""

    header_timeout_s: float = 60.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the connection's deadlines, by name: "header" (a request's line and headers), "body" (its next body
        # byte), "write" (the client taking some of the answer), "drain" (a body owed after an early answer),
        # "linger" (the client's silence while lingering), "abort" (a close the client takes nothing of)
        self.timers = Timers(self.loop)
        self._header_bytes = 0  # received since the headers of the request being read began
        self._tail = b""  # the last 2 of those bytes: an end of headers split across reads
        self.dropping = False  # lingering (after a 408 / 431, an early answer): what comes is dropped
        self._linger_end = 0.0
        self.upgraded = False

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot read as a request (a bad request line or header, no Host, a
        malformed Content-Length), in the error envelope every other error has and naming what h11 refused
        (uvicorn wrote a bare text/plain "Invalid HTTP request received."); h11's status hint is kept (501
        for a transfer coding other than chunked). uvicorn calls it inside its `except RemoteProtocolError`,
        where the exception is the one being handled. The connection then closes, as uvicorn closes it."""
        refused = sys.exc_info()[1]
        status = getattr(refused, "error_status_hint", 400)
        message = msg.rstrip(".") + (f": {str(refused)[:MAX_REASON_CHARS]}" if refused is not None else ".")
        body = json.dumps(error_body(status, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close")]  # fmt: skip
        for event in (h11.Response(status_code=status, headers=headers, reason=reason_phrase(status).encode()),
                      h11.Data(data=body), h11.EndOfMessage()):  # fmt: skip
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()

    def pause_writing(self) -> None:
        """The client takes no more of the answer for now: it has `header_timeout_s` to take some."""
        super().pause_writing()
        self.timers.set("write", self.header_timeout_s, self._reads_nothing)

    def resume_writing(self) -> None:
        self.timers.cancel("write")
        super().resume_writing()

    def _reads_nothing(self) -> None:
        """Nothing of the answer taken for `header_timeout_s`: the connection is dropped (its unsent bytes
        with it), the app's sends return at once and its response ends (uvicorn's disconnect)."""
        if self.flow.write_paused:  # (closing too: its close waits for what the client never takes)
            self.transport.abort()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(LingeringClose(transport, self))  # type: ignore[arg-type]
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.dropping:  # dropped; the close waits for the client's silence
            if "linger" in self.timers and self.loop.time() + LINGER_S < self._linger_end:
                self.timers.set("linger", LINGER_S, self.close_now)
            return
        # bytes of a next request's headers: not the rest of a body the app answered before reading it all
        idle = (
            self.cycle is None or self.cycle.response_complete
        ) and self.conn.their_state is not h11.SEND_BODY
        if idle and "header" not in self.timers:
            self._arm()
        if idle:  # counted before h11 parses them: headers that end in this read would start the request
            # (an end split across two reads: the tail holds the last 2 counted bytes)
            end = HEAD_END.search(self._tail + data)
            counted = len(data) if end is None else max(end.end() - len(self._tail), 0)
            if self._header_bytes + counted > MAX_HEADER_BYTES:
                self._refuse(TOO_LARGE_RESPONSE)
                return
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # its headers are parsed: from here only its body's bytes are timed
            self.timers.cancel("header", "drain")  # (an owed body's end may come in the same read as them)
        elif idle:
            self._header_bytes += len(data)
            self._tail = (self._tail + data)[-2:]
        elif (
            before is not None
            and before.response_complete
            and self.conn.their_state is h11.IDLE
            and "header" not in self.timers
            and not self.dropping
        ):  # the rest of a body answered early has come: what follows is a next request's, on its deadline
            self.timers.cancel("drain")
            self._arm_pending()
        self._watch_body()

    def on_response_complete(self) -> None:
        """A pipelined next request whose header bytes came while this one ran sits in h11's buffer, read
        before the count began: its deadline starts now, and those bytes count toward its cap. A body still
        owed (an early answer) gets LINGER_MAX_S to end, then the connection closes (lingering); nothing of
        this once the connection became a WebSocket (a pipelined upgrade happens within the super call)."""
        super().on_response_complete()
        if self.upgraded:
            return
        if self.owes_body() and not self.dropping and "drain" not in self.timers:
            self.timers.set("drain", LINGER_MAX_S, self.transport.close)  # (lingers)
        idle = self.cycle is None or self.cycle.response_complete  # (else h11 parsed the whole next request)
        if self.conn.trailing_data[0] and idle and "header" not in self.timers and not self.dropping:
            self._arm_pending()

    def _arm_pending(self) -> None:
        """Start the next request's deadline and count with the bytes of it already in h11's buffer."""
        pending = self.conn.trailing_data[0]
        self._arm(len(pending))
        self._tail = bytes(pending[-2:])
        if len(pending) > MAX_HEADER_BYTES:
            self._refuse(TOO_LARGE_RESPONSE)

    def connection_lost(self, exc: Exception | None) -> None:
        self.timers.cancel_all()
        super().connection_lost(exc)

    def _arm(self, received: int = 0) -> None:
        """Start a request's header deadline and count, `received` of its bytes already read."""
        self._header_bytes = received
        self._tail = b""
        self.timers.set("header", self.header_timeout_s, self._refuse, TIMEOUT_RESPONSE)

    def _watch_body(self) -> None:
        """(Re)start the body's deadline while the request being read still owes body bytes: each arrival
        gives it another `header_timeout_s`."""
        self.timers.cancel("body")
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_complete:
            self.timers.set("body", self.header_timeout_s, self._body_too_slow, cycle)

    def _body_too_slow(self, cycle: Any) -> None:
        """No body byte for `header_timeout_s`: a 408 (when no answer has begun) and the close, unless the
        server is the one waiting (the app has not taken what came, so reading is paused; or the client
        waits for its 100 Continue), or the body has ended meanwhile."""
        if (
            cycle is not self.cycle
            or not cycle.more_body
            or cycle.response_complete
            or self.transport.is_closing()
        ):
            return
        if self.flow.read_paused or cycle.waiting_for_100_continue:
            self._watch_body()
            return
        if not cycle.response_started:
            self.transport.write(TIMEOUT_RESPONSE)
        self.transport.close()  # (its answer is not complete: closed outright, not lingered)

    def _refuse(self, response: bytes) -> None:
        """`response`, then the end of the connection (lingering), unless a request began meanwhile or the
        connection is closing."""
        self.timers.cancel("header")
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.write(response)
            self.linger(most_s=LINGER_S)  # (no longer for bytes that keep coming: a slow client's)

    @property
    def _raw(self) -> asyncio.Transport:
        """The connection's own transport: the one LingeringClose wraps (until a WebSocket upgrade hands it
        over as it is)."""
        t = self.transport
        return t.transport if isinstance(t, LingeringClose) else t  # type: ignore[return-value]

    def owes_body(self) -> bool:
        """Whether the client is still sending the body of a request whose answer is complete (h11 reads it;
        unread, a close resets). An answer still being sent is not lingered behind: its next write would
        fail after the half-close."""
        return self.conn.their_state is h11.SEND_BODY and (self.cycle is None or self.cycle.response_complete)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        """The connection becomes a WebSocket (its own protocol from here, which uvicorn's HTTP deadlines do
        not concern): the header deadline set for this request is disarmed (it cut every /v1/realtime/video
        session at header_timeout_s, writing a 408 into the socket), the other timers too, and the WebSocket
        gets the connection's own transport (h11 stays in SEND_BODY after an upgrade: the lingering close
        would have taken every WebSocket close for an early answer)."""
        self.timers.cancel("header", "body", "write", "drain")
        self.upgraded = True
        self.transport = self._raw
        super().handle_websocket_upgrade(event)

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: a lingering connection ends at its client's next LINGER_S of silence
        (the shutdown waited out up to LINGER_MAX_S of it)."""
        if not self.dropping:
            super().shutdown()
        self._linger_end = min(self._linger_end, self.loop.time())

    def linger(self, most_s: float = LINGER_MAX_S) -> None:
        """The end of the connection: what was written goes, then the writing side closes; what the client
        still sends is read and dropped, and the connection closes after LINGER_S of its silence (at most
        `most_s`), or at its EOF."""
        transport = self._raw
        self.timers.cancel("header", "body", "drain")
        self.dropping = True
        if not transport.can_write_eof():
            self.close_now()
            return
        transport.write_eof()
        self.flow.resume_reading()
        self._linger_end = self.loop.time() + most_s
        self.timers.set("linger", LINGER_S, self.close_now)

    def close_now(self) -> None:
        """The transport's close (it waits until what is left of the answer has been written), and its
        abort once the client has taken none of that for `header_timeout_s` (a closing connection whose
        client reads nothing was held for good: a `Connection: close` answer, a lingering refusal)."""
        transport = self._raw
        transport.close()
        if "abort" not in self.timers:
            self._watch_close(transport, transport.get_write_buffer_size())

    def _watch_close(self, transport: asyncio.Transport, left: int) -> None:
        self.timers.set("abort", self.header_timeout_s, self._close_stalled, transport, left)

    def _close_stalled(self, transport: asyncio.Transport, left: int) -> None:
        """`header_timeout_s` after a close (or the last check): aborted if none of the `left` bytes went."""
        now = transport.get_write_buffer_size()
        if now and now >= left:
            transport.abort()
        elif now:  # (a slow reader: it took some)
            self._watch_close(transport, now)


class LingeringClose:
    """A connection's transport as HeaderGuard hands it to uvicorn: `close()` lingers (HeaderGuard.linger)
    while the client still sends a body, as after an answer given before reading it on a `Connection: close`
    request; everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, protocol: HeaderGuard) -> None:
        self.transport = transport
        self._protocol = protocol

    def close(self) -> None:
        if self.is_closing():
            return
        if self._protocol.owes_body():
            self._protocol.linger()
        else:
            self._protocol.close_now()

    def is_closing(self) -> bool:
        return self._protocol.dropping or self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class Timers:
    """A connection's deadlines by name (loop.call_later handles): `set` one (replacing that name's), `cancel`
    some or all; a name is `in` it from its setting until it fires or is cancelled."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._handles: dict[str, asyncio.TimerHandle] = {}

    def set(self, name: str, delay_s: float, callback: Callable[..., Any], *args: Any) -> None:
        self.cancel(name)
        self._handles[name] = self.loop.call_later(delay_s, self._fire, name, callback, args)

    def _fire(self, name: str, callback: Callable[..., Any], args: tuple) -> None:
        del self._handles[name]
        callback(*args)

    def cancel(self, *names: str) -> None:
        for name in names:
            if (handle := self._handles.pop(name, None)) is not None:
                handle.cancel()

    def cancel_all(self) -> None:
        self.cancel(*list(self._handles))

    def __contains__(self, name: str) -> bool:
        return name in self._handles


def header_guard_protocol(header_timeout_s: float) -> type:
    """HeaderGuard with this deadline, for uvicorn.Config(http=...)."""
    return type("HeaderGuardProtocol", (HeaderGuard,), {"header_timeout_s": header_timeout_s})

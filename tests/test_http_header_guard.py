"""The server's HTTP protocol (api/http_protocol.py: h11 with a header guard), over a real uvicorn and raw
sockets: a connection that sends nothing, or its headers a byte at a time, gets a 408 and is closed at the
deadline; headers past the size cap get a 431 at once, read by the client, and the connection is closed;
requests whose headers arrived in time are never cut, however long their body upload or their answer takes,
also with headers just under the cap and bodies far past it, on fresh and kept-alive connections; and the
shapes httptools let through (found by fuzzing) are refused: a pipelined request's endless header while the
one before it runs, a body smuggled as a request after `Connection: Upgrade`, trailers merged into the
headers. serve runs uvicorn with it (WORLDSERVE_HTTP_HEADER_TIMEOUT) on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time

import httpx
import pytest
from serving_helpers import serve_app

from worldserve.api.http_protocol import MAX_HEADER_BYTES, header_guard_protocol

DEADLINE = 0.6


LEFT: list[str] = []
"""The message /watch received after its body: "http.disconnect" once its client has gone."""
ENDED: list[float] = []
"""When /big's answer ended (its sends return at once once its client is dropped)."""
BIG = 32 << 20
"""/big's answer: past what loopback sockets and the transport buffer between them."""


SEND_ERRORS: list[BaseException] = []
"""What /stream-early's sends raised."""


async def app(scope, receive, send):
    """/slow answers 1.5 s after reading its body, /late reads it only after 1.5 s; every request's body is
    read whole and its length answered; /headers answers the request's header names (after its body); /early
    answers 401 without reading its body; /stream-early starts its answer before reading its body and sends
    more of it later. A WebSocket echoes what it gets."""
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while (message := await receive())["type"] == "websocket.receive":
            await send({"type": "websocket.send", "text": message.get("text")})
        return
    if scope["type"] != "http":
        return
    if scope["path"] == "/onebig":  # the whole answer in one send
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % BIG)]}
        )
        await send({"type": "http.response.body", "body": b"v" * BIG})
        return
    if scope["path"] == "/stream-early":
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await asyncio.sleep(3 * DEADLINE)  # (meanwhile the client's body stops coming)
            await send({"type": "http.response.body", "body": b"later", "more_body": False})
        except BaseException as exc:
            SEND_ERRORS.append(exc)
        return
    if scope["path"] == "/early":  # answers before reading its body (as a 401 from the key check does)
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["path"] == "/late":  # reads its body only after 1.5 s
        await asyncio.sleep(1.5)
    size, more = 0, True
    while more:
        message = await receive()
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    if scope["path"] == "/slow":
        await asyncio.sleep(1.5)
    if scope["path"] == "/watch":  # waits for the client to leave (as chat.py's unless_disconnected does)
        LEFT.append((await asyncio.wait_for(receive(), 5))["type"])
    if scope["path"] == "/big":
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % BIG)]}
        )
        chunk = b"v" * (1 << 20)
        for i in range(BIG // len(chunk)):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < BIG // len(chunk) - 1})
        ENDED.append(time.monotonic())
        return
    body = str(size).encode()
    if scope["path"] == "/headers":
        body = b",".join(sorted(name for name, _ in scope["headers"]))
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"%d" % len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def url():
    with serve_app(app, name="test-header-guard", http=header_guard_protocol(DEADLINE)) as u:
        yield u


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_silent_connection_is_closed_with_a_408_at_the_deadline(url):
    """The 408 says the header deadline closed it (uvicorn alone keeps such a connection open). When is the
    behaviour itself, with nothing but the clock to tell: not early (a lower bound, which cannot flake:
    timers do not fire early) and not far past it (6x the deadline, generous for a slow machine)."""
    sock = _connect(url)
    t0 = time.monotonic()
    answer = _read_all(sock)  # (the server closes it: recv returns b"")
    took = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout") and DEADLINE * 0.8 < took < 6 * DEADLINE


def test_headers_a_byte_at_a_time_are_cut_at_the_deadline(url):
    """Cut while its headers still come (their 230 bytes take 11 s, far past the deadline): each byte does
    not buy more time."""
    sock = _connect(url)
    with pytest.raises(OSError):  # (a send after the close: a reset or a broken pipe)
        for byte in b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 200:
            sock.send(bytes([byte]))
            time.sleep(0.05)
        raise AssertionError("the connection outlived its deadline")


def test_requests_with_their_headers_in_time_run_as_long_as_they_take(url):
    with httpx.Client(base_url=url, timeout=10) as http:  # one kept-alive connection
        assert http.get("/slow").text == "0"  # answered after the deadline passed: not cut
        time.sleep(DEADLINE * 1.5)  # idle between requests past the deadline: the next request is not cut
        assert http.get("/ping").text == "0"
    sock = _connect(url)  # a body uploaded over twice the deadline after quick headers
    sock.sendall(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\nConnection: close\r\n\r\n")
    for _ in range(4):
        time.sleep(DEADLINE / 2)
        sock.sendall(b"ab")
    assert _read_all(sock).endswith(b"\r\n\r\n8")


def test_headers_past_the_cap_are_refused_at_once(url):
    """A header growing without end is cut as soon as the cap is passed, long before the deadline: the answer
    is the cap's 431, not the deadline's 408."""
    sock = _connect(url)
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: ")
    with contextlib.suppress(OSError):  # (the server may close before all of it is sent)
        for _ in range(16):
            sock.sendall(b"a" * (MAX_HEADER_BYTES // 4))
    reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), reply[:80]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == 431


def test_headers_past_the_cap_in_one_read_are_refused(url):
    """Headers just past the cap, sent whole in one write: refused before the request starts (they had been
    counted only when they spanned two reads, so ~100 kB of them came in one and were served)."""
    sock = _connect(url)
    head = b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MAX_HEADER_BYTES + b"\r\n\r\n"
    with contextlib.suppress(OSError):
        sock.sendall(head)
    reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), reply[:80]


@pytest.mark.parametrize("split", [1, 2, 3])
def test_a_body_after_headers_whose_end_is_split_across_reads_is_not_counted(url, split):
    """The end of the headers split between two reads, the body in the second: the body is not header bytes
    (the first count of one read took the whole second read for headers and refused it)."""
    sock = _connect(url)
    head = b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\nConnection: close\r\n\r\n"
    sock.sendall(head[:-split])
    time.sleep(0.2)
    sock.sendall(head[-split:] + b"b" * 200_000)
    assert _responses(_read_all(sock)) == [b"HTTP/1.1 200 OK"]


def test_bare_lf_headers_and_an_early_answer_are_not_counted_past_their_end(url):
    """h11 takes headers ended by bare LFs: their body is not counted either. A body the app answered before
    reading it (a 401) is the rest of that request, not a next request's headers (it got a stray 431)."""
    sock = _connect(url)
    sock.sendall(
        b"POST /upload HTTP/1.1\nHost: x\nContent-Length: 200000\nConnection: close\n\n" + b"b" * 200_000
    )
    assert _responses(_read_all(sock)) == [b"HTTP/1.1 200 OK"]
    sock = _connect(url)  # (kept alive: the server reads the rest of the body and drops it)
    sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 400000\r\n\r\n" + b"b" * 400_000)
    reply = b""
    sock.settimeout(1.0)
    with contextlib.suppress(
        TimeoutError
    ):  # (whatever comes within a second of the answer: a 431 came at once)
        while chunk := sock.recv(4096):
            reply += chunk
    assert _responses(reply)[:1] == [b"HTTP/1.1 401 Unauthorized"] and b" 431 " not in reply, reply
    # ...and once that body has come, the next request is on the header deadline (it had none: the
    # connection stayed open for good), whether nothing follows or its headers stall half-way
    for after in (b"", b"GET /ping HTTP/1.1\r\nHost"):
        sock = _connect(url)
        sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        time.sleep(0.2)  # (the 401 goes out before the body comes)
        sock.sendall(b"b" * 1000 + after)
        reply = _read_all(sock)  # (its 10 s timeout is the guard against a connection left open for good)
        assert _responses(reply) == [b"HTTP/1.1 401 Unauthorized", b"HTTP/1.1 408 Request Timeout"], reply


def test_an_answer_before_the_body_on_a_closing_connection_reaches_a_client_that_sends_it_all(url):
    """An answer given before the body was read (a 401, a 413) on a `Connection: close` request: the server
    reads and drops the rest of the body before closing, so a client that sends its whole body before reading
    (Python's urllib) reads the answer (a close with the body unread reset the connection: a broken pipe);
    the connection ends at the client's EOF, or when it has been silent a while. (The read ends at the
    server's half-close right after its answer, so when the server closes for good is not seen here: the
    read's 10 s timeout only guards against a hang.)"""
    for client_ends in (True, False):
        sock = _connect(url)
        sock.sendall(
            b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % BIG
        )
        time.sleep(0.2)  # (the 401 goes out, and the server closes its side, before the body comes)
        sock.sendall(b"b" * BIG)  # (past what the sockets between them buffer)
        if client_ends:
            sock.shutdown(socket.SHUT_WR)
        assert _responses(_read_all(sock)) == [b"HTTP/1.1 401 Unauthorized"]


def test_a_websocket_outlives_the_header_deadline(url):
    """An upgraded connection is the WebSocket's: the header deadline armed for its request was never
    disarmed, so every /v1/realtime/video session was cut at the deadline (a 408 written into the socket)."""
    from websockets.sync.client import connect

    with connect(url.replace("http://", "ws://") + "/ws", open_timeout=5) as ws:
        time.sleep(3 * DEADLINE)
        ws.send("still here")
        assert ws.recv(timeout=5) == "still here"


def test_an_answer_under_way_is_not_half_closed_when_its_body_stalls(url):
    """A body that stops coming while its answer streams: the connection is closed (the body deadline), not
    half-closed to linger, after which the answer's next send failed (write after write_eof)."""
    SEND_ERRORS.clear()
    sock = _connect(url)
    sock.sendall(b"POST /stream-early HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"b" * 10)
    assert b"first" in _read_all(sock)  # (then the close)
    time.sleep(3 * DEADLINE)
    assert SEND_ERRORS == []


def test_headers_under_the_cap_and_a_body_past_it_are_served(url):
    """The cap counts a request's line and headers only: a body of many caps is read whole, and headers just
    under the cap pass, on a connection kept alive for a second request."""
    big = MAX_HEADER_BYTES - 200
    with httpx.Client(base_url=url) as http:
        r = http.post("/upload", content=b"b" * (4 * MAX_HEADER_BYTES), headers={"X-Big": "a" * big})
        assert (r.status_code, r.text) == (200, str(4 * MAX_HEADER_BYTES))
        assert http.get("/ping", headers={"X-Big": "a" * big}).status_code == 200


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /ping HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789",  # 90 bytes owed
        b"POST /ping HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n",  # no last chunk
    ],
    ids=["short-body", "no-last-chunk"],
)
def test_a_body_that_stops_coming_is_cut_at_the_deadline(url, request_bytes):
    """The 408 says the body deadline cut it; when is the behaviour itself: not early (a lower bound, which
    cannot flake) and not far past it (6x the deadline, generous for a slow machine)."""
    sock = _connect(url)
    sock.sendall(request_bytes)
    t0 = time.monotonic()
    reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408 Request Timeout"), reply
    assert DEADLINE * 0.9 < time.monotonic() - t0 < 6 * DEADLINE
    error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]  # the envelope, not an empty body
    assert error["code"] == 408 and "did not arrive in time" in error["message"], reply


def test_a_body_the_app_reads_late_is_not_cut(url):
    """The app takes its body only after 1.5 s (past the deadline): uvicorn stops reading once 64 KiB wait
    for it, so the client is held up by the server, not silent by its own choice."""
    body = b"b" * (4 * 2**20)
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/late", content=body)
        assert (r.status_code, r.text) == (200, str(len(body)))
        r = http.post("/late", content=b"small")  # (nothing paused: the body came whole, then the app waited)
        assert (r.status_code, r.text) == (200, "5")


@pytest.mark.parametrize("how", ["close", "half-close"])
def test_the_app_learns_at_once_that_its_client_left(url, how):
    """A client that closes (or only shuts its sending side: the same FIN on the wire) after its request is
    gone: the app is told (http.disconnect), so a chat or video nobody waits for stops. The twenty-fifth
    session's protocol kept answering after a half-close, and with it every abandoned non-streamed chat and
    sync video ran to its end."""
    LEFT.clear()
    sock = _connect(url)
    sock.sendall(b"POST /watch HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    time.sleep(0.1)
    if how == "close":
        sock.close()
    else:
        sock.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + 3  # (the hang guard: an app never told waits 5 s, then gives up)
    while not LEFT and time.monotonic() < deadline:
        time.sleep(0.01)
    assert LEFT == ["http.disconnect"]
    sock.close()


def test_a_client_that_half_closes_mid_body_is_closed_at_once(url):
    """Closed at its EOF, answerless: not by the body deadline, whose close answers 408 first."""
    sock = _connect(url)
    sock.sendall(b"POST /ping HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
    sock.shutdown(socket.SHUT_WR)
    assert _read_all(sock) == b""


def _big_request(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: a small window)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock


def _received(sock: socket.socket) -> int:
    size = 0
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 20):
            size += len(chunk)
    return size


def test_an_answer_the_client_reads_nothing_of_is_dropped_at_the_deadline(url):
    """A client that reads nothing of a large answer (a video's content) held the connection, and the
    app's response with its file, for as long as it liked; it is dropped once writing has waited the
    deadline, and the answer ends. A client that waits less than that, then reads, gets all of it."""
    ENDED.clear()
    sock = _big_request(url)
    t0 = time.monotonic()
    while not ENDED and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    # when is the behaviour itself: not early (a lower bound, which cannot flake: timers do not fire early)
    # and not far past the deadline (6x it, generous for a slow machine)
    assert ENDED and DEADLINE * 0.9 <= ENDED[0] - t0 < 6 * DEADLINE, ENDED
    assert _received(sock) < BIG  # (what the buffers held, then the reset)
    sock.close()
    ENDED.clear()
    sock = _big_request(url)
    time.sleep(DEADLINE / 2)
    assert _received_until(sock, BIG) == BIG
    sock.close()


def test_a_closing_connection_whose_client_reads_nothing_is_dropped(url):
    """An answer written whole, then the close (Connection: close): the close waits for the client to take
    the rest, and the write deadline skipped a closing connection, so one that read nothing stayed open
    for good (as a lingering refusal whose client read nothing did)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    sock.sendall(b"GET /onebig HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    time.sleep(3 * DEADLINE)  # (reads nothing)
    assert _received(sock) < BIG  # (what the buffers held, then the end)
    sock.close()


def test_a_body_left_unsent_after_an_early_answer_is_not_waited_for_without_end(url, monkeypatch):
    """A keep-alive request answered before its body (a 401), whose client sends a byte more, then nothing:
    no deadline was left armed (uvicorn's keep-alive timer stops at a byte), so the connection stayed open
    for good (a way to hold descriptors with no key). It now lingers and closes within LINGER_MAX_S."""
    from worldserve.api import http_protocol

    monkeypatch.setattr(http_protocol, "LINGER_MAX_S", 1.0)
    sock = _connect(url)
    sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
    time.sleep(0.2)
    sock.sendall(b"x")
    # (the read's 10 s timeout is the guard against a connection left open for good: the owed body's
    # LINGER_MAX_S, 1 s here, ends it, the server's half-close ending the read)
    assert _responses(_read_all(sock)) == [b"HTTP/1.1 401 Unauthorized"]


def test_a_pipelined_websocket_upgrade_gets_no_header_deadline(url):
    """An upgrade pipelined behind a request, a frame sent with it: the upgrade happened while the first
    answer completed, and that armed the next request's header deadline on what was a WebSocket by then (a
    408 written into it, then an error in the timer)."""
    import base64
    import os

    key = base64.b64encode(os.urandom(16))
    upgrade = (b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n\r\n")  # fmt: skip
    frame = b"\x81\x82abcd" + bytes(a ^ b for a, b in zip(b"hi", b"ab", strict=True))  # "hi", masked
    sock = _connect(url)
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n" + upgrade + frame)
    got, t0 = b"", time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - t0 < 3 * DEADLINE:
        with contextlib.suppress(TimeoutError):
            if not (chunk := sock.recv(4096)):
                break
            got += chunk
    assert b"101 Switching Protocols" in got and b"408" not in got, got[-200:]
    sock.sendall(frame)  # (still a live WebSocket past the deadline; the eager frame uvicorn's upgrade drops)
    sock.settimeout(5)
    assert sock.recv(4096) == b"\x81\x02hi"
    sock.close()


def _received_until(sock: socket.socket, size: int) -> int:
    """The answer's body bytes read, up to `size` of them after its head."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    got = len(data.split(b"\r\n\r\n", 1)[1])
    while got < size and (chunk := sock.recv(1 << 20)):
        got += len(chunk)
    return got


def _responses(reply: bytes) -> list[bytes]:
    """The status lines in `reply` (bodies here are digits or header names: no status line inside them)."""
    return re.findall(rb"HTTP/1\.1 \d{3}[^\r]*", reply)


def test_a_pipelined_request_behind_a_running_one_is_capped_too(url):
    """httptools read on while a request ran, so the next request's header grew without bound past the cap
    (and the deadline, which only runs between requests); h11 reads the next request once the answer is
    out, and the cap holds for it."""
    sock = _connect(url)
    sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /ping HTTP/1.1\r\nHost: x\r\nX-Big: ")
    with contextlib.suppress(OSError):
        for _ in range(16):
            sock.sendall(b"a" * (MAX_HEADER_BYTES // 4))
    reply = _read_all(sock)
    assert _responses(reply) == [b"HTTP/1.1 200 OK", b"HTTP/1.1 431 Request Header Fields Too Large"], reply


def test_pipelined_header_bytes_read_with_the_running_request_count_toward_the_cap(url):
    """Sent in one go with the request before it, the next request's header bytes are read into h11's buffer
    while that request runs; they count once its answer is out (under load the test above met this race and
    got the deadline's 408 instead of the cap's 431)."""
    sock = _connect(url)
    sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /ping HTTP/1.1\r\nHost: x\r\nX-Big: "
                 + b"a" * (MAX_HEADER_BYTES + 1024))  # fmt: skip
    reply = _read_all(sock)
    assert _responses(reply) == [b"HTTP/1.1 200 OK", b"HTTP/1.1 431 Request Header Fields Too Large"], reply


def test_a_body_after_connection_upgrade_is_never_run_as_a_request(url):
    """httptools took the body of a request asking `Connection: Upgrade` (or a CONNECT) as the start of the
    new protocol and parsed the next packet as a new request: a GET smuggled in a body got its own answer."""
    smuggled = b"GET /headers HTTP/1.1\r\nHost: x\r\n\r\n"
    for head in (
        b"POST /ping HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: foo\r\n",
        b"CONNECT /ping HTTP/1.1\r\nHost: x\r\n",
    ):
        sock = _connect(url)
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(smuggled))
        time.sleep(0.3)
        sock.sendall(smuggled)
        sock.settimeout(3)
        reply = b""
        with contextlib.suppress(TimeoutError, OSError):
            while chunk := sock.recv(4096):
                reply += chunk
        assert len(_responses(reply)) <= 1 and b"host" not in reply.split(b"\r\n\r\n", 1)[-1], reply
        sock.close()


def test_chunked_trailers_never_join_the_request_headers(url):
    sock = _connect(url)
    sock.sendall(b"POST /headers HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                 b"2\r\nhi\r\n0\r\nAuthorization: Bearer injected\r\n\r\n")  # fmt: skip
    reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 200 OK") and reply.endswith(b"\r\n\r\nhost,transfer-encoding".replace(
        b"host,transfer-encoding", b"connection,host,transfer-encoding")), reply  # fmt: skip


def test_serve_gives_uvicorn_the_deadline(monkeypatch):
    from worldserve import envs

    monkeypatch.delenv("WORLDSERVE_HTTP_HEADER_TIMEOUT", raising=False)
    assert envs.http_header_timeout_s() == 60.0
    monkeypatch.setenv("WORLDSERVE_HTTP_HEADER_TIMEOUT", "7.5")
    assert envs.http_header_timeout_s() == 7.5
    monkeypatch.setenv("WORLDSERVE_HTTP_HEADER_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="WORLDSERVE_HTTP_HEADER_TIMEOUT"):
        envs.http_header_timeout_s()
    assert header_guard_protocol(7.5).header_timeout_s == 7.5


def test_serve_runs_on_h11_and_uvloop_and_names_them():
    """serve's protocol parses with h11 (not httptools, which uvicorn would pick when installed) and its loop
    is uvloop's (installed with worldserve); the startup log names the loop uvicorn runs on (serve_http)."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from worldserve.commands.serve_http import event_loop

    assert issubclass(header_guard_protocol(5.0), H11Protocol)
    assert event_loop(uvicorn.Config(app, http=header_guard_protocol(5.0))) == "uvloop"
    assert event_loop(uvicorn.Config(app, http="h11", loop="asyncio")) == "asyncio"

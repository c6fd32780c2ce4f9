"""The request-header guard (api/http_protocol.py): over a real uvicorn and raw sockets, a connection that
sends nothing, or its headers a byte at a time, gets a 408 and is closed at the deadline; headers past the
size cap get a 431 at once, read by the client, and the connection is closed, with nothing held;
requests whose headers arrived in time are never cut, however long their body upload or their answer takes,
also with headers just under the cap and bodies far past it, on fresh and kept-alive connections, on h11
and on httptools; serve runs uvicorn with it (WORLDSERVE_HTTP_HEADER_TIMEOUT)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import httpx
import pytest
from serving_helpers import serve_app

from worldserve.api.http_protocol import MAX_HEADER_BYTES, header_guard_protocol

DEADLINE = 0.6


async def app(scope, receive, send):
    """/slow answers after 1.5 s; every request's body is read whole and its length answered."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    if scope["path"] == "/slow":
        await asyncio.sleep(1.5)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"%d" % len(str(size)))],
        }
    )
    await send({"type": "http.response.body", "body": str(size).encode()})


@pytest.fixture(scope="module", params=["h11", "httptools"])
def parser(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def url(parser):
    """The app behind the deadline on each of uvicorn's HTTP implementations (serve takes httptools when it
    is installed, as it is with worldserve, and h11 otherwise)."""
    if parser == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    protocol = header_guard_protocol(DEADLINE, base)
    with serve_app(app, name=f"test-header-guard-{parser}", http=protocol) as u:
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
    sock = _connect(url)
    t0 = time.monotonic()
    answer = _read_all(sock)  # (the server closes it: recv returns b"")
    took = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout") and DEADLINE * 0.8 < took < DEADLINE + 3


def test_headers_a_byte_at_a_time_are_cut_at_the_deadline(url):
    sock = _connect(url)
    t0 = time.monotonic()
    with pytest.raises(OSError):  # (a send after the close: a reset or a broken pipe)
        for byte in b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 200:
            sock.send(bytes([byte]))
            time.sleep(0.05)
        raise AssertionError("the connection outlived its deadline")
    assert time.monotonic() - t0 < DEADLINE + 3


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


def test_headers_past_the_cap_are_refused_at_once(url, parser):
    """A header growing without end (httptools would keep it whole in memory until the deadline) is cut as
    soon as the cap is passed, long before the deadline."""
    sock = _connect(url)
    sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: ")
    t0 = time.monotonic()
    with contextlib.suppress(OSError):  # (the server may close before all of it is sent)
        for _ in range(16):
            sock.sendall(b"a" * (MAX_HEADER_BYTES // 4))
    reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), reply[:80]
    assert time.monotonic() - t0 < DEADLINE


def test_headers_under_the_cap_and_a_body_past_it_are_served(url):
    """The cap counts a request's line and headers only: a body of many caps is read whole, and headers just
    under the cap pass, on a connection kept alive for a second request."""
    big = MAX_HEADER_BYTES - 200
    with httpx.Client(base_url=url) as http:
        r = http.post("/upload", content=b"b" * (4 * MAX_HEADER_BYTES), headers={"X-Big": "a" * big})
        assert (r.status_code, r.text) == (200, str(4 * MAX_HEADER_BYTES))
        assert http.get("/ping", headers={"X-Big": "a" * big}).status_code == 200


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


def test_serve_runs_on_httptools_and_uvloop_and_names_them():
    """worldserve installs httptools and uvloop (as uvicorn[standard] does), so serve's protocol is the
    httptools one and its loop uvloop's; the startup log names what uvicorn runs on (serve_http)."""
    import uvicorn

    from worldserve.commands.serve_http import implementations

    assert implementations(uvicorn.Config(app, http=header_guard_protocol(5.0))) == ("httptools", "uvloop")
    assert implementations(uvicorn.Config(app, http="h11", loop="asyncio")) == ("h11", "asyncio")

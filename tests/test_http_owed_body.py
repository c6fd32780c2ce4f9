"""The owed-body ("drain") deadline of api/http_protocol.py: after an early answer on a kept-alive connection,
the rest of the body has LINGER_MAX_S to come; once it has, the deadline is gone, also when the body's end
and the next request's headers come in one read (that request's answer is not cut). Raw sockets against a
real uvicorn running the header guard, as tests/test_http_header_guard.py drives it."""

from __future__ import annotations

import time

import pytest
from serving_helpers import serve_app
from test_http_header_guard import DEADLINE, _connect, _read_all, _responses, app

from worldserve.api.http_protocol import header_guard_protocol


@pytest.fixture(scope="module")
def url():
    with serve_app(app, name="test-review2-drain", http=header_guard_protocol(DEADLINE)) as u:
        yield u


def test_the_owed_body_deadline_does_not_cut_the_next_request_that_came_with_its_end(url, monkeypatch):
    """A keep-alive request answered before its body (a 401): the server arms the owed-body deadline
    (LINGER_MAX_S). The client then sends the body's last byte and its next request in one packet: h11
    parses both in that one read, so HeaderGuard.data_received sees a new cycle and never reaches the branch
    that cancels "drain" (it runs only when the read did not start a request). The deadline stays armed for
    the next request and fires in the middle of it: LingeringClose.close -> close_now closes the connection
    under the running /slow request (1.5 s), whose 200 never comes. (The same with the real 10 s: any request
    running past 10 s after an early answer on that connection, e.g. a /v1/videos/sync, is cut.)"""
    from worldserve.api import http_protocol

    monkeypatch.setattr(http_protocol, "LINGER_MAX_S", 1.0)
    sock = _connect(url)
    sock.sendall(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"b" * 999)
    time.sleep(0.2)  # (the 401 goes out, the body still owed: the drain deadline is armed)
    sock.sendall(b"b" + b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    reply = _read_all(sock)
    sock.close()
    assert _responses(reply) == [b"HTTP/1.1 401 Unauthorized", b"HTTP/1.1 200 OK"], reply

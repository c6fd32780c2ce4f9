"""The error table of serving-api.md (§3.2 envelope, §12 bad input) held where a black-box audit found it
broken: a form's bracketed fields (the OpenAI SDK's nested `extra_body`) nested deeper than a JSON body may
were accepted, or a 500 (RecursionError) when a key they reached was validated; a JSON route's body without a
Content-Type header was said to be of type 'none'; and a request h11 cannot parse got uvicorn's bare
text/plain 400 instead of the envelope. Each case runs over the app's real HTTP path (httpx.ASGITransport, or
a real uvicorn with the server's protocol for the bytes below the app)."""

from __future__ import annotations

import json
import socket

import pytest
from serving_helpers import asgi_server, uvicorn_thread

from worldserve.api.bodies import MAX_JSON_DEPTH
from worldserve.api.errors import validation_error

pytestmark = pytest.mark.anyio
OK = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "1"}


@pytest.mark.parametrize(
    ("name", "levels"),
    [
        # past Python's recursion limit, into a key the route validates: the 400's repr raised (a 500)
        ("extra_params[video_codec_options]", 3000),
        # deeper than a JSON body may nest, under a key nothing reads: it was accepted and stored
        ("extra_params", MAX_JSON_DEPTH),
        ("video_params", 300),
    ],
)
async def test_bracketed_form_fields_nested_too_deep_are_a_400_naming_the_field(tmp_path, name, levels):
    field = name.split("[")[0]
    async with asgi_server(tmp_path) as http:
        for route in ("/v1/videos", "/v1/videos/sync"):
            r = await http.post(route, data={**OK, name + "[a]" * levels: "3"})
            assert r.status_code == 400, (route, r.text[:300])
            err = r.json()["error"]
            assert err["type"] == "Bad Request" and err["code"] == 400 and err["param"] == field, err
            assert f"{field}: JSON nested deeper than {MAX_JSON_DEPTH} levels" in err["message"], err
        assert (await http.get("/v1/videos")).json()["data"] == [], "a refused request leaves no job"


async def test_bracketed_form_fields_as_deep_as_a_json_body_may_nest_still_fold(tmp_path):
    """The bound is the JSON bodies' own (the body object counts as a level): the deepest `extra_params` a
    JSON body may send, 127 objects, comes through brackets too, and one level more is refused both ways."""
    async with asgi_server(tmp_path) as http:
        deepest = "extra_params" + "[a]" * (MAX_JSON_DEPTH - 1)
        assert (await http.post("/v1/videos", data={**OK, deepest: "3"})).status_code == 200
        r = await http.post("/v1/videos", data={**OK, deepest + "[a]": "3"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_params"
        deep = {"a": 3}
        for _ in range(MAX_JSON_DEPTH - 2):
            deep = {"a": deep}
        body = {**OK, "num_frames": 5, "num_inference_steps": 1, "extra_params": deep}
        assert (await http.post("/v1/videos", json=body)).status_code == 200
        r = await http.post("/v1/videos", json={**body, "extra_params": {"a": deep}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_params"


def test_a_validation_error_about_an_input_too_deep_for_repr_is_still_a_400():
    """validation_error shows each offending input's repr: one nested past the recursion limit made it
    raise RecursionError (the route's 400 became a 500); it is shown a few levels deep instead."""
    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["a"] = {}
        node = node["a"]
    err = validation_error(
        [{"type": "string_type", "loc": ("extra_params", "x"), "msg": "bad", "input": deep}]
    )
    assert err.status == 400 and err.param == "extra_params.x"
    assert "{'a': {'a': " in err.message and "..." in err.message


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/images/generations", "/v1/completions"])
async def test_a_json_route_without_a_content_type_says_so(tmp_path, route):
    async with asgi_server(tmp_path) as http:
        r = await http.post(route, content=b'{"prompt": "x"}')
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["message"] == "No Content-Type header: send application/json", err
        assert err["type"] == "Bad Request" and err["code"] == 400
        r = await http.post(route, content=b"prompt=x", headers={"Content-Type": "text/plain"})
        assert r.json()["error"]["message"] == "Unsupported content type 'text/plain': send application/json"


def _exchange(url: str, raw: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """(status line, headers, body) of the answer to the raw bytes `raw`, read to the connection's close."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(raw)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return status.encode(), headers, body


@pytest.mark.parametrize(
    ("raw", "status", "reason"),
    [
        (b"GARBAGE\r\n\r\n", 400, "illegal request line"),
        (b"GET /health HTTP/1.1\r\n\r\n", 400, "Missing mandatory Host: header"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400, "illegal header line"),
        (b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, "bad Content-Length"),
        (b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "chunked"),
    ],
)
def test_a_request_h11_cannot_read_gets_the_envelope_naming_why(tmp_path, raw, status, reason):
    with uvicorn_thread(tmp_path) as (url, _):
        line, headers, body = _exchange(url, raw)
    assert line.startswith(b"HTTP/1.1 %d " % status), line
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert int(headers["content-length"]) == len(body)
    err = json.loads(body)["error"]
    assert err["code"] == status and err["param"] is None
    assert err["message"].startswith("Invalid HTTP request received: ") and reason in err["message"], err

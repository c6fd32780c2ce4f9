"""`--root-path /api` as vLLM serves it (FastAPI's root_path under Starlette 1.x): a trailing slash's redirect,
request.url (what a --middleware sees) and /docs keep the prefix the client sent, requests with and without
it are served, the API key is checked either way, and a WebSocket route works under it. Plain FastAPI with the
same root_path is the oracle for the redirects.
"""

from __future__ import annotations

import httpx
import pytest
import websockets
from fastapi import FastAPI
from serving_helpers import make_client, realtime_session, serve_app

from worldserve.api.app import build_app
from worldserve.commands.serve_http import install

pytestmark = pytest.mark.anyio
KEY = {"Authorization": "Bearer sk-test"}


async def stamp(request, call_next):
    """A --middleware: answers carry the path it saw."""
    response = await call_next(request)
    response.headers["X-Stamped"] = str(request.url.path)
    return response


def prefixed_app(tmp_path, **app_kw):
    app = build_app(make_client(tmp_path), **app_kw)
    install(app, root_path="/api", middlewares=[stamp])
    return app


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t:8641")


async def test_a_trailing_slash_redirect_keeps_the_prefix_as_plain_fastapi_does(tmp_path):
    """/api/v1/videos/ answered a 307 to http://host/v1/videos: the prefix was stripped from the scope's path,
    from which Starlette builds the redirect (and request.url)."""
    oracle = FastAPI()
    oracle.root_path = "/api"
    oracle.get("/health")(lambda: {})
    async with client(oracle) as http:
        expected = (await http.get("/api/health/")).headers["location"]
    assert expected == "http://t:8641/api/health"
    async with client(prefixed_app(tmp_path)) as http:
        for path, location in (("/api/health/", expected), ("/api/v1/videos/", "http://t:8641/api/v1/videos"),
                               ("/api/docs/", "http://t:8641/api/docs"),
                               ("/v1/videos/", "http://t:8641/v1/videos")):  # fmt: skip
            answer = await http.get(path)
            assert (answer.status_code, answer.headers["location"]) == (307, location), path
        followed = await http.get("/api/v1/videos/", follow_redirects=True)
        assert followed.status_code == 200 and followed.json()["object"] == "list"


async def test_requests_with_and_without_the_prefix_are_served_and_keyed(tmp_path):
    """Both spellings reach the route, the key is required on both, a --middleware sees the URL the client
    sent (it saw /v1/models for /api/v1/models)."""
    async with client(prefixed_app(tmp_path, api_keys=("sk-test",))) as http:
        for path in ("/api/v1/models", "/v1/models"):
            assert (await http.get(path)).status_code == 401, path
            answer = await http.get(path, headers=KEY)
            assert answer.status_code == 200 and answer.headers["x-stamped"] == path
        assert (await http.get("/api/version")).status_code == 200, "not keyed"
        assert (await http.get("/api/api/v1/models", headers=KEY)).status_code == 404


async def test_docs_point_at_the_prefixed_schema(tmp_path):
    async with client(prefixed_app(tmp_path)) as http:
        for path in ("/api/docs", "/docs"):
            page = await http.get(path)
            assert page.status_code == 200 and "'/api/openapi.json'" in page.text, path
        schema = (await http.get("/api/openapi.json")).json()
        assert schema["servers"] == [{"url": "/api"}] and "/v1/videos" in schema["paths"]


async def test_the_realtime_websocket_under_the_prefix_with_its_key(tmp_path):
    """On a real socket: ws://host/api/v1/realtime/video streams a session with the key, is refused (401)
    without it."""
    app = build_app(make_client(tmp_path, real_encoder=True), api_keys=("sk-test",), shutdown_timeout_s=1.0)
    install(app, root_path="/api", middlewares=[])
    start = {"type": "session.start", "prompt": "a cat", "size": "64x48", "num_frames": 9, "fps": 8,
             "num_inference_steps": 2}  # fmt: skip
    with serve_app(app) as url:
        with pytest.raises(websockets.InvalidStatus) as refused:
            await realtime_session(url + "/api", start)
        assert refused.value.response.status_code == 401
        messages, data, _ = await realtime_session(url + "/api", start, headers=KEY)
    assert messages[-1]["type"] == "session.done" and data

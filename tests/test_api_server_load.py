"""vLLM's /load (`--enable-server-load-tracking`) beyond the video routes' HTTP requests
(tests/test_api_video_server.py has those): POST /v1/responses counts while in flight, as vLLM's
load_aware_call counts create_responses (its GET / cancel do not), and an async video job counts from its
creation until it ends (completed, or deleted), so a balancer routing on /load sees the work queued on it."""

from __future__ import annotations

import asyncio

import pytest
from serving_helpers import SMALL_FORM, asgi_server, poll_job
from test_api_chat_lifecycle import EndlessBackend

from worldserve.engine.fake_backend import FakeBackend

pytestmark = pytest.mark.anyio


async def _load(http) -> int:
    return (await http.get("/load")).json()["server_load"]


async def _until(predicate, timeout: float = 10.0) -> None:
    """Poll an async predicate (the event loop keeps running meanwhile)."""
    for _ in range(int(timeout / 0.01)):
        if await predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met")


async def test_a_response_being_created_counts(tmp_path):
    chat = EndlessBackend()
    async with asgi_server(tmp_path, chat_backend=chat, app_kw={"server_load_tracking": True}) as http:
        created = asyncio.ensure_future(
            http.post(
                "/v1/responses", json={"model": "test-model", "input": "go on", "max_output_tokens": 10_000}
            )
        )
        await _until(lambda: asyncio.sleep(0, bool(chat.sessions)))
        assert await _load(http) == 1
        chat.finish.set()
        r = await created
        assert r.status_code == 200, r.text
        assert await _load(http) == 0
        assert (await http.get(f"/v1/responses/{r.json()['id']}")).status_code == 200
        assert await _load(http) == 0  # a stored response's GET does not count


async def test_an_async_video_job_counts_until_it_ends(tmp_path):
    async with asgi_server(tmp_path, backend=FakeBackend(step_delay=0.05),
                           app_kw={"server_load_tracking": True}) as http:  # fmt: skip
        long = {"prompt": "x", **SMALL_FORM, "num_inference_steps": "200"}
        running = (await http.post("/v1/videos", data=long)).json()["id"]
        queued = (await http.post("/v1/videos", data=long)).json()["id"]
        assert await _load(http) == 2  # answered at once, their work goes on
        assert (await http.delete(f"/v1/videos/{running}")).status_code == 200
        await _until(lambda: _eq(_load(http), 1))
        assert (await http.delete(f"/v1/videos/{queued}")).status_code == 200
        await _until(lambda: _eq(_load(http), 0))
        short = (await http.post("/v1/videos", data={"prompt": "x", **SMALL_FORM})).json()["id"]
        assert (await poll_job(http, short))["status"] == "completed"
        await _until(lambda: _eq(_load(http), 0))


async def _eq(value, want) -> bool:
    return await value == want


async def test_a_sync_video_past_its_timeout_counts_until_its_job_ends(tmp_path):
    """/v1/videos/sync answers 504 after --sync-timeout and its job goes on: /load keeps counting it, as an
    async job, until it ends."""
    async with asgi_server(tmp_path, backend=FakeBackend(step_delay=0.05), sync_timeout_s=0.3,
                           app_kw={"server_load_tracking": True}) as http:  # fmt: skip
        r = await http.post(
            "/v1/videos/sync", data={"prompt": "x", **SMALL_FORM, "num_inference_steps": "200"}
        )
        assert r.status_code == 504, r.text
        assert await _load(http) == 1  # (was 0: the job ran on, uncounted)
        assert (await http.delete(f"/v1/videos/{r.headers['x-video-id']}")).status_code == 200
        await _until(lambda: _eq(_load(http), 0))

"""The video API's server side over httpx.ASGITransport on the FakeBackend (stub encoder): the sync route's
headers, timeout and early answers (engine crash, DELETE, shutdown), queue and upload limits, auth and
request ids, /ping and server load, unknown routes, /metrics, bodies cut mid-way."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest
from serving_helpers import SMALL_FORM, asgi_server, poll_job, wait_until

from worldserve.engine.fake_backend import FakeBackend

pytestmark = pytest.mark.anyio


async def test_sync_route_headers_and_body(tmp_path):
    async with asgi_server(tmp_path) as http:
        r = await http.post(
            "/v1/videos/sync", data={"prompt": "x", **SMALL_FORM}, headers={"Accept": "video/mp4"}
        )
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
        assert re.fullmatch(r"video_sync-[0-9a-f]{32}", r.headers["x-request-id"])
        assert r.headers["x-model"] == "test-model"
        assert float(r.headers["x-inference-time-s"]) >= 0 and float(r.headers["x-peak-memory-mb"]) == 0.0
        assert "diffuse" in json.loads(r.headers["x-stage-durations"])
        assert "content-disposition" not in r.headers
        job = (await http.get(f"/v1/videos/{r.headers['x-video-id']}")).json()
        assert job["status"] == "completed", "the sync route is a normal job"
        # its refusals before a job exists (a 400 here, a 429 alike) carry its own id, not the client's
        bad = await http.post(
            "/v1/videos/sync", data={"prompt": "", **SMALL_FORM}, headers={"X-Request-Id": "abc"}
        )
        assert bad.status_code == 400 and re.fullmatch(
            r"video_sync-[0-9a-f]{32}", bad.headers["x-request-id"]
        )


async def test_sync_timeout_504_and_job_survives(tmp_path):
    async with asgi_server(tmp_path, backend=FakeBackend(step_delay=0.05), sync_timeout_s=0.2) as http:
        r = await http.post(
            "/v1/videos/sync", data={"prompt": "x", **SMALL_FORM, "num_inference_steps": "10"}
        )
        assert r.status_code == 504
        assert r.json()["error"]["message"] == "Video generation timed out after 0.2s."
        assert r.json()["error"]["type"] == "Gateway Timeout"
        done = await poll_job(http, r.headers["x-video-id"])
        assert done["status"] == "completed"


async def test_auth_request_ids_and_open_routes(tmp_path):
    async with asgi_server(tmp_path, api_key="sekret") as http:
        wrong = ("", "Bearer wrong", "sekret", "Bearer sekre", "Bearer  sekret", "Basic sekret", "Bearer")
        for auth in wrong:
            r = await http.get("/v1/videos", headers={"Authorization": auth} if auth else {})
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, auth
        for auth in ("bearer sekret", "BEARER sekret"):  # the scheme in any case, as vLLM takes it
            assert (await http.get("/v1/videos", headers={"Authorization": auth})).status_code == 200, auth
        ok = await http.get("/v1/models", headers={"Authorization": "Bearer sekret", "X-Request-Id": "abc"})
        assert ok.status_code == 200 and ok.headers["x-request-id"] == "abc"
        card = ok.json()["data"][0]
        assert ok.json()["object"] == "list" and card["id"] == "test-model" and card["object"] == "model"
        for path in ("/health", "/metrics", "/version", "/openapi.json"):
            r = await http.get(path)
            assert r.status_code == 200, path
            assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        assert (await http.get("/health")).json() == {"status": "healthy"}
    async with asgi_server(tmp_path / "two", api_key=("k1", "k2")) as http:  # vLLM's --api-key K1 K2
        for auth, status in (
            ("Bearer k1", 200),
            ("Bearer k2", 200),
            ("Bearer k3", 401),
            ("Bearer k1 k2", 401),
        ):
            assert (await http.get("/v1/videos", headers={"Authorization": auth})).status_code == status, auth


@pytest.mark.parametrize("tracking", [True, False])
async def test_ping_and_server_load(tmp_path, tracking):
    """vLLM's /ping (the /health answer, GET and POST) and /load: requests using the model in flight, counted
    with --enable-server-load-tracking until their response is sent (0 without it)."""
    backend = FakeBackend(step_delay=0.05)
    async with asgi_server(tmp_path, backend=backend, app_kw={"server_load_tracking": tracking}) as http:
        for method in ("GET", "POST"):
            r = await http.request(method, "/ping")
            assert r.status_code == 200 and r.content == b""  # vLLM's: an empty 200
        assert (await http.get("/load")).json() == {"server_load": 0}
        sync = asyncio.create_task(
            http.post("/v1/videos/sync", data={"prompt": "x", **SMALL_FORM, "num_inference_steps": "8"})
        )
        for _ in range(1000):  # until the engine thread prepared the job (the event loop must keep running)
            if backend.live:
                break
            await asyncio.sleep(0.01)
        assert (await http.get("/load")).json() == {"server_load": int(tracking)}
        assert (await http.get("/v1/videos")).status_code == 200  # the job API's reads do not count
        assert (await http.get("/load")).json() == {"server_load": int(tracking)}
        assert (await sync).status_code == 200
        assert (await http.post("/v1/videos", data={"prompt": ""})).status_code == 400
        assert (await http.get("/load")).json() == {"server_load": 0}


async def test_unknown_route_and_method_use_the_envelope(tmp_path):
    async with asgi_server(tmp_path) as http:
        r = await http.get("/v2/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "Not Found"
        r = await http.put("/v1/videos")
        assert r.status_code == 405 and r.json()["error"]["code"] == 405
        assert (
            r.headers["allow"] == "GET, POST"
        )  # every method of the path (Starlette named its first route's)
        r = await http.patch("/v1/videos/video_gen_" + "0" * 32)
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
        assert (await http.post("/v1/videos/x/content")).headers["allow"] == "GET, HEAD"


async def test_queue_full_429_with_retry_after(tmp_path):
    async with asgi_server(tmp_path, backend=FakeBackend(step_delay=0.05), max_queued_requests=1) as http:
        await http.post("/v1/videos", data={"prompt": "x", **SMALL_FORM, "num_inference_steps": "100"})
        await asyncio.to_thread(wait_until, lambda: http.engine_client.num_running == 1)  # queue empty again
        assert (await http.post("/v1/videos", data={"prompt": "y", **SMALL_FORM})).status_code == 200
        r = await http.post("/v1/videos", data={"prompt": "z", **SMALL_FORM})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "Too Many Requests"
        text = (await http.get("/metrics")).text
        assert 'worldserve:request_rejected_total{model_name="test-model",reason="queue_full"} 1.0' in text


async def test_upload_limit_413(tmp_path):
    async with asgi_server(tmp_path, max_upload_bytes=1024) as http:
        r = await http.post(
            "/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", b"0" * 4096)}
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == 413

        async def chunks():  # no Content-Length: the byte counter catches it
            for _ in range(8):
                yield b'{"prompt": "' + b"x" * 200

        r = await http.post("/v1/videos", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413


async def test_metrics_families(tmp_path):
    async with asgi_server(tmp_path) as http:
        job = (await http.post("/v1/videos", data={"prompt": "x", **SMALL_FORM})).json()
        await poll_job(http, job["id"])
        failed = (await http.post("/v1/videos", data={"prompt": "__fail__:prepare", **SMALL_FORM})).json()
        await poll_job(http, failed["id"])
        # the engine thread counts a job right after storing its status: wait for the counts to land
        for _ in range(500):
            text = (await http.get("/metrics")).text
            if 'request_failure_total{model_name="test-model",status="500"} 1.0' in text:
                break
            await asyncio.sleep(0.01)
        for family in ("num_requests_waiting", "num_requests_running", "step_time_seconds_bucket",
                       "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                       'stage_duration_seconds_count{model_name="test-model",stage="encode"}',
                       "request_success_total", 'request_failure_total{model_name="test-model",status="500"} 1.0',
                       "peak_memory_mb"):  # fmt: skip
            assert f"worldserve:{family}" in text, family
        # the same numbers under vLLM-Omni's names (dashboards built for vLLM-Omni), and process_*
        for sample in ('vllm:omni_requests_success_total{finished_reason="stop",model_name="test-model"} 1.0',
                       'vllm:omni_requests_success_total{finished_reason="abort",model_name="test-model"} 1.0',
                       'vllm:omni_e2e_request_latency_seconds_count{model_name="test-model"} 1.0',
                       'vllm:omni_e2e_request_latency_s_count{model_name="test-model"} 1.0',
                       'vllm:omni_request_queue_time_seconds_count{model_name="test-model"} 1.0',
                       'vllm:omni_num_requests_running{model_name="test-model"} 0.0',
                       'vllm:omni_num_requests_waiting{model_name="test-model"} 0.0',
                       'vllm:omni_requests_failed_total{model_name="test-model",reason="error"} 1.0'):  # fmt: skip
            assert sample in text, sample
        assert "process_cpu_seconds_total" in text
        for sample in ('worldserve:chat_requests_running{model_name="test-model"} 0.0',  # before any chat
                       'vllm:num_requests_running{engine="0",model_name="test-model"} 0.0'):  # fmt: skip
            assert sample in text, sample


async def test_an_engine_crash_answers_waiting_sync_requests_at_once(tmp_path):
    """A bug that kills the engine loop (here the store failing as progress is saved): health says so, every
    waiting sync request is answered 503 at once (it waited out the sync timeout, 600 s, before), and the
    jobs stay queued for the next start."""
    async with asgi_server(tmp_path, backend=FakeBackend(step_delay=0.05), sync_timeout_s=30) as http:
        store = http.engine_client.store
        sync = asyncio.create_task(
            http.post("/v1/videos/sync", data={"prompt": "x", **SMALL_FORM, "num_inference_steps": "20"})
        )
        await asyncio.sleep(0.2)

        def broken(*_a, **_k):
            raise RuntimeError("disk I/O error")

        store.set_progress = broken
        answer = await asyncio.wait_for(sync, 10)
        assert answer.status_code == 503, answer.text
        message = answer.json()["error"]["message"]
        assert "engine has stopped (disk I/O error)" in message and "resumes after a restart" in message
        assert (await http.get("/health")).status_code == 503
        job = (await http.get(f"/v1/videos/{answer.headers['x-video-id']}")).json()
        assert job["status"] == "queued"


async def test_a_delete_answers_a_sync_request_waiting_on_the_mp4_encode(tmp_path):
    """DELETE while the job's MP4 is being encoded: the waiting sync request gets its 404 at once, not when
    the encode ends."""
    encoding, release = threading.Event(), threading.Event()

    def held_encoder(frames, *args, **kw):
        encoding.set()
        release.wait(30)  # the encode ends only once the sync request has its answer
        return b"FAKEMP4"

    async with asgi_server(tmp_path, encoder=held_encoder) as http:
        sync = asyncio.create_task(http.post("/v1/videos/sync", data={"prompt": "x", **SMALL_FORM}))
        await asyncio.to_thread(encoding.wait, 10)
        [job] = (await http.get("/v1/videos")).json()["data"]
        assert (await http.delete(f"/v1/videos/{job['id']}")).status_code == 200
        try:
            answer = await asyncio.wait_for(sync, 10)
        finally:
            release.set()
        assert answer.status_code == 404, answer.text


async def test_shutdown_stops_intake_with_503(tmp_path):
    async with asgi_server(tmp_path, backend=FakeBackend(step_delay=0.02)) as http:
        running = (
            await http.post("/v1/videos", data={"prompt": "x", **SMALL_FORM, "num_inference_steps": "200"})
        ).json()
        sync = asyncio.create_task(
            http.post("/v1/videos/sync", data={"prompt": "queued behind", **SMALL_FORM})
        )
        await asyncio.sleep(0.1)
        http.engine_client.begin_shutdown(0.1)
        r = await http.post("/v1/videos", data={"prompt": "late", **SMALL_FORM})
        assert r.status_code == 503 and r.json()["error"]["type"] == "Service Unavailable"
        health = await http.get("/health")
        assert health.status_code == 503 and health.json() == {
            "status": "unhealthy",
            "reason": "shutting down",
        }
        answer = await sync  # its job stays queued: answered at once, not after the running job stops
        assert answer.status_code == 503 and "resumes after a restart" in answer.json()["error"]["message"]
        for _ in range(500):  # the running job is parked for restart at its next step after the timeout
            if (await http.get(f"/v1/videos/{running['id']}")).json()["status"] == "queued":
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the running job was not parked for restart")


async def test_json_numbers_past_the_int_limit_and_clients_gone_mid_body(tmp_path, caplog):
    """A JSON number of more digits than Python converts (4300) is a 400, not a 500; a client that leaves
    while its body is read is a quiet 499 (no traceback, no 'unhandled error')."""
    from serving_helpers import make_client

    from worldserve.api.app import build_app

    async with asgi_server(tmp_path) as http:
        raw = '{"prompt": "x", "n": %s}' % ("9" * 5000)
        r = await http.post(
            "/v1/images/generations", content=raw, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400 and "4300 digits" in r.json()["error"]["message"], r.text
    app = build_app(
        make_client(tmp_path / "gone"), sync_timeout_s=5, max_upload_bytes=2**20, shutdown_timeout_s=0.3
    )
    sent: list[dict] = []
    chunks = iter(
        [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}, {"type": "http.disconnect"}]
    )

    async def receive():
        return next(chunks)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/images/generations", "raw_path": b"/v1/images/generations",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")]}  # fmt: skip
    async with app.router.lifespan_context(app):
        await app(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert "unhandled error" not in caplog.text

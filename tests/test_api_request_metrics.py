"""The video / image request counters on /metrics (FakeBackend, no socket): the failure, rejection and
vLLM-Omni success / failure families export their label values as 0 from the start (dashboards show 0, not
"no data"), and an image request of n images counts once (vLLM-Omni runs it as one request with
num_outputs_per_prompt n): succeeded, failed or timed out."""

from __future__ import annotations

import asyncio

import pytest
from serving_helpers import asgi_server
from test_api_chat_queue_metrics import gauge

from worldserve.engine.fake_backend import FakeBackend

pytestmark = pytest.mark.anyio
M = {"model_name": "test-model"}
IMAGE = {"size": "32x32", "num_inference_steps": 2}


async def test_the_request_counters_start_at_zero(tmp_path):
    async with asgi_server(tmp_path) as http:
        text = (await http.get("/metrics")).text
    for name in ("worldserve:request_success_total", "worldserve:request_cancelled_total"):
        assert gauge(text, name, M) == 0
    for status in ("400", "500", "503", "504", "507"):
        assert gauge(text, "worldserve:request_failure_total", {**M, "status": status}) == 0
    for reason in ("queue_full", "shutting_down", "storage", "too_large"):
        assert gauge(text, "worldserve:request_rejected_total", {**M, "reason": reason}) == 0
    for reason in ("invalid_request", "unavailable", "timeout", "error"):
        assert gauge(text, "vllm:omni_requests_failed_total", {**M, "reason": reason}) == 0
    for reason in ("stop", "abort"):
        assert gauge(text, "vllm:omni_requests_success_total", {**M, "finished_reason": reason}) == 0


async def test_an_image_request_of_n_images_counts_once(tmp_path):
    async with asgi_server(tmp_path, backend=FakeBackend(step_delay=0.02), sync_timeout_s=1.0) as http:
        before = (await http.get("/metrics")).text
        r = await http.post("/v1/images/generations", json={"prompt": "x", "n": 3, **IMAGE, "seed": 1})
        assert r.status_code == 200 and len(r.json()["data"]) == 3
        r = await http.post("/v1/images/generations", json={"prompt": "__fail__:prepare", "n": 2, **IMAGE})
        assert r.status_code == 500
        r = await http.post("/v1/images/generations", json={"prompt": "x", "n": 2, **IMAGE,
                                                              "num_inference_steps": 100})  # fmt: skip
        assert r.status_code == 504
        for _ in range(200):  # an aborted request is counted when the engine takes its abort
            after = (await http.get("/metrics")).text
            if gauge(after, "worldserve:request_failure_total", {**M, "status": "504"}) == 1:
                break
            await asyncio.sleep(0.02)

    def delta(name: str, **labels: str) -> float:
        return gauge(after, name, {**M, **labels}, 0.0) - gauge(before, name, {**M, **labels}, 0.0)

    assert delta("worldserve:request_success_total") == 1
    assert delta("vllm:omni_requests_success_total", finished_reason="stop") == 1
    for name in ("worldserve:e2e_request_latency_seconds_count", "vllm:omni_e2e_request_latency_seconds_count",
                 "vllm:omni_e2e_request_latency_s_count", "vllm:omni_request_queue_time_seconds_count"):  # fmt: skip
        assert delta(name) == 1, name
    assert delta("worldserve:request_failure_total", status="500") == 1
    assert delta("worldserve:request_failure_total", status="504") == 1
    assert delta("vllm:omni_requests_failed_total", reason="error") == 1
    assert delta("vllm:omni_requests_failed_total", reason="timeout") == 1
    assert delta("vllm:omni_requests_success_total", finished_reason="abort") == 2  # the two failures
    assert delta("worldserve:request_cancelled_total") == 0  # the failed one's other image: not counted

"""The periodic stats line (api/stats_log.py; vLLM's, off with --disable-log-stats, its period
$VLLM_LOG_STATS_INTERVAL): throughputs and denoising steps over the interval, queues and cache figures as they
are, all read from the /metrics registry; INFO while there is work, DEBUG when idle; logged by a running
app's lifespan."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest
from serving_helpers import SMALL_FORM, asgi_server, poll_job
from test_serve_compat_flags import config

from worldserve.api.metrics import Metrics
from worldserve.api.stats_log import StatsLog
from worldserve.commands import serve


def test_a_line_reports_the_interval_and_the_queues():
    metrics, queue = Metrics("m"), {"waiting": 2, "running": 1}
    chats = {"waiting": 0, "running": 1}  # the chat worker's queues (a preempted chat would wait)
    metrics.track_queue(lambda: queue["waiting"], lambda: queue["running"])
    metrics.track_chat_queue(lambda: chats["waiting"], lambda: chats["running"])
    stats = StatsLog(metrics.registry, 10.0)
    metrics.on_chat_started(120)
    metrics.on_chat_generated(4)  # 10 tokens sampled, in two steps
    metrics.on_chat_generated(6)
    metrics.on_step(5.0, 1)
    metrics.on_step(5.5, 1)
    stats.last_t -= 10.0  # as if the interval had lasted 10 s
    text, active = stats.line()
    assert re.fullmatch(
        r"Chats: avg prompt throughput: 12\.0 tokens/s, avg generation throughput: 1\.0 tokens/s, running: 1 reqs, "
        r"waiting: 0 reqs, GPU KV cache usage: 0\.0%, prefix cache hit rate: 0\.0%; videos: running: 1 reqs, "
        r"waiting: 2 reqs, denoising steps: 2 \(5\.25 s a step\)",
        text,
    ), text
    assert active
    queue.update(waiting=0, running=0)
    chats.update(running=0)
    metrics.on_chat_ended("stop")
    text, active = stats.line()  # nothing since: idle
    assert (
        "avg prompt throughput: 0.0 tokens/s" in text and text.endswith("denoising steps: 0") and not active
    )


def test_the_period_comes_from_the_environment_and_the_flag_turns_it_off(monkeypatch):
    assert serve.app_settings(config()).stats_interval_s == 10.0
    assert serve.app_settings(config("--disable-log-stats")).stats_interval_s is None
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    assert serve.app_settings(config()).stats_interval_s == 2.5
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0")
    with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL"):
        config().resolve()


@pytest.mark.anyio
async def test_a_running_app_logs_its_work(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="worldserve.stats"):
        async with asgi_server(tmp_path, app_kw={"stats_interval_s": 0.05}) as http:
            job = (await http.post("/v1/videos", data={**SMALL_FORM, "prompt": "a cat"})).json()
            await poll_job(http, job["id"])
            lines = [r for r in caplog.records if r.name == "worldserve.stats"]
            while not any(r.levelno == logging.DEBUG for r in lines[1:]):  # ... until an idle line comes
                await asyncio.sleep(0.05)
                lines = [r for r in caplog.records if r.name == "worldserve.stats"]
        steps = sum(int(re.search(r"denoising steps: (\d+)", r.getMessage())[1]) for r in lines)
        assert steps == int(SMALL_FORM["num_inference_steps"]), [r.getMessage() for r in lines]
        assert any(r.levelno == logging.INFO for r in lines)
        count = len(lines)
        async with asgi_server(tmp_path / "quiet") as http:  # build_app's default: no stats line
            await http.get("/health")
    assert len([r for r in caplog.records if r.name == "worldserve.stats"]) == count

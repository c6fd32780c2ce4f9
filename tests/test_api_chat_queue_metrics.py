"""The Reasoner's running / waiting chats and their time to first token as /metrics and the stats line show
them, over real HTTP (uvicorn on loopback) with a scripted chat backend whose chats the test preempts: the
gauges are the chat worker's queues at scrape time (vLLM's scheduler: a preempted request is waiting, not
running), and each choice of a non-streamed n > 1 request has the time to first token the worker saw, not
the time its reader got to it."""

from __future__ import annotations

import math
import threading

import httpx
import pytest
from serving_helpers import make_client, serve_app, wait_until
from test_api_chat_lifecycle import EndlessBackend

from worldserve.api.stats_log import StatsLog

MODEL = "test-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 100_000}
LLM = {"model_name": MODEL, "engine": "0"}  # vLLM's labels
WS = {"model_name": MODEL}


@pytest.fixture
def served(tmp_path):
    from worldserve.api.app import build_app

    backend = EndlessBackend()
    client = make_client(tmp_path, model_name=MODEL, chat_backend=backend, max_num_seqs=2)
    app = build_app(client, shutdown_timeout_s=1.0)
    with serve_app(app, name="test-chat-queue-metrics") as url:
        yield url, app, backend


def gauge(text: str, name: str, labels: dict[str, str], default: float | None = None) -> float:
    """The sample `name` labelled exactly `labels` in a /metrics text (`default` when absent, else an error)."""
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        found, _, rest = series.partition("{")
        pairs = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)
        if found == name and {k: v.strip('"') for k, v in pairs.items()} == labels:
            return float(value)
    if default is not None:
        return default
    raise AssertionError(f"no {name}{labels}")


def queues(url: str) -> tuple[float, float, float, float]:
    """(vllm running, vllm waiting, worldserve running, worldserve waiting) now."""
    text = httpx.get(url + "/metrics").text
    return (gauge(text, "vllm:num_requests_running", LLM), gauge(text, "vllm:num_requests_waiting", LLM),
            gauge(text, "worldserve:chat_requests_running", WS),
            gauge(text, "worldserve:chat_requests_waiting", WS))  # fmt: skip


def start_chats(url: str, n: int) -> tuple[list[threading.Thread], list[int]]:
    """`n` chats of BODY posted on threads of their own: (the threads, their status codes as they answer)."""
    answers: list[int] = []

    def chat() -> None:
        answers.append(httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30).status_code)

    threads = [threading.Thread(target=chat, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, answers


def test_a_preempted_chat_counts_as_waiting_not_running(served):
    """Two chats run (max_num_seqs 2) and a third waits; one running chat is preempted: 1 running, 2 waiting
    (vLLM moves a preempted request back to waiting), in the vllm:* and worldserve:* gauges and the stats
    line; resumed, it runs again; all ended, nothing runs nor waits."""
    url, app, backend = served
    threads, answers = start_chats(url, 3)
    wait_until(lambda: queues(url) == (2, 1, 2, 1))
    backend.sessions[1].preempted = True
    wait_until(lambda: queues(url) == (1, 2, 1, 2))
    text, _ = StatsLog(app.state.ws.metrics.registry, 10.0).line()
    assert "running: 1 reqs, waiting: 2 reqs" in text, text
    backend.sessions[1].preempted = False
    wait_until(lambda: queues(url) == (2, 1, 2, 1))
    backend.finish.set()
    for t in threads:
        t.join(30)
    assert answers == [200, 200, 200]
    assert queues(url) == (0, 0, 0, 0)  # up to date before the answers left


def test_each_choice_of_a_non_streamed_request_has_its_own_time_to_first_token(served):
    """n=3 non-streamed: the choices decode together (60 tokens, ~0.3 s) and are read one after another; each
    one's time to first token is a step or so, not the time the API took to read the choices before it."""
    url, app, _ = served
    app.state.ws.client.chat_worker.max_num_seqs = 4  # the three together

    def ttft(text: str, le: str) -> tuple[float, float]:
        return (gauge(text, "vllm:time_to_first_token_seconds_bucket", {**LLM, "le": le}),
                gauge(text, "vllm:time_to_first_token_seconds_count", LLM))  # fmt: skip

    before = httpx.get(url + "/metrics").text
    out = httpx.post(url + "/v1/chat/completions", json={**BODY, "n": 3, "max_tokens": 60}, timeout=30)
    assert out.status_code == 200 and len(out.json()["choices"]) == 3
    after = httpx.get(url + "/metrics").text
    (fast0, n0), (fast1, n1) = ttft(before, "0.1"), ttft(after, "0.1")
    assert n1 - n0 == 3 and fast1 - fast0 == 3, (fast0, n0, fast1, n1)
    for name, labels in (("vllm:time_to_first_token_seconds_sum", LLM),
                         ("worldserve:chat_time_to_first_token_seconds_sum", WS)):  # fmt: skip
        total = gauge(after, name, labels) - gauge(before, name, labels, default=0.0)
        assert 0 < total < 0.3 and not math.isnan(total), (name, total)


def test_a_chat_whose_client_leaves_while_it_waits_is_counted_aborted(served):
    """Two chats run, a third waits; its client leaves before it started: vLLM counts that request finished
    with reason "abort" (it had not been counted at all: its count waited for a start that never came), and
    its per-request histograms count it too (vLLM's count what its success counter counts); the two that ran
    end "stop"."""
    url, _, backend = served
    reason = {**LLM, "finished_reason": "abort"}
    before = httpx.get(url + "/metrics").text
    threads, answers = start_chats(url, 2)
    wait_until(lambda: queues(url)[:2] == (2, 0))
    with pytest.raises(httpx.ReadTimeout):  # queued behind the two, it leaves
        httpx.post(url + "/v1/chat/completions", json=BODY, timeout=httpx.Timeout(30, read=0.5))
    wait_until(lambda: queues(url)[:2] == (2, 0))

    def aborted() -> float:
        return gauge(httpx.get(url + "/metrics").text, "vllm:request_success_total", reason)

    wait_until(lambda: aborted() == gauge(before, "vllm:request_success_total", reason) + 1)
    backend.finish.set()
    for t in threads:
        t.join(30)
    after = httpx.get(url + "/metrics").text
    assert answers == [200, 200]
    assert gauge(after, "vllm:request_success_total", {**LLM, "finished_reason": "stop"}) == 2
    assert gauge(after, "worldserve:chat_request_success_total", {**WS, "finish_reason": "abort"}) == 1
    # vLLM's per-request histograms count the requests its success counter does: the one that left too
    e2e = "vllm:e2e_request_latency_seconds_count"
    assert gauge(after, e2e, LLM) - gauge(before, e2e, LLM, default=0.0) == 3

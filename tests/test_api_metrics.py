"""GET /metrics on a real uvicorn (the tiny Reasoner for chats, FakeBackend video jobs): worldserve's chat
families and their vLLM twins (vllm/v1/metrics/loggers.py's names, buckets and `engine` label) after real
chats (the chat phases of vLLM's stats.py among them: queue, prefill, decode and inference time), vLLM-Omni's
`vllm:omni_*` families after a video job and a failed one, and vLLM's http_* families (tests/test_chat_timings.py
has the chat worker's timing reports on a scripted backend).
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
from serving_helpers import make_client, serve_app, wait_until
from websockets.sync.client import connect

from worldserve.api.metrics_vllm import (
    ITERATION_TOKEN_BUCKETS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
)
from worldserve.engine.fake_backend import FakeBackend

MODEL = "test-model"
LLM = {"engine": "0"}  # the label vLLM adds to its vllm:* families (not to vllm:omni_*)
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": TTFT_BUCKETS, "vllm:inter_token_latency_seconds": ITL_BUCKETS,
    "vllm:time_per_output_token_seconds": ITL_BUCKETS, "vllm:e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_queue_time_seconds": REQUEST_LATENCY_BUCKETS, "vllm:iteration_tokens_total": ITERATION_TOKEN_BUCKETS,
    "vllm:request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
    "vllm:request_time_per_output_token_seconds": ITL_BUCKETS,
}  # fmt: skip


@pytest.fixture(scope="module")
def backend():
    return FakeBackend(step_delay=0.002)


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory, backend):
    from transformers import AutoTokenizer

    from worldserve.api.app import build_app
    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    reasoner = Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=1024)
    client = make_client(tmp_path_factory.mktemp("metrics"), model_name=MODEL, chat_backend=reasoner,
                         backend=backend)  # fmt: skip
    with serve_app(build_app(client, shutdown_timeout_s=1.0), name="test-metrics-uvicorn") as url:
        yield url


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (name, its labels) -> value."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name, _, labels = series.partition("{")
            pairs = (kv.split("=", 1) for kv in labels.rstrip("}").split(",") if kv)
            out[name, frozenset((k, v.strip('"')) for k, v in pairs)] = float(value)
    return out


def value(samples: dict, name: str, **labels) -> float:
    """One sample labelled model_name=MODEL plus `labels` exactly (0 when absent)."""
    return samples.get((name, frozenset({"model_name": MODEL, **labels}.items())), 0.0)


def buckets(samples: dict, name: str, **labels) -> list[tuple[float, float]]:
    """A histogram's (le, cumulative count) pairs, in bucket order (+Inf last)."""
    want = {"model_name": MODEL, **labels}
    rows = [
        (float(dict(key)["le"]), v)
        for (n, key), v in samples.items()
        if n == name + "_bucket" and {k: x for k, x in key if k != "le"} == want
    ]
    return sorted(rows)


def check_histogram(samples: dict, name: str, **labels) -> None:
    """Cumulative bucket counts never decrease and end at _count (at +Inf)."""
    rows = buckets(samples, name, **labels)
    counts = [c for _, c in rows]
    assert rows and counts == sorted(counts), (name, rows)
    assert rows[-1][0] == math.inf and counts[-1] == value(samples, name + "_count", **labels), name


def _chat(url: str, stream: bool) -> tuple[int, int, str]:
    """One chat: (prompt tokens, completion tokens, finish_reason)."""
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "user", "content": "hey"}],
    }
    if not stream:
        out = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        return (
            out["usage"]["prompt_tokens"],
            out["usage"]["completion_tokens"],
            out["choices"][0]["finish_reason"],
        )
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    finish, usage = None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                finish = next((c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]), finish)
                usage = chunk.get("usage") or usage
    return usage["prompt_tokens"], usage["completion_tokens"], finish


def test_chat_metrics(server):
    before = scrape(server)
    chats = [_chat(server, stream=False), _chat(server, stream=True)]
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    prompt = sum(p for p, _, _ in chats)
    completion = sum(c for _, c, _ in chats)
    sampled = [c + (f == "stop") for _, c, f in chats]  # a stop token is sampled, not counted in usage
    for finish in {f for _, _, f in chats}:
        n = sum(f == finish for _, _, f in chats)
        assert delta("worldserve:chat_request_success_total", finish_reason=finish) == n
        assert delta("vllm:request_success_total", finished_reason=finish, **LLM) == n
    for reason in ("stop", "length", "abort"):  # every finished_reason exported from the start, as vLLM does
        assert (
            "vllm:request_success_total",
            frozenset({"model_name": MODEL, "finished_reason": reason, **LLM}.items()),
        ) in after
    for prefix, labels in (("worldserve:chat_", {}), ("vllm:", LLM)):
        assert delta(f"{prefix}prompt_tokens_total", **labels) == prompt
        assert delta(f"{prefix}generation_tokens_total", **labels) == completion
        assert delta(f"{prefix}time_to_first_token_seconds_count", **labels) == 2
        assert delta(f"{prefix}e2e_request_latency_seconds_count", **labels) == 2
        assert delta(f"{prefix}e2e_request_latency_seconds_sum", **labels) > 0
        assert delta(f"{prefix}request_queue_time_seconds_count", **labels) == 2
        assert (
            0
            <= delta(f"{prefix}request_queue_time_seconds_sum", **labels)
            < delta(f"{prefix}e2e_request_latency_seconds_sum", **labels)
        )
        assert delta(f"{prefix}inter_token_latency_seconds_count", **labels) == sum(n - 1 for n in sampled)
        assert delta(f"{prefix}inter_token_latency_seconds_sum", **labels) > 0
    # one observation per chat worker iteration: the prefill's prompt tokens plus the tokens sampled
    assert delta("vllm:iteration_tokens_total_sum", **LLM) == prompt + sum(sampled)
    assert delta("vllm:iteration_tokens_total_count", **LLM) >= 2
    assert delta("worldserve:chat_iteration_tokens_sum") == prompt + sum(sampled)
    assert delta("vllm:time_per_output_token_seconds_count", **LLM) == sum(
        n - 1 for n in sampled
    )  # vLLM 0.11's old name
    # vLLM's per-request mean TPOT: one a chat, its decode time over its tokens less one
    assert delta("vllm:request_time_per_output_token_seconds_count", **LLM) == 2
    tpot = delta("vllm:request_time_per_output_token_seconds_sum", **LLM)
    bound = delta("vllm:request_decode_time_seconds_sum", **LLM) / min(n - 1 for n in sampled)
    assert 0 < tpot <= bound * (1 + 1e-9), (tpot, bound)  # (equal when the chats have as many tokens)
    for name, bounds in VLLM_BUCKETS.items():  # vLLM's buckets exactly
        assert [le for le, _ in buckets(after, name, **LLM)] == [float(b) for b in bounds] + [math.inf], name
        check_histogram(after, name, **LLM)
    for name in (
        "worldserve:chat_e2e_request_latency_seconds",
        "worldserve:chat_inter_token_latency_seconds",
    ):
        check_histogram(after, name)
    assert (
        value(after, "vllm:num_requests_running", **LLM)
        == 0
        == value(after, "worldserve:chat_requests_running")
    )
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
    ):  # present; nothing held nor queued (nor preempted) now
        assert ((name, frozenset({"model_name": MODEL, **LLM}.items())) in after) and value(
            after, name, **LLM
        ) == 0
    for name in (
        "worldserve:chat_requests_waiting",
        "worldserve:kv_cache_usage_perc",
        "worldserve:num_preemptions_total",  # (a counter: it had been a gauge of a running total)
    ):
        assert (name, frozenset({"model_name": MODEL}.items())) in after and value(after, name) == 0


def test_per_chat_histograms_of_vllms_dashboard(server):
    """vLLM's Grafana dashboard's per-request panels: prompt and generation lengths (1-2-5 buckets up to the
    context length, 1024 here), and the phases of vLLM's stats.py, each chat once: queue (submitted to
    admitted), prefill (admitted to the first token), decode (first token to last) and inference (admitted
    to the last token: prefill + decode, within the end-to-end time less the queue)."""
    before = scrape(server)
    chats = [_chat(server, stream=False), _chat(server, stream=True)]
    after = scrape(server)

    def delta(name):
        return value(after, name, **LLM) - value(before, name, **LLM)

    assert delta("vllm:request_prompt_tokens_sum") == sum(p for p, _, _ in chats)
    assert delta("vllm:request_generation_tokens_sum") == sum(c for _, c, _ in chats)
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert delta(name + "_count") == 2
        assert [le for le, _ in buckets(after, name, **LLM)] == [
            1,
            2,
            5,
            10,
            20,
            50,
            100,
            200,
            500,
            1000,
            math.inf,
        ]
        check_histogram(after, name, **LLM)
    phases = ("prefill", "decode", "inference", "queue")
    for name in (f"vllm:request_{phase}_time_seconds" for phase in phases):
        assert delta(name + "_count") == 2 and delta(name + "_sum") > 0, name
        assert [le for le, _ in buckets(after, name, **LLM)] == [
            float(b) for b in REQUEST_LATENCY_BUCKETS
        ] + [math.inf]
        check_histogram(after, name, **LLM)
    prefill, decode, inference, queue = (delta(f"vllm:request_{phase}_time_seconds_sum") for phase in phases)
    assert inference == pytest.approx(prefill + decode, abs=1e-9)
    assert queue + inference <= delta("vllm:e2e_request_latency_seconds_sum")


def test_video_metrics_and_failures(server, backend):
    before = scrape(server)
    with httpx.Client(base_url=server, timeout=60) as http:
        small = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2}
        ok = http.post("/v1/videos", json={"prompt": "a cat", **small}).json()
        bad = http.post("/v1/videos", json={"prompt": "__fail__:prepare", **small}).json()
        for job in (ok, bad):
            wait_until(
                lambda job=job: (
                    http.get(f"/v1/videos/{job['id']}").json()["status"] in ("completed", "failed")
                )
            )
        backend.step_delay = 0.05
        try:
            long = http.post(
                "/v1/videos", json={"prompt": "a cat", **small, "num_inference_steps": 200}
            ).json()
            wait_until(lambda: http.get(f"/v1/videos/{long['id']}").json()["progress"] > 0)
            assert http.delete(f"/v1/videos/{long['id']}").status_code == 200  # deleted while it runs
        finally:
            backend.step_delay = 0.002
        wait_until(lambda: value(scrape(server), "worldserve:request_cancelled_total")
                   > value(before, "worldserve:request_cancelled_total"))  # fmt: skip

    # the observer runs just after the store records the outcome: wait for both reports
    def reported():
        now = scrape(server)
        done = value(now, "vllm:omni_e2e_request_latency_s_count") > value(
            before, "vllm:omni_e2e_request_latency_s_count"
        )
        return done and value(now, "vllm:omni_requests_failed_total", reason="error") > value(
            before, "vllm:omni_requests_failed_total", reason="error"
        )

    wait_until(reported)
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:omni_requests_success_total", finished_reason="stop") == 1
    # the failed job (vLLM-Omni's request_failed()) and the deleted one (an aborted request, as vLLM counts it)
    assert delta("vllm:omni_requests_success_total", finished_reason="abort") == 2
    assert delta("worldserve:request_cancelled_total") == 1
    assert (
        delta("vllm:omni_requests_failed_total", reason="error") == 1
    )  # FakeBackend's prepare failure: a 500
    assert delta("worldserve:request_failure_total", status="500") == 1
    for name in ("vllm:omni_e2e_request_latency_seconds", "vllm:omni_e2e_request_latency_s",
                 "vllm:omni_request_queue_time_seconds", "worldserve:e2e_request_latency_seconds"):  # fmt: skip
        assert delta(name + "_count") == 1, name
        check_histogram(after, name)
    assert delta("vllm:omni_e2e_request_latency_seconds_sum") > 0
    # vLLM's families carry model_name and engine; vLLM-Omni's pipeline families model_name only
    for (name, labels), _ in after.items():
        keys = {k for k, _ in labels}
        if name.startswith("vllm:omni_"):
            assert "engine" not in keys and ("model_name", MODEL) in labels, name
        elif name.startswith("vllm:"):
            assert ("engine", "0") in labels and ("model_name", MODEL) in labels, name
    assert {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"} <= {name for name, _ in after}


def test_http_families_as_vllms_instrumentator_exports_them(server):
    """vLLM's http_* families: each request counted under its route template, method and status class, with
    its latency (coarse by handler, fine overall) and sizes; /metrics itself and vLLM's other excluded routes
    are not counted; a path no route matches is handler "none", a made-up method "other" (a client cannot mint
    series)."""

    def http(samples: dict, name: str, **labels) -> float:
        return samples.get((name, frozenset(labels.items())), 0.0)

    before = scrape(server)
    with httpx.Client(base_url=server, timeout=60) as client:
        assert client.get("/v1/models").status_code == 200
        assert client.get("/v1/videos/video_gen_nope").status_code == 404
        assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}).status_code == 400
        assert client.get("/nowhere").status_code == 404
        assert client.get("/healthz").status_code == 404  # (not /health: counted as "none")
        assert client.get("/health").status_code == 200
        for made_up in ("X1234", "X5678"):
            assert client.request(made_up, "/nowhere").status_code == 404
    after = scrape(server)
    for handler, method, status, n in (("/v1/models", "GET", "2xx", 1), ("/v1/videos/{video_id}", "GET", "4xx", 1),
                                       ("/v1/chat/completions", "POST", "4xx", 1), ("none", "GET", "4xx", 2),
                                       ("none", "other", "4xx", 2)):  # fmt: skip
        labels = {"handler": handler, "method": method, "status": status}
        assert (
            http(after, "http_requests_total", **labels) - http(before, "http_requests_total", **labels) == n
        )
    assert not any(dict(k).get("handler") in ("/metrics", "/health") for (_, k) in after)
    assert not any(dict(k).get("method", "").startswith("X") for (_, k) in after)
    count = http(after, "http_request_duration_seconds_count", handler="/v1/models", method="GET")
    assert count >= 1 and http(after, "http_request_duration_seconds_bucket", handler="/v1/models",
                               method="GET", le="+Inf") == count  # fmt: skip
    assert http(after, "http_request_duration_highr_seconds_count") >= 4
    assert http(after, "http_response_size_bytes_sum", handler="/v1/models") > 0
    assert http(after, "http_request_size_bytes_count", handler="/v1/chat/completions") >= 1


def test_metrics_negotiate_the_format_and_filter_by_name(server):
    """As prometheus_client's ASGI app answers vLLM's /metrics: OpenMetrics for a scrape that asks for it (the
    text format otherwise), and only the families a scrape names with `name[]` (every family had come, in the
    text format, whatever was asked); process_* is filterable too. vLLM's FinishReason values, error and
    repetition among them, are exported from the start. As vLLM mounts the app, /metrics/ and a POST are served
    (they were a 307 and a 405), gzipped when the scrape accepts it, and none of them counted in http_*."""
    with httpx.Client(base_url=server, timeout=60) as client:
        plain = client.get("/metrics")
        om = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        some = client.get("/metrics", params=[("name[]", "vllm:request_success_total"),
                                              ("name[]", "process_open_fds")])  # fmt: skip
        # vLLM's mount: /metrics/ and POST answer too (they were a 307 and a 405), gzip when accepted
        slash, post = client.get("/metrics/"), client.post("/metrics")
        zipped = client.get("/metrics", headers={"Accept-Encoding": "gzip"})
        unzipped = client.get("/metrics", headers={"Accept-Encoding": "identity"})
        client.get("/v1/models")  # (one request counted in http_*, whichever tests ran before)
        served = client.get("/metrics").text.splitlines()
    # a WebSocket handshake on the mount is closed (prometheus_client's app had raised on its scope)
    with pytest.raises(Exception, match="HTTP 403"):
        with connect(server.replace("http", "ws") + "/metrics", open_timeout=10):
            pass
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF") and not plain.text.rstrip().endswith("# EOF")
    names = {line.split("{")[0].split(" ")[0] for line in some.text.splitlines() if not line.startswith("#")}
    assert names == {"vllm:request_success_total", "process_open_fds"}, names
    reasons = {line.split('finished_reason="')[1].split('"')[0] for line in some.text.splitlines()
               if line.startswith("vllm:request_success_total")}  # fmt: skip
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    for answer in (slash, post, zipped):
        assert answer.status_code == 200 and "vllm:request_success_total" in answer.text
    assert zipped.headers["content-encoding"] == "gzip" and "content-encoding" not in unzipped.headers
    counted = [line for line in served if line.startswith("http_requests_total")]
    assert counted and not any("/metrics" in line for line in counted), counted

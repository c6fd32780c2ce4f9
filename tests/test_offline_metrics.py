"""`Engine.get_metrics()`, vLLM's `LLM.get_metrics()`: what `worldserve serve` exports at /metrics for the
Engine's own requests, as vLLM's reader records (frozen Counter / Gauge / Histogram). On the tiny checkpoint
(CPU, float32): a video and chats (whole, streamed to the end, left early) counted under the server's names, the
snapshot equal to the server's OpenMetrics scrape of the same Metrics. On the fake backend: a list of two
same-shape videos stepping as batches of 2, a failure counted as the server counts one, two Engines each with
their own counts, the counts still read after close().
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading

import pytest
from offline_engines import TINY, engine_fixture

SMALL = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 3}


engine = engine_fixture()


@pytest.fixture(scope="module")
def fake():
    from worldserve import Engine

    with Engine(None, backend="fake", max_batch_size=2) as engine:
        yield engine


def series(metrics: list, name: str, **labels: str) -> list:
    """The records of family `name` whose labels include `labels`."""
    return [m for m in metrics if m.name == name and labels.items() <= m.labels.items()]


def one(metrics: list, name: str, **labels: str):
    (record,) = series(metrics, name, **labels)
    return record


def counted(before: list, after: list, name: str, **labels: str) -> float:
    """How much a counter (value) or histogram (count) grew between two snapshots."""

    def read(metrics: list) -> float:
        found = series(metrics, name, **labels)
        return sum(getattr(m, "count", getattr(m, "value", 0)) for m in found)

    return read(after) - read(before)


def test_a_video_and_a_chat_counted_under_the_servers_names(engine):
    """The request counted (worldserve's and vLLM-Omni's names), its stages timed; the chat's prompt and
    generation tokens (worldserve's and vLLM's names: the usage it answered with), its end by finish reason
    and the chat worker's per-chat histograms; records of vLLM's reader's shape, frozen."""
    from worldserve.offline import Counter, Gauge, Histogram

    before = engine.get_metrics()
    engine.generate_video("A red fox runs through fresh snow", seed=7, **TINY)
    answer = engine.chat("What does a fox eat?", max_tokens=4, temperature=0)
    after = engine.get_metrics()

    assert counted(before, after, "worldserve:request_success") == 1
    assert counted(before, after, "vllm:omni_requests_success", finished_reason="stop") == 1
    for stage in ("prepare", "diffuse", "decode", "encode"):
        assert counted(before, after, "worldserve:stage_duration_seconds", stage=stage) == 1, stage
    assert one(after, "worldserve:stage_duration_seconds", stage="diffuse").count >= 1
    assert counted(before, after, "worldserve:step_time_seconds") == TINY["num_inference_steps"]
    usage = answer.usage
    for name in ("worldserve:chat_generation_tokens", "vllm:generation_tokens"):
        assert counted(before, after, name) == usage.completion_tokens > 0, name
    for name in ("worldserve:chat_prompt_tokens", "vllm:prompt_tokens"):
        assert counted(before, after, name) == usage.prompt_tokens > 0, name
    # the tokens of every step of the chat, its last included (counted before the answer was delivered)
    for name in ("worldserve:chat_iteration_tokens", "vllm:iteration_tokens_total"):
        grew = one(after, name).sum - (one(before, name).sum if series(before, name) else 0)
        assert grew == usage.prompt_tokens + usage.completion_tokens, (name, grew)
    reason = answer.finish_reason
    assert counted(before, after, "worldserve:chat_request_success", finish_reason=reason) == 1
    assert counted(before, after, "vllm:request_success", finished_reason=reason) == 1
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                 "worldserve:chat_e2e_request_latency_seconds"):  # fmt: skip
        assert counted(before, after, name) == 1, name

    success = one(after, "worldserve:request_success")
    assert isinstance(success, Counter) and isinstance(success.value, int)
    assert success.labels == {"model_name": engine.config.model.served_model_name}
    assert isinstance(one(after, "worldserve:num_requests_running"), Gauge)
    e2e = one(after, "worldserve:e2e_request_latency_seconds")
    assert isinstance(e2e, Histogram) and e2e.sum > 0
    # vLLM's buckets: cumulative counts by the `le` label's text, "+Inf" last holding the count
    counts = list(e2e.buckets.values())
    assert list(e2e.buckets)[-1] == "+Inf" and counts == sorted(counts) and counts[-1] == e2e.count
    with pytest.raises(dataclasses.FrozenInstanceError):
        success.value = 0  # type: ignore[misc]


def test_a_streamed_chat_is_counted_when_it_ends_and_when_it_is_left(engine):
    """A stream read to its last piece counts its finish reason before the loop ends (it had been left
    uncounted while its stream lay unclosed); one left early counts as vLLM counts an aborted request."""
    before = engine.get_metrics()
    pieces = list(engine.stream_chat("Describe the fox.", max_tokens=3, temperature=0))
    assert pieces
    middle = engine.get_metrics()
    assert counted(before, middle, "worldserve:chat_request_success", finish_reason="length") == 1
    assert counted(before, middle, "vllm:request_success", finished_reason="length") == 1

    stream = engine.stream_chat("Describe the fox.", max_tokens=500, temperature=0)
    next(stream)
    stream.close()
    after = engine.get_metrics()
    assert counted(middle, after, "worldserve:chat_request_success", finish_reason="abort") == 1
    assert counted(middle, after, "vllm:request_success", finished_reason="abort") == 1


def test_the_snapshot_is_the_servers_scrape(engine):
    """Every series of the `worldserve:` / `vllm:` families of an OpenMetrics scrape of the Engine's Metrics
    through the server's /metrics app (api/metrics_exposition.py, what Prometheus reads) is in the snapshot
    with the same value (counters by their `_total` sample, histograms' buckets, count and sum), and nothing
    else is; the HTTP and process families are left out."""
    import httpx
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from worldserve.api.metrics_exposition import exposition_app
    from worldserve.offline import Counter, Gauge, Histogram

    engine.generate_video("a cat", seed=3, **TINY)
    engine.chat("Name a fox's prey.", max_tokens=3, temperature=0)
    # (private: the Metrics object the Engine's state holds, to scrape it as the server's /metrics would)
    registry = engine._state.metrics.registry

    async def scrape() -> str:
        transport = httpx.ASGITransport(app=exposition_app(registry))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
            response = await http.get("/metrics", headers={"Accept": accept})
        assert response.headers["content-type"].startswith("application/openmetrics-text")
        return response.text

    # a scrape between two equal snapshots: nothing moved meanwhile (the chat worker observes a step's tokens
    # per iteration just after it hands the chat its last token; the stream left early ends at its next step)
    for _ in range(1000):
        snapshot = engine.get_metrics()
        text = asyncio.run(scrape())
        if engine.get_metrics() == snapshot:
            break
    else:
        raise AssertionError("the metrics never held still for a scrape")
    scraped: dict = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(("worldserve:", "vllm:")):
            assert family.name.startswith(("http_", "process_")), family.name
            continue
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            key = (family.name, tuple(sorted(labels.items())))
            entry = scraped.setdefault(key, {"type": family.type, "buckets": {}})
            suffix = s.name[len(family.name) :]
            if suffix == "_bucket":
                entry["buckets"][s.labels["le"]] = s.value
            elif suffix in ("", "_total", "_count", "_sum"):
                entry[suffix] = s.value
    mine: dict = {}
    for m in snapshot:
        key = (m.name, tuple(sorted(m.labels.items())))
        assert key not in mine, key
        if isinstance(m, Histogram):
            mine[key] = {"type": "histogram", "buckets": m.buckets, "_count": m.count, "_sum": m.sum}
        elif isinstance(m, Counter):
            mine[key] = {"type": "counter", "buckets": {}, "_total": m.value}
        else:
            assert isinstance(m, Gauge)
            mine[key] = {"type": "gauge", "buckets": {}, "": m.value}
    assert mine.keys() == scraped.keys()
    for key, entry in scraped.items():
        assert mine[key].keys() == entry.keys(), key
        for field, value in entry.items():
            if field == "_sum":
                assert math.isclose(mine[key][field], value, rel_tol=1e-9), key
            else:
                assert mine[key][field] == value, (key, field)
    assert ("worldserve:request_success", (("model_name", engine.config.model.served_model_name),)) in mine
    assert any(name == "vllm:num_preemptions" for name, _ in mine)


def test_a_list_of_two_same_shape_videos_steps_as_batches_of_two(fake):
    """worldserve:step_batch_size (requests per denoising step): the list's every step held both."""
    before = fake.get_metrics()
    fake.generate_video(["a fox", "a cat"], **SMALL)
    after = fake.get_metrics()
    steps = SMALL["num_inference_steps"]
    assert counted(before, after, "worldserve:step_batch_size") == steps
    # (a series appears with its first observation: none before this engine's first step)
    empty = {"sum": 0.0, "buckets": {"1.0": 0, "2.0": 0}}
    earlier = next(({"sum": m.sum, "buckets": m.buckets} for m in series(before, "worldserve:step_batch_size")),
                   empty)  # fmt: skip
    batch = one(after, "worldserve:step_batch_size")
    assert batch.sum - earlier["sum"] == 2 * steps
    # no step of one request: the "1.0" bucket (at most one) did not grow, the "2.0" one grew by every step
    assert batch.buckets["1.0"] == earlier["buckets"]["1.0"]
    assert batch.buckets["2.0"] - earlier["buckets"]["2.0"] == steps
    assert counted(before, after, "worldserve:request_success") == 2


def test_a_failure_is_counted_as_the_server_counts_it(fake):
    """A request the backend fails at prepare: worldserve's failure by status (500) and vLLM-Omni's by
    reason ("error"; its success counter's "abort"), no success."""
    before = fake.get_metrics()
    with pytest.raises(RuntimeError):
        fake.generate_video("__fail__:prepare", **SMALL)
    after = fake.get_metrics()
    assert counted(before, after, "worldserve:request_failure", status="500") == 1
    assert counted(before, after, "vllm:omni_requests_failed", reason="error") == 1
    assert counted(before, after, "vllm:omni_requests_success", finished_reason="abort") == 1
    assert counted(before, after, "worldserve:request_success") == 0


@pytest.mark.parametrize("stage", ["prepare", "decode"])
def test_every_item_of_a_failing_list_is_counted_once(fake, stage):
    """[ok, failing]: the failure counted as the server counts it, and the other item, finished or stopped
    while the call failed, counted cancelled (the caller never got its MP4): every request of the list ends in
    the metrics once (a finished item's finish had stayed held, counted nowhere)."""
    endings = ("worldserve:request_success", "worldserve:request_failure", "worldserve:request_cancelled")
    for _ in range(3):
        before = fake.get_metrics()
        with pytest.raises(RuntimeError):
            fake.generate_video(["a fox", f"__fail__:{stage}"], **SMALL)
        # (the finished item's end may still be on its way from the encode pool: a hang guard, no timing)
        ended = threading.Event()
        for _ in range(3000):
            after = fake.get_metrics()
            if sum(counted(before, after, name) for name in endings) >= 2:
                break
            ended.wait(0.01)
        ended.wait(0.05)  # (nothing more comes: a third ending would show here)
        after = fake.get_metrics()
        assert counted(before, after, "worldserve:request_failure") == 1
        assert counted(before, after, "worldserve:request_success") == 0
        assert sum(counted(before, after, name) for name in endings) == 2


def test_two_engines_count_their_own_and_read_after_close():
    """Two Engines of one model in one process: each its own registry (no clash of their same-named series),
    each counting only its requests; the counts stay readable after close()."""
    from worldserve import Engine

    first = Engine(None, backend="fake")
    try:
        with Engine(None, backend="fake") as second:
            first.generate_video("a fox", **SMALL)
            first.generate_video("a cat", **SMALL)
            second.generate_video("a fox", **SMALL)
            assert one(first.get_metrics(), "worldserve:request_success").value == 2
            assert one(second.get_metrics(), "worldserve:request_success").value == 1
    finally:
        first.close()
    assert one(first.get_metrics(), "worldserve:request_success").value == 2
    assert one(first.get_metrics(), "worldserve:num_requests_running").value == 0


def test_requests_a_close_stops_are_counted_cancelled():
    """A list of four held in its first step (two running, two waiting) when the Engine closes: the call
    raises, and all four are counted cancelled, the waiting ones too (they had been counted nowhere)."""
    from worldserve import Engine

    engine = Engine(None, backend="fake", max_batch_size=2, shutdown_timeout=0)
    backend = engine._parts.backend  # (private: the fake backend's step gate holds the first step, no clock)
    backend.step_gate = held = threading.Event()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            engine.generate_video(["a", "b", "c", "d"], **SMALL)
        except BaseException as exc:  # noqa: BLE001 (recorded for the assertion)
            outcome.append(exc)

    before = engine.get_metrics()
    caller = threading.Thread(target=run)
    caller.start()
    for _ in range(3000):  # (a hang guard: until all four are in the engine)
        if engine.num_unfinished_requests == 4:
            break
        held.wait(0.01)
    closing = threading.Thread(target=engine.close)
    closing.start()
    held.wait(0.2)  # (the close under way: its stop set before the held step ends)
    held.set()
    closing.join(30)
    caller.join(30)
    after = engine.get_metrics()
    assert outcome and isinstance(outcome[0], RuntimeError), outcome
    assert counted(before, after, "worldserve:request_cancelled") == 4
    assert counted(before, after, "worldserve:request_success") == 0

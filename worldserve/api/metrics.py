"""Prometheus metrics, named `worldserve:*` and labelled `model_name` (vLLM scrapes `vllm:*` the same way).

`Metrics` is the engine's observer (on_step / on_finished / on_failed / on_cancelled are called from the engine and
encoder threads; prometheus-client is thread-safe) and owns its own CollectorRegistry, so several apps can
live in one process (tests). Queue depth and running count are read at scrape time through callbacks;
the GPU-memory gauge exists only when the server passes a reader (commands/serve.py does on CUDA).

Families: num_requests_waiting, num_requests_running (gauges); step_time_seconds, step_batch_size,
e2e_request_latency_seconds, request_queue_time_seconds, stage_duration_seconds{stage} (histograms);
request_success_total, request_failure_total{status}, request_cancelled_total, request_rejected_total{reason}
(counters of video and image requests; each, with the usual statuses and every reason, exported as 0 from
the start, so dashboards show 0 rather than no data; an image request counts once whatever its `n`, as vLLM-Omni counts a request);
peak_memory_mb (last finished request), gpu_memory_used_bytes (gauges). The Reasoner's chats: chat_prompt_tokens,
chat_generation_tokens, chat_request_success{finish_reason}, num_preemptions (counters, the last read at
scrape time); chat_requests_running / _waiting (the chat worker's queues read at scrape time: a preempted
chat waits, as in vLLM), kv_cache_usage_perc (gauges); chat_time_to_first_token_seconds, chat_inter_token_latency_seconds,
chat_e2e_request_latency_seconds, chat_request_queue_time_seconds, chat_iteration_tokens (histograms). The API
layer reports a chat's prompt tokens and end (engine/chat_metering.py, as the prompt upsampling does for its
chats); the chat worker its timings (the ChatObserver calls, engine/chat_observer.py: tokens per step, time to
first token, inter-token gaps, and each chat's ChatTimes: end-to-end, queue, prefill, decode and inference
time).

So that dashboards built for vLLM / vLLM-Omni find their series, the same numbers are also exported under
their names (serving-api.md §7.4, §11.3; `VllmMirror` in metrics_vllm.py: vLLM-Omni's `vllm:omni_*` for the
video and image requests, vLLM's `vllm:*` with its `engine` label for the Reasoner), the process's `process_*`,
and the HTTP layer's `http_*` (api/http_metrics.py, as vLLM's instrumentator exports them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from worldserve.api.http_metrics import HTTPMetrics
from worldserve.api.metrics_vllm import ITERATION_TOKEN_BUCKETS, ReadCounter, VllmMirror

if TYPE_CHECKING:
    from worldserve.engine.client import ChatTimes, EngineClient
    from worldserve.media.processor_cache import ProcessorCache

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STAGE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FAILURE_STATUSES = (400, 500, 503, 504, 507)
"""request_failure_total's statuses exported (as 0) from the start: the model refused the request, an error,
unavailable (shutdown, storage), a timeout, the disk full (others appear when they happen)."""
REJECT_REASONS = ("queue_full", "shutting_down", "storage", "too_large")
"""request_rejected_total's reasons, every one exported (as 0) from the start."""


class Metrics:
    def __init__(self, model_name: str, *, gpu_memory_bytes: Callable[[], float] | None = None):
        # auto_describe: every family filterable by /metrics?name[]=..., process_* too (as vLLM's default registry)
        self.registry = CollectorRegistry(auto_describe=True)
        self.http = HTTPMetrics(self.registry)  # vLLM's http_* families (api/http_metrics.py)
        r, label = self.registry, ["model_name"]
        self._label = {"model_name": model_name}
        self.waiting = Gauge(
            "worldserve:num_requests_waiting", "Video jobs queued for admission.", label, registry=r
        )
        self.running = Gauge(
            "worldserve:num_requests_running", "Video jobs holding denoise state.", label, registry=r
        )
        self.step_time = Histogram("worldserve:step_time_seconds", "Wall time of one batched denoising step.",
                                   label, buckets=STEP_BUCKETS, registry=r)  # fmt: skip
        self.batch_size = Histogram("worldserve:step_batch_size", "Requests per denoising step.", label,
                                    buckets=BATCH_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("worldserve:e2e_request_latency_seconds", "Submit to saved video.", label,
                             buckets=E2E_BUCKETS, registry=r)  # fmt: skip
        self.queue_time = Histogram("worldserve:request_queue_time_seconds", "Submit to admission.", label,
                                    buckets=E2E_BUCKETS, registry=r)  # fmt: skip
        self.stage = Histogram("worldserve:stage_duration_seconds", "Per-request stage wall time.",
                               [*label, "stage"], buckets=STAGE_BUCKETS, registry=r)  # fmt: skip
        self.success = Counter("worldserve:request_success", "Jobs completed.", label, registry=r)
        self.failure = Counter(
            "worldserve:request_failure",
            "Jobs failed once admitted, by error code (input refused before: "
            "http_requests_total; a sync request's 504 leaves its job running, counted by its own end).",
            [*label, "status"],
            registry=r,
        )
        self.cancelled = Counter("worldserve:request_cancelled", "Video / image jobs deleted and realtime video "
                                 "streams stopped before their end (a chat stopped early counts in "
                                 "chat_request_success{finish_reason=\"abort\"}).", label, registry=r)  # fmt: skip
        self.rejected = Counter("worldserve:request_rejected", "Requests refused before becoming a job.",
                                [*label, "reason"], registry=r)  # fmt: skip
        self.peak_memory = Gauge("worldserve:peak_memory_mb", "Peak accelerator memory of the last finished job.",
                                 label, registry=r)  # fmt: skip
        self.chat_prompt_tokens = Counter("worldserve:chat_prompt_tokens", "Reasoner prompt tokens prefilled.",
                                          label, registry=r)  # fmt: skip
        self.chat_generation_tokens = Counter("worldserve:chat_generation_tokens", "Reasoner tokens generated.",
                                              label, registry=r)  # fmt: skip
        self.chat_finished = Counter("worldserve:chat_request_success", "Chats finished, by finish reason.",
                                     [*label, "finish_reason"], registry=r)  # fmt: skip
        self.chat_running = Gauge("worldserve:chat_requests_running", "Chats prefilled and generating.", label,
                                  registry=r)  # fmt: skip
        self.chat_ttft = Histogram("worldserve:chat_time_to_first_token_seconds", "Chat submit to first token.",
                                   label, buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.chat_e2e = Histogram("worldserve:chat_e2e_request_latency_seconds", "Chat submit to its end.", label,
                                  buckets=E2E_BUCKETS, registry=r)  # fmt: skip
        self.chat_queue_time = Histogram("worldserve:chat_request_queue_time_seconds",
                                         "Chat submit to the start of its prefill.", label, buckets=E2E_BUCKETS,
                                         registry=r)  # fmt: skip
        self.chat_itl = Histogram("worldserve:chat_inter_token_latency_seconds", "Chat time between two tokens.",
                                  label, buckets=STEP_BUCKETS, registry=r)  # fmt: skip
        self.chat_iteration_tokens = Histogram("worldserve:chat_iteration_tokens",
                                               "Prompt + generated tokens per chat worker step.", label,
                                               buckets=ITERATION_TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.vllm = VllmMirror(r, model_name)
        self.chat_running.labels(**self._label)  # exported as 0 from the start, as vLLM's (track_chat_queue)
        for counter in (self.success, self.cancelled):
            counter.labels(**self._label)
        for status in FAILURE_STATUSES:  # 0 from the start, as vLLM exports its finished_reason series
            self.failure.labels(status=str(status), **self._label)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason, **self._label)
        if gpu_memory_bytes is not None:
            gpu = Gauge("worldserve:gpu_memory_used_bytes", "Accelerator memory in use.", label, registry=r)
            gpu.labels(**self._label).set_function(gpu_memory_bytes)

    def track_kv_cache(self, usage: Callable[[], float], preemptions: Callable[[], float]) -> None:
        """The Reasoner's K/V cache: fraction of blocks in use, and chats preempted so far (a running total)."""
        r, label = self.registry, ["model_name"]
        Gauge("worldserve:kv_cache_usage_perc", "Fraction of the Reasoner's K/V cache blocks in use (0-1).",
              label, registry=r).labels(**self._label).set_function(usage)  # fmt: skip
        # a counter (`_total`, rate() applies), read at scrape time: it had been a gauge of a running total
        r.register(ReadCounter("worldserve:num_preemptions", "Chats preempted so far for lack of K/V blocks.",
                               self._label, preemptions))  # fmt: skip
        self.vllm.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage, r)
        self.vllm.counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", preemptions, r
        )

    def track_prefix_cache(self, counts: Callable[[], tuple[int, int]]) -> None:
        """The Reasoner's prefix cache: prompt tokens looked up so far, and of them the tokens found (vLLM's
        counters, in tokens)."""
        self.vllm.counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                          "tokens.", lambda: counts()[0], self.registry)  # fmt: skip
        self.vllm.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                          lambda: counts()[1], self.registry)  # fmt: skip

    def track_mm_cache(self, cache: ProcessorCache) -> None:
        """The Reasoner's processor cache (media/processor_cache.py): chat images and videos looked up so far,
        and of them the ones found decoded (vLLM's counters, in items)."""
        self.vllm.counter("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried "
                          "items.", lambda: cache.queries, self.registry)  # fmt: skip
        self.vllm.counter("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.",
                          lambda: cache.hits, self.registry)  # fmt: skip

    def track_chat_lengths(self, max_model_len: int) -> None:
        """The per-chat token histograms, bucketed up to the Reasoner's context length (vLLM's)."""
        self.vllm.track_lengths(max_model_len, self.registry)

    def track_chat_queue(self, waiting: Callable[[], float], running: Callable[[], float]) -> None:
        """The chat worker's queues, read at scrape time (also as vLLM's num_requests_waiting / _running):
        waiting, the chats submitted and not yet started plus the preempted ones (vLLM moves a preempted
        request back to waiting); running, the chats started and not ended, less the preempted ones."""
        r, label = self.registry, ["model_name"]
        Gauge("worldserve:chat_requests_waiting", "Chats queued, not yet prefilled, or preempted.", label,
              registry=r).labels(**self._label).set_function(waiting)  # fmt: skip
        self.vllm.gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting, r
        )
        self.chat_running.labels(**self._label).set_function(running)
        self.vllm.chat_running.set_function(running)

    def watch(self, client: EngineClient) -> None:
        """Count `client`'s work: this object as its engine's and chat worker's observer, and its queues, K/V
        cache, prefix and media caches and chat lengths read at each scrape (build_app's, the offline
        Engine's: one wiring for both)."""
        self.track_queue(lambda: client.num_waiting, lambda: client.num_running)
        if client.chat_worker is not None:
            chat = client.chat_worker.backend
            self.track_kv_cache(chat.kv_cache_usage, lambda: chat.preemptions)
            if chat.prefix_cache_counts is not None:

                def prefix_cache_counts() -> tuple[int, int]:
                    counts = chat.prefix_cache_counts
                    assert counts is not None  # (a backend has a prefix cache or not: checked above)
                    return counts

                self.track_prefix_cache(prefix_cache_counts)
            if chat.media_cache is not None:
                self.track_mm_cache(chat.media_cache)
            worker = client.chat_worker  # its queues as they are at each scrape (a preempted chat waits)
            self.track_chat_queue(lambda: worker.num_waiting, lambda: worker.num_running)
            if chat.max_model_len is not None:
                self.track_chat_lengths(chat.max_model_len)
        client.observe(self)

    def track_queue(self, waiting: Callable[[], float], running: Callable[[], float]) -> None:
        for gauge, read in ((self.waiting, waiting), (self.running, running), (self.vllm.video_waiting, waiting),
                            (self.vllm.video_running, running)):  # fmt: skip
            gauge.labels(**self._label).set_function(read)

    # -- EngineObserver --------------------------------------------------------------------------------
    def on_step(self, seconds: float, batch_size: int) -> None:
        self.step_time.labels(**self._label).observe(seconds)
        self.batch_size.labels(**self._label).observe(batch_size)

    def on_finished(
        self, e2e_s: float, queue_s: float, stages: dict[str, float], peak_memory_mb: float
    ) -> None:
        self.success.labels(**self._label).inc()
        self.e2e.labels(**self._label).observe(e2e_s)
        self.queue_time.labels(**self._label).observe(queue_s)
        self.vllm.video_finished(e2e_s, queue_s)
        for stage, seconds in stages.items():
            self.stage.labels(stage=stage, **self._label).observe(seconds)
        self.peak_memory.labels(**self._label).set(peak_memory_mb)

    def on_failed(self, code: int) -> None:
        self.failure.labels(status=str(code), **self._label).inc()
        self.vllm.video_failed_with(code)

    def on_cancelled(self) -> None:
        self.cancelled.labels(**self._label).inc()
        self.vllm.video_aborted()

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(reason=reason, **self._label).inc()

    # -- chats (api/chat.py, engine/chat_metering.py) ------------------------------------------------------
    def on_chat_started(self, prompt_tokens: int) -> None:
        self.chat_prompt_tokens.labels(**self._label).inc(prompt_tokens)
        self.vllm.prompt_tokens.inc(prompt_tokens)

    def on_chat_ended(self, finish_reason: str | None) -> None:
        """finish_reason "error": failed; None: abandoned by the client (its lengths: on_chat_finished)."""
        self.chat_finished.labels(finish_reason=finish_reason or "abort", **self._label).inc()
        self.vllm.chat_ended(finish_reason or "abort")

    # -- ChatObserver (engine/chat_worker.py, the worker's thread) ----------------------------------------
    def on_chat_iteration(self, tokens: int) -> None:
        self.chat_iteration_tokens.labels(**self._label).observe(tokens)
        self.vllm.iteration_tokens.observe(tokens)

    def on_chat_first_token(self, seconds: float) -> None:
        self.chat_ttft.labels(**self._label).observe(seconds)
        self.vllm.ttft.observe(seconds)

    def on_chat_generated(self, tokens: int) -> None:
        self.chat_generation_tokens.labels(**self._label).inc(tokens)
        self.vllm.generation_tokens.inc(tokens)

    def on_chat_token_gaps(self, seconds: Sequence[float]) -> None:
        hist = self.chat_itl.labels(**self._label)
        for value in seconds:
            hist.observe(value)
        self.vllm.token_gaps(seconds)

    def on_chat_finished(self, times: ChatTimes) -> None:
        self.chat_e2e.labels(**self._label).observe(times.e2e_s)
        self.chat_queue_time.labels(**self._label).observe(times.queue_s)
        self.vllm.chat_timed(times)

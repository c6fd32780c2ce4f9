"""The vLLM- and vLLM-Omni-named Prometheus families that repeat worldserve's numbers (serving-api.md §7.4, §11.3),
so that dashboards built for those servers find their series here (api/metrics.py feeds them).

vLLM's (the Reasoner's chats) follow vllm/v1/metrics/loggers.py `PrometheusStatLogger` of vLLM 0.11: the same
names, types, help texts and histogram buckets, labelled `model_name` and `engine` ("0": worldserve runs one
engine core): num_requests_running / _waiting (the chat worker's queues at scrape time: a preempted chat is
waiting, as vLLM moves it back to its waiting queue), kv_cache_usage_perc (gauges); prompt_tokens_total,
generation_tokens_total, num_preemptions_total, request_success_total{finished_reason} (counters, every
finished_reason exported from the start as vLLM does); time_to_first_token_seconds,
inter_token_latency_seconds and its deprecated twin time_per_output_token_seconds (the same observations, as
vLLM 0.11 still exports both; the time to first token of each choice of an n > 1 request on the chat worker's
clock, when it was sampled), e2e_request_latency_seconds, iteration_tokens_total (histograms); and the per-chat histograms
(the worker's counts of every chat that ended, also one that ended queued: as vLLM, they count what request_success
counts): request_time_per_output_token_seconds (its decode time over its tokens less one, vLLM's mean TPOT), vLLM's Grafana
dashboard reads: request_prompt_tokens / request_generation_tokens (vLLM's 1-2-5 buckets up to --max-model-len,
with a chat worker) and the phases of vLLM's stats.py update_from_finished_request, on the chat worker's clock
(engine/chat_observer.py ChatTimes): request_queue_time_seconds (submitted to the start of the prefill that
admitted it: vLLM's QUEUED to first SCHEDULED), request_prefill_time_seconds (admitted to the first token),
request_decode_time_seconds (first token to last) and request_inference_time_seconds (admitted to the last token:
prefill + decode), each choice of an n > 1 request a chat as vLLM's child requests are;
prefix_cache_queries / _hits (prompt tokens looked up in the Reasoner's prefix cache, and found; a chat asking for
prompt logprobs computes its whole prompt, no lookup; as in vLLM, each choice of an n > 1 request counts and a
preempted chat's resume does not); mm_cache_queries / _hits (chat images and videos looked up in the Reasoner's
processor cache, and found decoded: media/processor_cache.py). Not exported: request_params_n / _max_tokens,
request_max_num_generation_tokens and cache_config_info.

vLLM-Omni's pipeline families (vllm_omni/metrics/prometheus.py), labelled `model_name` only, count the video
and image requests (their counters and latencies once a request: an image request of `n` images once, as
vLLM-Omni runs it as one request with num_outputs_per_prompt n): omni_num_requests_running / _waiting, omni_requests_success_total{finished_reason}
("stop", or "abort" for a failure, as its request_failed() does, and for a cancellation; both exported as 0
from the start, which vLLM-Omni leaves to the first request), omni_e2e_request_latency_seconds and the newer
name omni_e2e_request_latency_s, omni_request_queue_time_seconds; and omni_requests_failed_total{reason}, a
failure counter by reason that vLLM-Omni itself does not define (worldserve's, for requests that fail once
admitted: "invalid_request" for a 4xx the model gives, "unavailable" for a 503, "timeout" for a 408 / 504,
"error" for any other 5xx; every reason exported as 0 from the start). A request the route refuses before
admission (a bad field) counts in http_requests_total only, as in vLLM; a sync request's 504 leaves its job
running, which counts by its own end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from worldserve.engine.client import ChatTimes

ENGINE = "0"
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason values
OMNI_FINISHED_REASONS = ("stop", "abort")
"""omni_requests_success_total's finished_reason values for a video or image request (vLLM-Omni's
request_succeeded() default and request_failed()), exported as 0 from the start."""
FAILURE_REASONS = ("invalid_request", "unavailable", "timeout", "error")
"""omni_requests_failed_total's reasons (failure_reason), exported as 0 from the start."""
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
OMNI_E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)


def one_two_five(limit: int) -> list[int]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


def failure_reason(code: int) -> str:
    """omni_requests_failed_total's reason for a failed request's HTTP-like status."""
    if code in (408, 504):
        return "timeout"
    if code == 503:
        return "unavailable"
    return "invalid_request" if code < 500 else "error"


class VllmMirror:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        r, omni, llm = registry, ["model_name"], ["model_name", "engine"]
        self.omni = {"model_name": model_name}
        self.llm = {"model_name": model_name, "engine": ENGINE}

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, llm, buckets=buckets, registry=r).labels(**self.llm)

        # vLLM-Omni (video and image requests)
        self.video_running = Gauge("vllm:omni_num_requests_running", "Video jobs running (vLLM-Omni's name).",
                                   omni, registry=r)  # fmt: skip
        self.video_waiting = Gauge("vllm:omni_num_requests_waiting", "Video jobs waiting (vLLM-Omni's name).",
                                   omni, registry=r)  # fmt: skip
        self.video_success = Counter("vllm:omni_requests_success", "Video and image requests by finish (stop: "
                                     "done; abort: failed or cancelled).", [*omni, "finished_reason"],
                                     registry=r)  # fmt: skip
        self.video_failed = Counter("vllm:omni_requests_failed", "Video and image requests failed once admitted, by "
                                    "reason (input refused before: http_requests_total).", [*omni, "reason"],
                                    registry=r)  # fmt: skip
        for reason in OMNI_FINISHED_REASONS:  # 0 from the start (as vLLM's request_success_total)
            self.video_success.labels(finished_reason=reason, **self.omni)
        for reason in FAILURE_REASONS:
            self.video_failed.labels(reason=reason, **self.omni)
        e2e = [Histogram(name, "Video job submit to saved video.", omni, buckets=OMNI_E2E_BUCKETS, registry=r)
               for name in ("vllm:omni_e2e_request_latency_seconds", "vllm:omni_e2e_request_latency_s")]  # fmt: skip
        self.video_e2e = [h.labels(**self.omni) for h in e2e]  # the newer name too: either dashboard finds it
        self.video_queue = Histogram("vllm:omni_request_queue_time_seconds", "Video job submit to admission.",
                                     omni, buckets=OMNI_E2E_BUCKETS, registry=r).labels(**self.omni)  # fmt: skip
        # vLLM (the Reasoner's chats)
        self.chat_running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                                  llm, registry=r).labels(**self.llm)  # fmt: skip
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", llm,
                                     registry=r).labels(**self.llm)  # fmt: skip
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", llm,
                                         registry=r).labels(**self.llm)  # fmt: skip
        self.chat_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                    [*llm, "finished_reason"], registry=r)  # fmt: skip
        for reason in FINISHED_REASONS:  # exported as 0 from the start, as vLLM does
            self.chat_success.labels(finished_reason=reason, **self.llm)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)  # fmt: skip
        self.itl = [
            hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
            hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."
                 "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS),
        ]  # fmt: skip
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)  # fmt: skip
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKEN_BUCKETS)  # fmt: skip
        self.inference = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for "
                            "request.", REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.decode = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                           REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.request_tokens: tuple[Histogram, Histogram] | None = None  # (prompt, generation): track_lengths
        ProcessCollector(registry=r)  # process_* (CPU seconds, resident memory, open files) on Linux

    def gauge(self, name: str, doc: str, read: Callable[[], float], registry: CollectorRegistry) -> None:
        """A vLLM gauge read at scrape time (num_requests_waiting, kv_cache_usage_perc)."""
        Gauge(name, doc, ["model_name", "engine"], registry=registry).labels(**self.llm).set_function(read)

    def counter(self, name: str, doc: str, read: Callable[[], float], registry: CollectorRegistry) -> None:
        """A vLLM counter whose running total is kept elsewhere (num_preemptions), read at scrape time and
        exposed as `<name>_total`."""
        registry.register(ReadCounter(name, doc, self.llm, read))

    # -- video / image requests ------------------------------------------------------------------------
    def video_finished(self, e2e_s: float, queue_s: float) -> None:
        self.video_success.labels(finished_reason="stop", **self.omni).inc()
        for hist in self.video_e2e:
            hist.observe(e2e_s)
        self.video_queue.observe(queue_s)

    def video_aborted(self) -> None:
        """A request stopped before its end (vLLM counts an aborted request as finished_reason "abort")."""
        self.video_success.labels(finished_reason="abort", **self.omni).inc()

    def video_failed_with(self, code: int) -> None:
        self.video_aborted()  # vLLM-Omni's request_failed()
        self.video_failed.labels(reason=failure_reason(code), **self.omni).inc()

    def track_lengths(self, max_model_len: int, registry: CollectorRegistry) -> None:
        """vllm:request_prompt_tokens and _generation_tokens, bucketed 1, 2, 5, 10, ... up to `max_model_len`."""
        buckets = one_two_five(max_model_len)
        prompt, generation = (
            Histogram(name, "Number of prefill tokens processed." if "prompt" in name else
                      "Number of generation tokens processed.", ["model_name", "engine"], buckets=buckets,
                      registry=registry).labels(**self.llm)
            for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens")
        )  # fmt: skip
        self.request_tokens = prompt, generation

    # -- chats -------------------------------------------------------------------------------------------
    def chat_ended(self, finished_reason: str) -> None:
        self.chat_success.labels(finished_reason=finished_reason, **self.llm).inc()

    def chat_timed(self, times: ChatTimes) -> None:
        """A chat's phases and lengths as the chat worker counted them (ChatTimes), as vLLM observes a finished
        request's: the tokens it sampled, not those its reader took (a client that left had taken fewer);
        a chat that ended queued has no prompt length (its prompt was never rendered)."""
        if self.request_tokens is not None:
            if times.prompt_tokens is not None:
                self.request_tokens[0].observe(times.prompt_tokens)
            self.request_tokens[1].observe(times.generation_tokens)
        self.e2e.observe(times.e2e_s)
        # vLLM's mean_time_per_output_token: its decode time over the gaps between its tokens (0 with one token)
        gaps = times.generation_tokens - 1
        self.tpot.observe(times.decode_s / gaps if gaps > 0 else 0.0)
        for hist, seconds in ((self.queue, times.queue_s), (self.prefill, times.prefill_s),
                              (self.decode, times.decode_s), (self.inference, times.inference_s)):  # fmt: skip
            hist.observe(seconds)

    def token_gaps(self, seconds: Sequence[float]) -> None:
        for value in seconds:
            for hist in self.itl:
                hist.observe(value)


class ReadCounter(Collector):
    """A counter family with one series whose value a callable gives (prometheus_client's Counter can only
    be incremented)."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], read: Callable[[], float]) -> None:
        self._name, self._doc, self._labels, self._read = name, doc, labels, read

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, self._doc, labels=list(self._labels))]

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), self._read())
        return [family]

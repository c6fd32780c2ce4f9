"""vLLM's periodic stats line: every `VLLM_LOG_STATS_INTERVAL` seconds (10 by default) the server logs what it
did since the last line, on the `worldserve.stats` logger, at INFO while there is work (at DEBUG when idle, as
vLLM does), unless `--disable-log-stats`:

    Chats: avg prompt throughput: 812.4 tokens/s, avg generation throughput: 1053.0 tokens/s, running: 8 reqs,
    waiting: 0 reqs, GPU KV cache usage: 3.1%, prefix cache hit rate: 42.0%; videos: running: 1 reqs,
    waiting: 2 reqs, denoising steps: 2 (5.34 s a step)

Every figure is read from the /metrics registry (api/metrics.py), the same numbers a scrape gets: throughputs
and steps over the interval, the rest as they are now (the prefix cache hit rate since the start)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

from prometheus_client import CollectorRegistry

log = logging.getLogger("worldserve.stats")

READ = {
    "prompt": "worldserve:chat_prompt_tokens_total", "generated": "worldserve:chat_generation_tokens_total",
    "chats_running": "worldserve:chat_requests_running", "chats_waiting": "worldserve:chat_requests_waiting",
    "kv": "worldserve:kv_cache_usage_perc", "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total", "videos_running": "worldserve:num_requests_running",
    "videos_waiting": "worldserve:num_requests_waiting", "step_s": "worldserve:step_time_seconds_sum",
    "steps": "worldserve:step_time_seconds_count",
}  # fmt: skip
"""The figures of a line, by the registry sample each is read from."""
_BY_SAMPLE = {name: key for key, name in READ.items()}


class StatsLog:
    """One server's stats lines: `line()` the text and whether there was work since the last one."""

    def __init__(self, registry: CollectorRegistry, interval_s: float) -> None:
        self.registry, self.interval_s = registry, interval_s
        self.last, self.last_t = self._read(), time.monotonic()

    def _read(self) -> dict[str, float]:
        """The READ figures now (summed over their label sets; 0 for those not registered)."""
        out: dict[str, float] = defaultdict(float)
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name in _BY_SAMPLE:
                    out[_BY_SAMPLE[sample.name]] += sample.value
        return out

    def line(self) -> tuple[str, bool]:
        """(the line of the interval since the last call, whether anything ran or waited in it)."""
        now, t = self._read(), time.monotonic()
        span = max(t - self.last_t, 1e-9)
        delta = {k: now[k] - self.last[k] for k in ("prompt", "generated", "step_s", "steps")}
        self.last, self.last_t = now, t
        hit_rate = 100 * now["hits"] / now["queries"] if now["queries"] else 0.0
        steps = int(delta["steps"])
        per_step = f" ({delta['step_s'] / steps:.2f} s a step)" if steps else ""
        text = (
            f"Chats: avg prompt throughput: {delta['prompt'] / span:.1f} tokens/s, avg generation throughput: "
            f"{delta['generated'] / span:.1f} tokens/s, running: {now['chats_running']:.0f} reqs, waiting: "
            f"{now['chats_waiting']:.0f} reqs, GPU KV cache usage: {100 * now['kv']:.1f}%, prefix cache hit "
            f"rate: {hit_rate:.1f}%; videos: running: {now['videos_running']:.0f} reqs, waiting: "
            f"{now['videos_waiting']:.0f} reqs, denoising steps: {steps}{per_step}"
        )
        busy = any(now[k] for k in ("chats_running", "chats_waiting", "videos_running", "videos_waiting"))
        return text, busy or any(delta.values())

    async def run(self) -> None:
        """Log a line every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            text, active = self.line()
            log.log(logging.INFO if active else logging.DEBUG, "%s", text)

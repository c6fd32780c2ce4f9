"""Timers for the benchmark: CUDA events around a region (host clock + synchronize on CPU), and peak memory.

`time_region(fn, warmup, repeats)` runs `fn` `warmup` times untimed, then `repeats` times between device
events, and returns a `Timing` with every sample (seconds), median, mean, min and the warm-up times (the
first call includes cuDNN plan building and allocator growth; it is reported, never mixed in).
`peak_gib()` / `reset_peak()` read and reset `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch


@dataclass(slots=True)
class Timing:
    samples: list[float] = field(default_factory=list)
    """Timed repeats, seconds."""
    warmup: list[float] = field(default_factory=list)
    """Untimed (reported) warm-up calls, seconds."""

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else float("nan")

    @property
    def spread(self) -> float:
        """(max - min) / median of the timed samples: the run-to-run noise."""
        if len(self.samples) < 2:
            return 0.0
        return (max(self.samples) - min(self.samples)) / self.median

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(median=self.median, mean=self.mean, spread=self.spread)
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call of `fn`, measured with device events on CUDA (host clock elsewhere)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _sync(device)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def event_ms(fn: Callable[[], object], repeats: int, *, warmup: int = 0) -> float:
    """Median ms of `repeats` calls of `fn` on the current CUDA stream, each between two CUDA events (kernel
    time back to back, no host sync between the events), after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def time_region(
    fn: Callable[[], object], device: torch.device, *, warmup: int = 1, repeats: int = 3
) -> Timing:
    t = Timing()
    for _ in range(warmup):
        t.warmup.append(time_once(fn, device))
    for _ in range(repeats):
        t.samples.append(time_once(fn, device))
    return t


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    _sync(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def allocated_gib(device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    return torch.cuda.memory_allocated(device) / 2**30


def free_memory(device: torch.device) -> None:
    """Return cached blocks to the driver between phases (after the caller dropped its references)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

"""The GPU's clock, power and clock-event reasons beside a benchmark, summarised per phase.

Hopper's matrix rate under load is set by the board's power cap as much as by its boost clock: on these
H200s an 8192^3 bf16 product runs ~790 TFLOP/s on random data and ~890 on zeros (the device library's
KINDS.md), the same kernel at the same nominal clock. Whether a kernel sits at the chip's limit therefore
needs its clock and power read while it runs. `ClockLog` runs `nvidia-smi --query-gpu=... -lms P` in the
background and stamps each reading with the host's monotonic clock when it arrives; `phase(name)` marks
the span of one workload; `summary()` gives per phase the median SM clock, the median and max board power,
the max temperature and every clock-event reason seen (nvidia-smi's bit mask, decoded).

    with ClockLog() as log:
        with log.phase("gemm"):
            ...
    log.summary()   # {"gemm": {"sm_mhz": 1755.0, "power_w": 699.1, ...}}
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
"""Fields of each reading, in this order (nvidia-smi --query-gpu; noheader, nounits)."""

LEGACY_QUERY = QUERY.replace("clocks_event_reasons", "clocks_throttle_reasons")
"""The same fields under the name drivers before 535 knew the reasons by."""

LIMITS_QUERY = "power.limit,clocks.max.sm,clocks.max.mem"
"""Fields read once: the board's power cap and the highest clocks it allows."""

EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
"""nvidia-smi's clocks_event_reasons bits (why the SM clock is below its maximum)."""


@dataclass(frozen=True, slots=True)
class Reading:
    t: float
    """Host monotonic seconds at arrival."""
    sm_mhz: float
    power_w: float
    temp_c: float
    reasons: int
    """clocks_event_reasons.active bit mask."""


def decode_reasons(mask: int) -> list[str]:
    """The names of the set bits of a clocks_event_reasons mask (unknown bits as hex)."""
    names = [name for bit, name in EVENT_REASONS.items() if mask & bit]
    rest = mask & ~sum(EVENT_REASONS)
    return names + ([hex(rest)] if rest else [])


def parse_reading(line: str, t: float) -> Reading | None:
    """One `QUERY` line ("1980, 512.34, 41, 0x0000000000000004") stamped `t`; None for anything else
    (a header, "[N/A]" fields, an error message)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        return Reading(t, float(parts[0]), float(parts[1]), float(parts[2]), int(parts[3], 16))
    except ValueError:
        return None


def summarize(readings: Sequence[Reading], start: float, end: float) -> dict | None:
    """Clock, power, temperature and reasons of the readings inside [start, end]; None if there are none."""
    inside = [r for r in readings if start <= r.t <= end]
    if not inside:
        return None
    mask = 0
    for r in inside:
        mask |= r.reasons
    return {
        "readings": len(inside),
        "sm_mhz": statistics.median(r.sm_mhz for r in inside),
        "sm_mhz_min": min(r.sm_mhz for r in inside),
        "power_w": statistics.median(r.power_w for r in inside),
        "power_w_max": max(r.power_w for r in inside),
        "temp_c_max": max(r.temp_c for r in inside),
        "reasons": decode_reasons(mask),
    }


def _nvidia_smi(*args: str, timeout: float = 10.0) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        run = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout if run.returncode == 0 else None


def board_limits(index: int = 0) -> dict | None:
    """The power cap (W) and maximum SM / memory clocks (MHz) of GPU `index`, or None without nvidia-smi."""
    out = _nvidia_smi(f"--id={index}", f"--query-gpu={LIMITS_QUERY}", "--format=csv,noheader,nounits")
    if out is None:
        return None
    try:
        power, sm, mem = (float(p) for p in out.strip().splitlines()[0].split(","))
    except (ValueError, IndexError):
        return None
    return {"power_limit_w": power, "sm_max_mhz": sm, "mem_max_mhz": mem}


class ClockLog:
    """nvidia-smi readings of one GPU every `period_ms`, and named phases to summarise them by."""

    def __init__(self, index: int = 0, period_ms: int = 100) -> None:
        self.index, self.period_ms = index, period_ms
        self.readings: list[Reading] = []
        self.phases: dict[str, tuple[float, float]] = {}
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._proc is not None

    def start(self) -> ClockLog:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        query = next(
            (q for q in (QUERY, LEGACY_QUERY)
             if _nvidia_smi(f"--id={self.index}", f"--query-gpu={q}", "--format=csv,noheader,nounits")),
            None,
        )  # fmt: skip
        if query is None:
            return self
        cmd = [exe, f"--id={self.index}", f"--query-gpu={query}", "--format=csv,noheader,nounits",
               f"-lms={self.period_ms}"]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, name="clock-log", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            if (r := parse_reading(line, time.monotonic())) is not None:
                self.readings.append(r)

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def __enter__(self) -> ClockLog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark the body's span as phase `name` (wrap only GPU-bound work: sync before leaving)."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = (start, time.monotonic())

    def summary(self) -> dict[str, dict | None]:
        """Per phase, `summarize` of its readings (None where nvidia-smi gave none)."""
        return {name: summarize(self.readings, *span) for name, span in self.phases.items()}

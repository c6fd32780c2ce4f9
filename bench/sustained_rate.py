"""Sustained matrix and attention rates on one GPU, with its clock and power beside them.

performance.md's physical limit takes 790 TFLOP/s: an 8192^3 bf16 product timed over ten calls after
three warm-ups. A denoising step runs such kernels back to back for ~5 s, long enough for the board's
power cap to set the clock. This times each workload back to back for --seconds (CUDA events around
batches of ~50 ms of calls; the host stays at most two batches ahead), with nvidia-smi's SM clock, board
power and clock-event reasons read beside it (worldserve/bench/clocks.py):
- `gemm-burst`: the limit's own measurement (3 warm-ups, 10 timed calls of --gemm^3);
- `gemm`: the same product sustained; `gemm-zeros`: on zeros (same kernel, less switching power);
- `gate_up`: the step's largest GEMM ([--rows, 4096] @ [4096, 24,576]; activations N(0, 1), weights
  N(0, 0.02) as the random-weight model's);
- `attention`: the gen tower's attention (44,357 queries over 44,657 keys, GQA 32 / 8, d 128) through the
  product's attention function (FA3 where it runs);
- `step` (--step): the product's compiled CFG step at 1280x720x189 + audio (random weights).
Reported per phase: TFLOP/s over the second half of the phase (steady) and over its first batch, median
SM clock, median / max power, max temperature, the clock-event reasons seen; and performance.md's
per-step limit recomputed at the sustained `gemm` rate.

    PYTHONPATH=. python bench/sustained_rate.py --step --out $OUT/sustained_rate.json     # H200: ~4 min
    PYTHONPATH=. python bench/sustained_rate.py --tiny --device cpu --seconds 0.2 --out /tmp/s.json  # smoke
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file (or folder)")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each sustained phase")
    ap.add_argument("--gemm", type=int, default=8192, help="M = K = N of the square product")
    ap.add_argument("--rows", type=int, default=2 * 44_357, help="M of gate_up: a CFG step's gen tokens")
    ap.add_argument("--step", action="store_true", help="also the product's full-size CFG step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps of the step phase")
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    if args.tiny:
        args.gemm, args.rows = 64, 128
    return args


class _Timer:
    """Elapsed seconds between two marks: CUDA events on a GPU (no host sync), the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def begin(self) -> None:
        if self.cuda:
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def finish(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def wait(self) -> None:
        if self.cuda:
            self.end.synchronize()

    def seconds(self) -> float:
        self.wait()
        return self.start.elapsed_time(self.end) / 1e3 if self.cuda else self.t1 - self.t0


def sustained(fn: Callable[[], object], flops: float, seconds: float, device: torch.device) -> dict:
    """Run `fn` back to back for `seconds` of host time; TFLOP/s of the first batch and of the second half.

    Calls go in batches of ~50 ms (by one timed call after a warm-up); the host waits for batch i-2 before
    queueing batch i, so host time tracks GPU time."""
    fn()
    probe = _Timer(device)
    probe.begin()
    fn()
    probe.finish()
    per_call = max(probe.seconds(), 1e-6)
    batch = max(1, round(0.05 / per_call))
    timers: list[_Timer] = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(timers) < 2:
        if len(timers) >= 2:
            timers[-2].wait()
        timer = _Timer(device)
        timer.begin()
        for _ in range(batch):
            fn()
        timer.finish()
        timers.append(timer)
    times = [t.seconds() for t in timers]
    half = times[len(times) // 2 :]
    return {
        "calls": batch * len(times),
        "batch": batch,
        "tflops_first": batch * flops / times[0] / 1e12,
        "tflops": batch * len(half) * flops / sum(half) / 1e12,
        "ms_per_call": sum(half) / (batch * len(half)) * 1e3,
    }


def burst(fn: Callable[[], object], flops: float, device: torch.device) -> dict:
    """KINDS.md's measurement: 3 warm-up calls, then the mean of 10 timed ones."""
    for _ in range(3):
        fn()
    timer = _Timer(device)
    timer.begin()
    for _ in range(10):
        fn()
    timer.finish()
    s = timer.seconds() / 10
    return {"calls": 10, "tflops": flops / s / 1e12, "ms_per_call": s * 1e3}


def _attention_case(device: torch.device, dtype: torch.dtype, tiny: bool):
    """(fn, flops, label) of the gen tower's attention at the 720p step's shape (one CFG branch)."""
    from worldserve.models.layers.flash_attention import resolve_attention_backend

    nq, nk, hq, hkv, d = (96, 112, 4, 2, 32) if tiny else (44_357, 44_657, 32, 8, 128)
    label, attn = resolve_attention_backend(None, device, dtype, d)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(nq, hq, d, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(nk, hkv, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    out = torch.empty_like(q)
    return (lambda: attn(q, k, v, out=out)), 4.0 * nq * nk * hq * d, label


def _step_case(device: torch.device, log) -> tuple[Callable[[], object], float, dict]:
    """(fn, flops, info) of the product's compiled 720p CFG step (built, compiled and warmed up here)."""
    from worldserve.bench.denoise import OurStep, make_inputs
    from worldserve.bench.flops import TowerShape
    from worldserve.bench.models import build_our_transformer
    from worldserve.bench.workload import Workload
    from worldserve.models.cosmos3.config import Cosmos3Config

    t0 = time.perf_counter()
    cfg, w = Cosmos3Config.nano(), Workload()
    model = build_our_transformer(cfg, device, torch.bfloat16, None, seed=0)
    attention = model.set_attention_backend(None)
    model.compile_gen_layers()
    step = OurStep(model, w, make_inputs(w, cfg.vocab_size, device, seed=0))
    step.prefill()
    step(999)
    torch.cuda.synchronize(device)
    log(f"step: built, compiled and warmed up in {time.perf_counter() - t0:.0f} s ({attention})")
    return (lambda: step(999)), w.step_flops(TowerShape.from_config(cfg)), {"attention": attention}


def run(args: argparse.Namespace, log=print, save=lambda res: None) -> dict:
    from worldserve.bench.clocks import ClockLog, board_limits
    from worldserve.bench.flops import PEAK_BF16_TFLOPS
    from worldserve.bench.report import environment

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res: dict = {"environment": environment(device), "board": board_limits(), "phases": {},
                 "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    clocks = ClockLog().start()
    res["clock_readings"] = clocks.available

    def phase(name: str, measure: Callable[[], dict]) -> None:
        with clocks.phase(name):
            r = measure()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        res["phases"][name] = r
        log(f"{name}: {r['tflops']:.0f} TFLOP/s ({r['ms_per_call']:.2f} ms a call)")
        save(res)

    try:
        n = args.gemm
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        zeros = torch.zeros_like(a)
        sq = 2.0 * n**3
        phase("gemm-burst", lambda: burst(lambda: a @ b, sq, device))
        phase("gemm", lambda: sustained(lambda: a @ b, sq, args.seconds, device))
        phase("gemm-zeros", lambda: sustained(lambda: zeros @ zeros, sq, args.seconds, device))
        del a, b, zeros
        m, d, inter = args.rows, 4096, 12_288
        if args.tiny:
            d, inter = 64, 96
        x = torch.randn(m, d, device=device, dtype=dtype)
        w = torch.randn(2 * inter, d, device=device, dtype=dtype) * 0.02
        phase("gate_up", lambda: sustained(lambda: x @ w.t(), 2.0 * m * d * 2 * inter, args.seconds, device))
        del x, w
        fn, flops, res["attention_backend"] = _attention_case(device, dtype, args.tiny)
        phase("attention", lambda: sustained(fn, flops, args.seconds, device))
        del fn
        if args.step and device.type == "cuda":
            torch.cuda.empty_cache()
            step_fn, step_flops, info = _step_case(device, log)
            res["step_info"] = info
            phase("step", lambda: _steps(step_fn, step_flops, args.steps, device))
            res["step_flops"] = step_flops
    finally:
        clocks.stop()
    for name, summary in clocks.summary().items():
        res["phases"].setdefault(name, {})["clocks"] = summary
    gemm = res["phases"].get("gemm", {}).get("tflops")
    if gemm and "step_flops" in res:
        res["step_limit_s_at_sustained_gemm"] = res["step_flops"] / gemm / 1e12
        res["step_limit_s_at_peak"] = res["step_flops"] / PEAK_BF16_TFLOPS / 1e12
    return res


def _steps(fn: Callable[[], object], flops: float, steps: int, device: torch.device) -> dict:
    """`steps` steps back to back, each timed (a step is long enough to be its own batch)."""
    times = []
    for _ in range(steps):
        timer = _Timer(device)
        timer.begin()
        fn()
        timer.finish()
        times.append(timer.seconds())
    return {"calls": steps, "step_s": times, "tflops": flops * steps / sum(times) / 1e12,
            "tflops_first": flops / times[0] / 1e12, "ms_per_call": sum(times) / steps * 1e3}  # fmt: skip


def table(res: dict) -> str:
    board = res.get("board") or {}
    lines = [
        f"sustained rates, {res['environment'].get('gpu', res['environment']['device'])}; power cap "
        f"{board.get('power_limit_w', '-')} W, SM max {board.get('sm_max_mhz', '-')} MHz",
        f"{'phase':11s} {'TF/s':>6s} {'first':>6s} {'SM MHz':>7s} {'min':>6s} {'W med':>6s} {'W max':>6s} "
        f"{'°C':>4s}  reasons",
    ]
    for name, r in res["phases"].items():
        c = r.get("clocks") or {}
        f = lambda key, fmt="6.0f": format(c[key], fmt) if key in c else "     -"  # noqa: E731
        lines.append(
            f"{name:11s} {r.get('tflops', float('nan')):6.0f} {r.get('tflops_first', float('nan')):6.0f} "
            f"{f('sm_mhz', '7.0f')} {f('sm_mhz_min')} {f('power_w')} {f('power_w_max')} {f('temp_c_max', '4.0f')}"
            f"  {','.join(c.get('reasons', [])) or '-'}"
        )
    if "step_limit_s_at_sustained_gemm" in res:
        lines.append(
            f"step limit: {res['step_limit_s_at_peak']:.2f} s at the 790 TF/s burst peak, "
            f"{res['step_limit_s_at_sustained_gemm']:.2f} s at the sustained gemm rate; measured "
            f"{res['phases']['step']['ms_per_call'] / 1e3:.3f} s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from worldserve.bench.report import run_script

    return run_script(parse_args(argv), run, table, "sustained-rate")


if __name__ == "__main__":
    sys.exit(main())

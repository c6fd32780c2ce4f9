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
- `attention`: the gen tower's attention (44,357 queries over 44,657 keys, GQA 32 / 8, d 128) through FA3
  (the product's und attention; the gen tower's where FA4's cluster kernel cannot run);
- `--fa4-prebuilt DIR`: the same attention through each FlashAttention-4 kernel of DIR (compiled ahead of
  time by bench/fa4_export.py: FA4's tile, or the 2-CTA cluster that shares K / V tiles by TMA multicast;
  the product's gen kernel is worldserve/models/layers/fa4_sm90/),
  each checked against FA3's output on the same inputs first, then FA3 once more (`attention-again`) so
  that drift of the board between the first and the last attention phase shows;
- `--extra` phases: `packgqa` / `nopackgqa`: the same attention with FA3's GQA packing forced on / off
  (packed, a K/V tile is loaded once for the 4 query heads that share it: less traffic, less power);
  `step`: the product's compiled CFG step at 1280x720x189 + audio (random weights); `diffusers`:
  diffusers' transformer's CFG step on the same inputs (its own random weights); `vae`: the product's
  compiled VAE decode of 48 x 45 x 80 latents (189 x 720 x 1280 pixels; FLOPs counted on the meta device).
Reported per phase: TFLOP/s over the second half of the phase (steady) and over its first batch, median
SM clock, median / max power, max temperature, the clock-event reasons seen; and performance.md's
per-step limit recomputed at the sustained `gemm` rate.

    PYTHONPATH=. python bench/sustained_rate.py --extra step --out $OUT/sustained_rate.json    # H200: ~2 min
    PYTHONPATH=. python bench/sustained_rate.py --tiny --device cpu --seconds 0.2 --out /tmp/s.json  # smoke
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from worldserve.bench.timing import time_once

EXTRA = ("packgqa", "nopackgqa", "step", "diffusers", "vae")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file (or folder)")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each sustained phase")
    ap.add_argument("--gemm", type=int, default=8192, help="M = K = N of the square product")
    ap.add_argument("--rows", type=int, default=2 * 44_357, help="M of gate_up: a CFG step's gen tokens")
    ap.add_argument("--extra", default="", help=f"comma list of more phases: {', '.join(EXTRA)}")
    ap.add_argument("--steps", type=int, default=3, help="timed calls of the step / diffusers / vae phases")
    ap.add_argument("--fa4-prebuilt", type=Path, default=None, help="bench/fa4_export.py's kernel folder")
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    args.extra = tuple(x for x in args.extra.split(",") if x)
    if set(args.extra) - set(EXTRA):
        ap.error(f"--extra: a comma list of {', '.join(EXTRA)}, got {','.join(args.extra)!r}")
    if args.tiny:
        args.gemm, args.rows = 64, 128
    return args


class _Timer:
    """Elapsed seconds between two marks: CUDA events on a GPU (no host sync, unlike timing.time_once: the
    sustained loop keeps queueing while a batch runs), the host clock elsewhere."""

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
    per_call = max(time_once(fn, device), 1e-6)
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
    s = time_once(lambda: [fn() for _ in range(10)], device) / 10
    return {"calls": 10, "tflops": flops / s / 1e12, "ms_per_call": s * 1e3}


def _attention_case(device: torch.device, dtype: torch.dtype, tiny: bool, pack_gqa: bool | None = None):
    """(fn, flops, label) of the gen tower's attention at the 720p step's shape (one CFG branch); with
    `pack_gqa` set, FA3 with its GQA packing forced on / off (None: the product's attention function)."""
    from worldserve.models.layers.flash_attention import fa3_forward, resolve_attention_backend

    q, k, v = _attention_inputs(device, dtype, tiny)
    label, attn = resolve_attention_backend(None, device, dtype, q.shape[-1])
    if pack_gqa is not None:
        if label != "fa3":
            return None, 0.0, f"{label}: no FA3 here"

        def attn(q, k, v, out):
            return fa3_forward(q, k, v, out=out, pack_gqa=pack_gqa)[0]

    out = torch.empty_like(q)
    return (lambda: attn(q, k, v, out=out)), _attention_flops(q, k), label


def _attention_inputs(device: torch.device, dtype: torch.dtype, tiny: bool) -> tuple:
    """Random q [44,357, 32, 128] over k / v [44,657, 8, 128] (one CFG item of the 720p step), seed 0."""
    nq, nk, hq, hkv, d = (96, 112, 4, 2, 32) if tiny else (44_357, 44_657, 32, 8, 128)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(nq, hq, d, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(nk, hkv, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    return q, k, v


def _attention_flops(q: torch.Tensor, k: torch.Tensor) -> float:
    return 4.0 * q.shape[0] * k.shape[0] * q.shape[1] * q.shape[2]


def _prebuilt_cases(folder: Path, device: torch.device, dtype: torch.dtype, tiny: bool, log) -> list:
    """[(phase name, fn, flops)] of each prebuilt FA4 kernel at `_attention_case`'s shape and inputs, after
    checking its output and LSE against FA3's (a kernel that disagrees beyond bf16 rounding is logged and
    left out)."""
    from worldserve.models.layers.fa4_cluster import AGREEMENT, compare_with_fa3, load_kernels

    q, k, v = _attention_inputs(device, dtype, tiny)
    cases = []
    for kernel in load_kernels(folder).values():
        try:
            err, lse_diff = compare_with_fa3(kernel, q, k, v)
        except RuntimeError as e:  # e.g. a cluster shape the GPU cannot launch
            log(f"fa4-{kernel.spec} did not run ({e}): left out")
            continue
        log(f"fa4-{kernel.spec}: rel. L2 vs FA3 {err:.2e}, max LSE difference {lse_diff:.2e}")
        if not (err < AGREEMENT and lse_diff < AGREEMENT):
            log(f"fa4-{kernel.spec} disagrees with FA3: left out")
            continue
        out = torch.empty_like(q)
        fn = lambda kernel=kernel, out=out: kernel.forward(q, k, v, out=out)  # noqa: E731
        cases.append((f"fa4-{kernel.spec}", fn, _attention_flops(q, k)))
    return cases


def _model_case(name: str, device: torch.device, log) -> tuple[Callable[[], object], float]:
    """(fn, flops) of a full-size phase, built, compiled and warmed up here: `step` (ours, compiled, the
    product's attention), `diffusers` (its transformer, default SDPA) or `vae` (our compiled decoder)."""
    from worldserve.bench.denoise import DiffusersStep, OurStep, make_inputs
    from worldserve.bench.flops import TowerShape
    from worldserve.bench.models import build_diffusers_transformer, build_our_transformer, build_video_vae
    from worldserve.bench.workload import Workload
    from worldserve.models.cosmos3.config import Cosmos3Config

    t0 = time.perf_counter()
    cfg, w = Cosmos3Config.nano(), Workload()
    if name == "vae":
        with FlopCounterMode(display=False) as counter:  # exact conv / matmul FLOPs, on the meta device
            build_video_vae(torch.device("meta"), torch.bfloat16).decode_pixels(
                torch.empty(w.latent_shape, device="meta")
            )
        vae = build_video_vae(device, torch.bfloat16, compile_decoder=True)
        latents = torch.randn(w.latent_shape, device=device)
        fn, flops = (lambda: vae.decode_pixels(latents)), float(counter.get_total_flops())
    else:
        inputs = make_inputs(w, cfg.vocab_size, device, seed=0)
        if name == "step":
            model = build_our_transformer(cfg, device, torch.bfloat16, None, seed=0)
            model.set_attention_backend(None)
            model.compile_gen_layers()
            step = OurStep(model, w, inputs)
            step.prefill()
        else:
            step = DiffusersStep(build_diffusers_transformer(cfg, device, torch.bfloat16, 0), w, inputs)
        fn, flops = (lambda: step(999)), w.step_flops(TowerShape.from_config(cfg))
    fn()
    torch.cuda.synchronize(device)
    log(f"{name}: built, compiled and warmed up in {time.perf_counter() - t0:.0f} s")
    return fn, flops


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

    def phase(name: str, measure: Callable[..., dict], *measure_args) -> None:
        with clocks.phase(name):
            r = measure(*measure_args)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        res["phases"][name] = r
        log(f"{name}: {r['tflops']:.0f} TFLOP/s ({r['ms_per_call']:.2f} ms a call)")
        save(res)

    try:
        n, secs = args.gemm, args.seconds
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        zeros = torch.zeros_like(a)
        phase("gemm-burst", burst, partial(torch.matmul, a, b), 2.0 * n**3, device)
        phase("gemm", sustained, partial(torch.matmul, a, b), 2.0 * n**3, secs, device)
        phase("gemm-zeros", sustained, partial(torch.matmul, zeros, zeros), 2.0 * n**3, secs, device)
        del a, b, zeros
        m, d, inter = (args.rows, 64, 96) if args.tiny else (args.rows, 4096, 12_288)
        x = torch.randn(m, d, device=device, dtype=dtype)
        w_t = (torch.randn(2 * inter, d, device=device, dtype=dtype) * 0.02).t()  # [d, 2I]
        phase("gate_up", sustained, partial(torch.matmul, x, w_t), 2.0 * m * d * 2 * inter, secs, device)
        del x, w_t
        for name, pack in (("attention", None), ("packgqa", True), ("nopackgqa", False)):
            if name == "attention" or name in args.extra:
                fn, flops, label = _attention_case(device, dtype, args.tiny, pack)
                res.setdefault("attention_backend", label)
                if fn is None:
                    log(f"{name}: skipped ({label})")
                    continue
                phase(name, sustained, fn, flops, secs, device)
                del fn
            if name == "attention" and args.fa4_prebuilt is not None:
                for pname, fn, flops in _prebuilt_cases(args.fa4_prebuilt, device, dtype, args.tiny, log):
                    phase(pname, sustained, fn, flops, secs, device)
                fn, flops, _ = _attention_case(device, dtype, args.tiny)
                phase("attention-again", sustained, fn, flops, secs, device)
                del fn
        for name in ("step", "diffusers", "vae"):
            if name in args.extra and device.type == "cuda":
                torch.cuda.empty_cache()
                fn, res[f"{name}_flops"] = _model_case(name, device, log)
                phase(name, _steps, fn, res[f"{name}_flops"], args.steps, device)
                del fn
    finally:
        clocks.stop()
    for name, summary in clocks.summary().items():
        res["phases"].setdefault(name, {})["clocks"] = summary
    gemm = res["phases"].get("gemm", {}).get("tflops")
    if gemm and "step" in res["phases"]:
        res["step_limit_s_at_sustained_gemm"] = res["step_flops"] / gemm / 1e12
        res["step_limit_s_at_peak"] = res["step_flops"] / PEAK_BF16_TFLOPS / 1e12
    return res


def _steps(fn: Callable[[], object], flops: float, steps: int, device: torch.device) -> dict:
    """`steps` steps back to back, each timed (a step is long enough to be its own batch)."""
    times = [time_once(fn, device) for _ in range(steps)]
    return {"calls": steps, "step_s": times, "tflops": flops * steps / sum(times) / 1e12,
            "tflops_first": flops / times[0] / 1e12, "ms_per_call": sum(times) / steps * 1e3}  # fmt: skip


def table(res: dict) -> str:
    board = res.get("board") or {}
    lines = [
        f"sustained rates, {res['environment'].get('gpu', res['environment']['device'])}; power cap "
        f"{board.get('power_limit_w', '-')} W, SM max {board.get('sm_max_mhz', '-')} MHz",
        f"{'phase':15s} {'TF/s':>6s} {'first':>6s} {'SM MHz':>7s} {'min':>6s} {'W med':>6s} {'W max':>6s} "
        f"{'°C':>4s}  reasons",
    ]
    for name, r in res["phases"].items():
        c = r.get("clocks") or {}
        name = name.removeprefix("fa4-")
        cells = [
            format(c[key], fmt) if key in c else "-".rjust(int(fmt[0]))
            for key, fmt in (("sm_mhz", "7.0f"), ("sm_mhz_min", "6.0f"), ("power_w", "6.0f"),
                             ("power_w_max", "6.0f"), ("temp_c_max", "4.0f"))
        ]  # fmt: skip
        lines.append(
            f"{name:15s} {r.get('tflops', float('nan')):6.0f} {r.get('tflops_first', float('nan')):6.0f} "
            + " ".join(cells)
            + f"  {','.join(c.get('reasons', [])) or '-'}"
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

"""The phases of one `worldserve bench` run, in the order that keeps the most important numbers safest.

1. transformer: diffusers' transformer and ours built once with the same random weights; at every point,
   our prefill (once) and K timed CFG steps, then diffusers' K steps on identical inputs; parity of the
   last outputs; with `profile`, one step of each under torch.profiler (first point only).
2. decode: Wan2.2 VAE + audio decode + uint8/D2H + mux at the first point (diffusers freed first).
3. variants: kernel micro-benchmarks, CFG run sequentially, and the step in the other mode: eager when ours
   runs compiled (the product's default, as `serve` runs it), compiled under `--enforce-eager` (only while the
   time budget allows: compile takes minutes).
Results are re-written after every phase, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from worldserve.bench import report
from worldserve.bench.clocks import ClockLog, board_limits
from worldserve.bench.decode import bench_decode, decode_total
from worldserve.bench.denoise import DiffusersStep, OurStep, Step, make_inputs, rel_error
from worldserve.bench.flops import PEAK_BF16_TFLOPS, roofline_seconds
from worldserve.bench.timing import Timing, allocated_gib, free_memory, peak_gib, reset_peak, time_region
from worldserve.bench.workload import Workload

if TYPE_CHECKING:
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer

PHASES = ("transformer", "profile", "decode", "variants")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchOptions:
    points: tuple[Workload, ...]
    """Benchmark points; the first is also used for profile, decode and variants."""
    steps: int = 3
    """Timed denoising steps per point and implementation."""
    warmup: int = 1
    """Untimed (reported) steps before timing."""
    phases: frozenset[str] = field(default_factory=lambda: frozenset(PHASES))
    """Which phases run."""
    diffusers: bool = True
    """Also time diffusers' transformer."""
    tiny: bool = False
    """Tiny configs (a CPU smoke run of the harness; numbers are meaningless)."""
    device: str = "cuda"
    """Torch device."""
    out_dir: Path = Path("bench/results")
    """Where the JSON, markdown and profiler tables go."""
    seed: int = 0
    """Weights and inputs seed."""
    time_budget_s: float = 540.0
    """Wall-clock budget: the compiled variant (under compile=False) is skipped when it would not fit."""
    compile: bool = True
    """Our gen layers torch.compile'd on CUDA, as `serve` runs them (KernelOptions.apply); False: eager, as
    `serve --enforce-eager`."""
    e2e_steps: int = 35
    """Steps of the end-to-end estimate."""
    diffusers_cudnn: bool = True
    """Also time diffusers with our SDPA backend priority (cuDNN first)."""
    attention_backend: str | None = None
    """Our attention kernel (flash_attention.BACKENDS; None = auto, the product default: FA3 where it
    runs, the gen tower FA4's cluster kernel where that runs too)."""


class _CudnnFirst:
    """Wraps a step in the SDPA backend priority our attention uses (cuDNN, flash, efficient, math)."""

    def __init__(self, step: Step) -> None:
        self.step = step

    def __call__(self, timestep: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        from torch.nn.attention import sdpa_kernel

        from worldserve.models.layers.attention import CUDA_SDPA_PRIORITY

        with sdpa_kernel(CUDA_SDPA_PRIORITY, set_priority=True):
            return self.step(timestep)


class Bench:
    def __init__(self, opts: BenchOptions, log: Callable[[str], None] = print):
        self.o, self.log = opts, log
        self.device = torch.device(opts.device)
        self.t0 = time.perf_counter()
        self.stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self.results: dict = {
            "environment": report.environment(self.device),
            "args": {
                "steps": opts.steps,
                "warmup": opts.warmup,
                "phases": sorted(opts.phases),
                "tiny": opts.tiny,
                "text_tokens": opts.points[0].cond_text,
                "neg_text_tokens": opts.points[0].uncond_text,
                "peak_bf16_tflops": PEAK_BF16_TFLOPS,
            },
            "points": [],
        }
        self.ours: Cosmos3Transformer | None = None  # build() makes both
        self.ref: torch.nn.Module | None = None  # diffusers' transformer (None without it, or once freed)
        self.compiled = False
        self._t = 999

    # ------------------------------------------------------------------ helpers
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def save(self) -> str:
        return report.write(self.results, self.o.out_dir, self.stamp)

    def _next_timestep(self) -> int:
        self._t = 999 if self._t < 100 else self._t - 7  # values do not change the work
        return self._t

    def _one_step(self, step: Callable[[int], object]) -> object:
        """`step` once, at the next timestep (what the profile phase records)."""
        return step(self._next_timestep())

    def _time_steps(
        self, step: Step, w: Workload, weights_gib: float, warmup: int | None = None,
        repeats: int | None = None,
    ) -> dict:  # fmt: skip
        resident = allocated_gib(self.device)
        reset_peak(self.device)
        t = time_region(
            lambda: step(self._next_timestep()),
            self.device,
            warmup=self.o.warmup if warmup is None else warmup,
            repeats=self.o.steps if repeats is None else repeats,
        )
        peak = peak_gib(self.device)
        return self._step_stats(t, w) | {
            "peak_gib": peak,
            "standalone_peak_gib": peak - resident + weights_gib,
        }

    def _step_stats(self, t: Timing, w: Workload) -> dict:
        flops = w.step_flops()
        return {
            "step_s": t.to_dict(),
            "tflops": flops / t.median / 1e12,
            "frac_of_peak": flops / t.median / 1e12 / PEAK_BF16_TFLOPS,
            "x_roofline": t.median / roofline_seconds(flops),
        }

    # ------------------------------------------------------------------ phases
    def build(self) -> None:
        from worldserve.bench.models import build_diffusers_transformer, build_our_transformer, param_count
        from worldserve.models.cosmos3.config import Cosmos3Config

        cfg = Cosmos3Config.tiny() if self.o.tiny else Cosmos3Config.nano()
        dtype = torch.bfloat16
        if self.o.diffusers:
            self.log("building diffusers Cosmos3OmniTransformer (meta -> to_empty -> normal_)")
            self.ref = build_diffusers_transformer(cfg, self.device, dtype, self.o.seed)
            self.ref_gib = allocated_gib(self.device)
        self.log("building our Cosmos3Transformer (weights copied from diffusers)")
        before = allocated_gib(self.device)
        self.ours = build_our_transformer(cfg, self.device, dtype, self.ref, self.o.seed)
        self.ours_gib = allocated_gib(self.device) - before
        from worldserve.runner.kernel_options import KernelOptions

        options = KernelOptions(compile=self.o.compile, attention_backend=self.o.attention_backend)
        attention = options.apply(self.ours)  # as serve: the attention kernel, then compile (on CUDA)
        self.compiled = attention.endswith("+compiled")
        self.log(f"our kernels: {attention}")
        self.results["models"] = {
            "ours_attention": attention,
            "ours_params": param_count(self.ours),
            "ours_weights_gib": self.ours_gib,
            "diffusers_params": param_count(self.ref) if self.ref is not None else None,
            "build_s": self.elapsed(),
        }

    def transformer_point(self, w: Workload, first: bool) -> dict:
        assert self.ours is not None, "build() runs before the transformer points"
        point: dict[str, Any] = {
            "workload": w.label,
            "video_tokens": w.video_tokens,
            "audio_frames": w.audio_frames,
            "gen_tokens": w.gen_tokens,
            "text_tokens": list(w.text_tokens),
            "forward_flops": list(w.forward_flops()),
            "step_flops": w.step_flops(),
            "roofline_step_s": roofline_seconds(w.step_flops()),
        }
        inputs = make_inputs(w, self.ours.config.vocab_size, self.device, self.o.seed)
        ours = OurStep(self.ours, w, inputs)
        prefill = time_region(ours.prefill, self.device, warmup=1, repeats=2)
        self.log(
            f"[{w.label}] ours: prefill {prefill.median * 1e3:.1f} ms; {self.o.warmup}+{self.o.steps} steps"
        )
        warmup = self.o.warmup + self.compiled  # compiled: the first call compiles this shape's graphs
        point["ours"] = self._time_steps(ours, w, self.ours_gib, warmup=warmup) | {
            "prefill_s": prefill.to_dict()
        }
        self.log(f"[{w.label}] ours step {point['ours']['step_s']['median']:.3f} s")
        if self.ref is not None:
            ref = DiffusersStep(self.ref, w, inputs)
            self.log(f"[{w.label}] diffusers: {self.o.warmup}+{self.o.steps} steps")
            point["diffusers"] = self._time_steps(ref, w, self.ref_gib)
            self.log(f"[{w.label}] diffusers step {point['diffusers']['step_s']['median']:.3f} s")
            point["speedup"] = point["diffusers"]["step_s"]["median"] / point["ours"]["step_s"]["median"]
            point["parity"] = {k: rel_error(ours.last[k], ref.last[k]) for k in ours.last}
            if self.o.diffusers_cudnn and self.device.type == "cuda":
                # The same SDPA backend priority as ours (cuDNN first): diffusers minus the FA2 default choice.
                self.log(f"[{w.label}] diffusers with cuDNN-first SDPA: {self.o.warmup}+{self.o.steps} steps")
                point["diffusers_cudnn"] = self._time_steps(_CudnnFirst(ref), w, self.ref_gib)
                point["speedup_vs_diffusers_cudnn"] = (
                    point["diffusers_cudnn"]["step_s"]["median"] / point["ours"]["step_s"]["median"]
                )
                self.log(
                    f"[{w.label}] diffusers (cuDNN) step {point['diffusers_cudnn']['step_s']['median']:.3f} s"
                )
            if first and "profile" in self.o.phases:
                self.profile(w, ours, ref)
        elif first and "profile" in self.o.phases:
            self.profile(w, ours, None)
        return point

    def profile(self, w: Workload, ours: OurStep, ref: DiffusersStep | None) -> None:
        from worldserve.bench.variants import profile_step

        prof = {}
        for name, step in (("ours", ours), ("diffusers", ref)):
            if step is None:
                continue
            self.log(f"[{w.label}] profiling one {name} step")
            prof[name] = profile_step(
                functools.partial(self._one_step, step),
                self.device,
                self.o.out_dir / f"profile_{name}_{w.width}x{w.height}.txt",
            )
        self.results["profile"] = prof

    def decode(self) -> None:
        w = self.o.points[0]
        res = bench_decode(
            w,
            self.device,
            torch.bfloat16,
            tiny=self.o.tiny,
            repeats=max(1, min(self.o.steps, 2)),
            log=self.log,
            profile_file=self.o.out_dir / f"profile_vae_{w.width}x{w.height}.txt"
            if "profile" in self.o.phases
            else None,
        )
        self.results["decode"] = res
        self.log(
            f"VAE decode {res['vae_decode_s']['median']:.2f} s (first {res['vae_decode_s']['warmup'][0]:.2f} s)"
        )

    def variants(self) -> None:
        from worldserve.bench.variants import attention_micro, gemm_micro, gen_layers_compiled

        w = self.o.points[0]
        point = self.results["points"][0]
        base = point["ours"]["step_s"]["median"]
        var: dict = {}
        assert self.ours is not None, "build() runs before the variants (they need the transformer points)"
        c = self.ours.config
        if self.device.type == "cuda":
            self.log("micro-benchmarks: attention layouts, fused vs separate GEMMs")
            var["attention"] = attention_micro(
                w.gen_tokens,
                w.cond_text,
                self.device,
                heads=c.num_attention_heads,
                kv_heads=c.num_key_value_heads,
                head_dim=c.head_dim,
            )
            var["gemm"] = gemm_micro(
                w.gen_tokens, self.device, d=c.hidden_size, q=c.q_dim, kv=c.kv_dim, inter=c.intermediate_size
            )
        self.results["variants"] = var
        self.save()
        inputs = make_inputs(w, c.vocab_size, self.device, self.o.seed)
        seq = OurStep(self.ours, w, inputs, batch_cfg=False)
        seq.prefill()
        self.log("variant: CFG branches run one after the other")
        var["cfg_sequential"] = self._time_steps(seq, w, self.ours_gib, warmup=0, repeats=1)
        self.save()
        mode = "eager" if self.compiled else "compiled"
        if mode == "compiled" and self.elapsed() + 150 > self.o.time_budget_s:
            var[mode] = {
                "skipped": f"time budget ({self.elapsed():.0f} s used of {self.o.time_budget_s:.0f})"
            }
        else:
            step = OurStep(self.ours, w, inputs)
            step.prefill()
            step(999)
            product_last = dict(step.last)
            with gen_layers_compiled(self.ours, not self.compiled):
                self.log(
                    f"variant: the gen layers {mode}"
                    + (" (first call compiles)" if mode == "compiled" else "")
                )
                var[mode] = self._time_steps(step, w, self.ours_gib, warmup=2 if mode == "compiled" else 1)
                var[mode]["parity_vs_ours"] = {
                    k: rel_error(step.last[k], product_last[k]) for k in product_last
                }
            self.save()
            if self.device.type == "cuda":
                from worldserve.bench.variants import layer_numerics

                self.log("numerics: one gen layer eager / compiled vs float32")
                var["layer_numerics"] = layer_numerics(self.ours, self.device)
        var["table"] = report.variant_rows(self.results, var, point, base, c.num_hidden_layers)

    def e2e(self) -> None:
        point, dec = self.results["points"][0], self.results.get("decode")
        tail = decode_total(dec) if dec else 0.0
        est = {}
        var = self.results.get("variants", {})
        runs = {**point, **{f"ours_{m}": var[m] for m in ("eager", "compiled") if "step_s" in var.get(m, {})}}
        for name in ("ours", "ours_eager", "ours_compiled", "diffusers", "diffusers_cudnn"):
            p = runs.get(name)
            if not p:
                continue
            step = p["step_s"]["median"]
            prefill = point["ours"]["prefill_s"]["median"] if name.startswith("ours") else 0.0
            fixed = tail + prefill
            est[name] = {
                "steps": self.o.e2e_steps,
                "step_s": step,
                "denoise_s": self.o.e2e_steps * step,
                "fixed_s": fixed,
                "total_s": self.o.e2e_steps * step + fixed,
                "request_pflop": self.o.e2e_steps * point["step_flops"] / 1e15,
            }
        self.results["e2e_estimate"] = est

    # ------------------------------------------------------------------ driver
    def run(self) -> str:
        """All phases, with the GPU's clock and power read beside them (bench/clocks.py: the board's power
        cap sets the sustained rate, so a run on a slower machine shows why in its results)."""
        clocks = ClockLog().start() if self.device.type == "cuda" else ClockLog()
        try:
            return self._run(clocks)
        finally:
            clocks.stop()
            self.results["clocks"] = {"board": board_limits(), "phases": clocks.summary()}
            self.save()

    def _run(self, clocks: ClockLog) -> str:
        ph = self.o.phases
        if "transformer" in ph:  # variants need the transformer points too
            self.build()
        if "transformer" in ph:
            for i, w in enumerate(self.o.points):
                with clocks.phase(f"transformer {w.label}"):
                    self.results["points"].append(self.transformer_point(w, first=i == 0))
                self.save()
        self.ref = None
        free_memory(self.device)
        if "decode" in ph:
            with clocks.phase("decode"):
                self.decode()
            self.save()
        if "variants" in ph and self.results["points"]:
            with clocks.phase("variants"):
                self.variants()
            self.save()
        if self.results["points"]:
            self.e2e()
        self.results["wall_s"] = self.elapsed()
        return self.save()

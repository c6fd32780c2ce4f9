"""The `--quantization fp8` denoising step against bf16 on one GPU: speed, memory and error, same weights.

Builds the full-size Cosmos3-Nano transformer with random bf16 weights (worldserve/bench/models.py), then on
one 720p x 189 + audio CFG step (cond + uncond packed, 300-token prompts; worldserve/bench/denoise.py):
1. an eager bf16 step with the gen layers' GEMM inputs captured on a subsample of rows: per layer and GEMM
   (qkv, o, gate_up, down) the relative L2 error against a float32 GEMM of bf16, fp8 fast-accum and fp8
   fp32-accum (the weight quantised per row as quantize_gen_fp8 does);
2. the bf16 step torch.compile'd (the product default): seconds a step, TFLOP/s (worldserve/bench/flops.py);
3. quantize_gen_fp8() (bf16 gen weights freed), compiled again: fast accumulation (the default), then
   fp32 accumulation; seconds, TFLOP/s, and the rel. L2 error of the fp8 velocities (video, sound, CFG
   combined and per branch) against the compiled bf16 ones at the same timestep and inputs. The eager vs
   compiled bf16 difference is reported next to it: the rounding-order noise floor of a 36-layer random model.
Writes JSON to --out (a .json file, or a folder) and prints a short table last. Random weights give benign,
Gaussian-like activations: real checkpoints have outlier channels, so treat the errors as a lower bound.

    PYTHONPATH=. python bench/fp8_step.py --out $OUT/fp8_step.json          # H200: ~3 min, compiles 3 times
    PYTHONPATH=. python bench/fp8_step.py --tiny --device cpu --out /tmp/x  # smoke test (emulated fp8)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from worldserve.bench.denoise import rel_error, snapshot

GEMMS = ("qkv", "o", "gate_up", "down")
T_REF = 500  # timestep of the compared velocities (any value costs the same work)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file (or folder for fp8-step-<stamp>.json)")
    ap.add_argument("--size", default="1280x720", help="WIDTHxHEIGHT (default 1280x720)")
    ap.add_argument("--frames", type=int, default=189, help="pixel frames, 4k+1 (default 189)")
    ap.add_argument("--text-tokens", type=int, default=300, help="tokens of each prompt (cond, uncond)")
    ap.add_argument("--no-sound", action="store_true", help="video tokens only")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (after 1 warm-up)")
    ap.add_argument("--accum", choices=("fast", "fp32", "both"), default="both", help="fp8 accumulation runs")
    ap.add_argument("--sample-rows", type=int, default=4096, help="rows of each GEMM input in the error pass")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true", help="no torch.compile (compiled is the default on CUDA)")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke test; fp8 emulated)")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------- GEMM errors
class GemmErrorProbe:
    """Wraps every gen block's qkv_fn / finish_fn (eager) to measure its four GEMMs on sampled rows."""

    def __init__(self, model, rows: int, emulate: bool):
        self.model, self.rows, self.emulate = model, rows, emulate
        self.layers: list[dict[str, dict[str, float]]] = [{} for _ in model.layers]
        self.saved = [(layer.gen.qkv_fn, layer.gen.finish_fn) for layer in model.layers]

    def _sample(self, x: torch.Tensor) -> torch.Tensor:
        idx = torch.linspace(0, x.shape[0] - 1, min(self.rows, x.shape[0]), device=x.device).long()
        return x.index_select(0, idx)

    def _measure(self, i: int, name: str, x: torch.Tensor, w: torch.Tensor) -> None:
        import torch.nn.functional as F

        from worldserve.models.layers.fp8 import fp8_linear, quantize_rowwise

        ref = x.float() @ w.float().t()  # [rows, N] float32 reference on the same (bf16) inputs
        wq, ws = quantize_rowwise(w)
        errs = {"bf16": rel_error(F.linear(x, w), ref)}
        for tag, fast in (("fp8_fast_accum", True), ("fp8_fp32_accum", False)):
            errs[tag] = rel_error(fp8_linear(x, wq, ws, emulate=self.emulate, fast_accum=fast), ref)
        self.layers[i][name] = errs

    def install(self) -> None:
        from worldserve.models.cosmos3.layer import finish_math, qkv_math
        from worldserve.models.layers.norm import rms_norm

        for i, layer in enumerate(self.model.layers):

            def qkv_fn(h, cos, sin, ln_w, qkv_w, *args, i=i, **kw):
                eps = args[3]
                self._measure(i, "qkv", rms_norm(self._sample(h), ln_w, eps), qkv_w)
                return qkv_math(h, cos, sin, ln_w, qkv_w, *args, **kw)

            def finish_fn(h, attn, o_w, o_b, ln_w, gu_w, down_w, eps, *args, i=i, **kw):
                import torch.nn.functional as F

                a = self._sample(attn.flatten(1))
                self._measure(i, "o", a, o_w)
                x = rms_norm(self._sample(h) + F.linear(a, o_w, o_b), ln_w, eps)
                self._measure(i, "gate_up", x, gu_w)
                gate, up = F.linear(x, gu_w).chunk(2, dim=-1)
                self._measure(i, "down", F.silu(gate) * up, down_w)
                return finish_math(h, attn, o_w, o_b, ln_w, gu_w, down_w, eps, *args, **kw)

            layer.gen.qkv_fn, layer.gen.finish_fn = qkv_fn, finish_fn

    def remove(self) -> None:
        for layer, (q, f) in zip(self.model.layers, self.saved, strict=True):
            layer.gen.qkv_fn, layer.gen.finish_fn = q, f

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """gemm -> kind -> {mean, max} over layers."""
        out: dict = {}
        for g in GEMMS:
            for kind in self.layers[0][g]:
                vals = [layer[g][kind] for layer in self.layers]
                out.setdefault(g, {})[kind] = {"mean": sum(vals) / len(vals), "max": max(vals)}
        return out


# ---------------------------------------------------------------------------------------------- steps
def compare(a: dict, b: dict) -> dict[str, float | None]:
    return {k: rel_error(a[k], b[k]) for k in b}


def time_variant(name: str, step, w, device, args, log) -> dict:
    from worldserve.bench.flops import tflops
    from worldserve.bench.timing import peak_gib, reset_peak, time_region

    reset_peak(device)
    log(f"{name}: warm-up (compiles on the first call), then {args.steps} timed steps")
    t = time_region(lambda: step(999), device, warmup=1, repeats=args.steps)
    flops = w.step_flops(args.shape)
    return {
        **t.to_dict(),
        "step_s": t.median,
        "tflops": tflops(flops, t.median),
        "peak_gib": peak_gib(device),
    }


def set_fast_accum(model, fast: bool) -> None:
    for layer in model.layers:
        layer.gen.fp8["fast_accum"] = fast
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            getattr(layer.gen, name).fast_accum = fast


def run(args: argparse.Namespace, log=print, save=lambda res: None) -> dict:
    """All phases; `save(res)` after each one, so a run cut short keeps what it measured."""
    from worldserve.bench.denoise import OurStep, make_inputs
    from worldserve.bench.flops import TowerShape
    from worldserve.bench.models import build_our_transformer
    from worldserve.bench.report import environment
    from worldserve.bench.timing import allocated_gib, free_memory
    from worldserve.bench.workload import Workload
    from worldserve.models.cosmos3.config import Cosmos3Config
    from worldserve.models.layers.fp8 import fp8_supported

    device = torch.device(args.device)
    emulate = not fp8_supported(device)
    if emulate and not args.tiny:
        raise SystemExit(
            f"{device} has no row-wise fp8 GEMMs (needs CUDA sm90+); use --tiny --device cpu to smoke-test"
        )
    compiled = device.type == "cuda" and not args.eager
    width, height = (int(v) for v in args.size.lower().split("x"))
    w = Workload(width=width, height=height, num_frames=args.frames, sound=not args.no_sound,
                 cond_text=args.text_tokens, uncond_text=args.text_tokens)  # fmt: skip
    cfg = Cosmos3Config.tiny() if args.tiny else Cosmos3Config.nano()
    args.shape = TowerShape.from_config(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res: dict = {"environment": environment(device), "workload": w.label, "gen_tokens": w.gen_tokens,
                 "step_flops": w.step_flops(args.shape), "compiled": compiled, "emulated_fp8": emulate,
                 "args": {k: v for k, v in vars(args).items() if k not in ("out", "shape")}}  # fmt: skip
    t0 = time.perf_counter()
    model = build_our_transformer(cfg, device, dtype, None, args.seed)
    res["weights_gib_bf16"] = allocated_gib(device)
    step = OurStep(model, w, make_inputs(w, cfg.vocab_size, device, args.seed))
    step.prefill()
    log(f"built {w.label} ({w.gen_tokens} gen tokens) in {time.perf_counter() - t0:.1f} s")

    probe = GemmErrorProbe(model, args.sample_rows, emulate)
    probe.install()
    eager = snapshot(step, T_REF)
    probe.remove()
    res["gemm_error_per_layer"], res["gemm_error"] = probe.layers, probe.summary()
    log("GEMM errors measured (eager bf16 pass)")
    save(res)

    if compiled:
        model.compile_gen_layers()
    res["bf16"] = time_variant("bf16" + (" compiled" if compiled else ""), step, w, device, args, log)
    ref = snapshot(step, T_REF)
    res["bf16"]["eager_vs_this"] = compare(eager, ref)
    del eager
    save(res)
    model.quantize_gen_fp8(emulate=emulate, fast_accum=True)
    free_memory(device)
    res["weights_gib_fp8"] = allocated_gib(device)
    accums = {"fast": (True,), "fp32": (False,), "both": (True, False)}[args.accum]
    for fast in accums:
        name = "fp8_fast_accum" if fast else "fp8_fp32_accum"
        set_fast_accum(model, fast)
        try:
            res[name] = time_variant(name, step, w, device, args, log)
        except RuntimeError as e:  # e.g. a build whose row-wise kernel lacks this accumulation mode
            log(f"{name} failed: {e}")
            res.setdefault("failed", {})[name] = str(e)
            continue
        res[name]["error_vs_bf16"] = compare(snapshot(step, T_REF), ref)
        res[name]["speedup_vs_bf16"] = res["bf16"]["step_s"] / res[name]["step_s"]
        save(res)
    res["wall_s"] = time.perf_counter() - t0
    return res


def table(res: dict) -> str:
    lines = [
        f"fp8 step: {res['workload']}, {res['gen_tokens']} gen tokens, {res['step_flops'] / 1e15:.2f} PF a step, "
        f"{res['environment'].get('gpu', res['environment']['device'])}, compiled={res['compiled']}",
        f"weights resident: bf16 {res['weights_gib_bf16']:.2f} GiB -> fp8 gen tower {res['weights_gib_fp8']:.2f} GiB",
        "",
        f"{'variant':16s} {'s/step':>8s} {'TF/s':>7s} {'speed-up':>8s} {'peak GiB':>8s} "
        f"{'err video':>9s} {'err sound':>9s} {'err cond':>9s}",
    ]

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    floor = res["bf16"]["eager_vs_this"]
    for name in ("bf16", "fp8_fast_accum", "fp8_fp32_accum"):
        if name not in res:
            if name in res.get("failed", {}):
                lines.append(f"{name:16s} failed: {res['failed'][name][:80]}")
            continue
        r = res[name]
        e = r.get("error_vs_bf16", {})
        lines.append(
            f"{name:16s} {r['step_s']:8.3f} {r['tflops']:7.1f} {r.get('speedup_vs_bf16', 1.0):7.3f}x "
            f"{r['peak_gib']:8.2f} {fmt(e.get('video')):>9s} {fmt(e.get('sound')):>9s} "
            f"{fmt(e.get('cond_video')):>9s}"
        )
    lines.append(
        f"{'(bf16 eager)':16s} {'':8s} {'':7s} {'':8s} {'':8s} {fmt(floor['video']):>9s} "
        f"{fmt(floor['sound']):>9s} {fmt(floor['cond_video']):>9s}   <- rounding-order noise floor"
    )
    lines += ["", "GEMM rel. L2 error vs float32 on the same inputs, mean / max over layers:"]
    for g, kinds in res["gemm_error"].items():
        cells = "  ".join(f"{k} {v['mean']:.4f}/{v['max']:.4f}" for k, v in kinds.items())
        lines.append(f"  {g:8s} {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from worldserve.bench.report import run_script

    return run_script(parse_args(argv), run, table, "fp8-step")


if __name__ == "__main__":
    sys.exit(main())

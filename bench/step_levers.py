"""The denoising step's lossless levers measured side by side in one process, with diffusers as reference.

Builds diffusers' `Cosmos3OmniTransformer` (random bf16 weights, worldserve/bench/models.py) and ours from the
same tensors, ours torch.compile'd with the product's attention (FA3 on Hopper), and times one CFG step
(cond + uncond packed, 300-token prompts; worldserve/bench/denoise.py) at 1280x720x189 + audio for:
- `concat`: the per-item path: text and gen K/V concatenated per item and layer, per-item attention outputs
  concatenated for o_proj (the code before `GenAttentionBuffers`; still the Ulysses path);
- `buffers`: `GenAttentionBuffers`: the compiled qkv kernel stores K/V into one per-forward buffer behind
  each item's prompt K/V, FA3 writes into one output buffer; the first layer's attention not shared;
- `addmm-copy`: plus the CFG pair's first-layer gen-gen attention computed once and merged by LSE with
  each branch's prompt attention; the layer's end the compiled finish_math (inductor's addmm for each
  residual add, which first copies the residual stream into its output);
- `buffers+twins`: the product default: as `addmm-copy`, the residual adds done by the GEMMs in place
  (`finish_residual_in_place`), the product's attention (on Hopper FA4's cluster kernel for the gen
  layers where it runs, models/layers/fa4_cluster.py); `concat` and `buffers` also run the compiled
  finish_math;
- `fa3`: `buffers+twins` with the gen layers' attention through FA3 (the product before the cluster kernel);
- `pack-each-step`: `buffers+twins` with GenBatch.pack's layout built anew and moved to the GPU by plain
  (stream-synchronizing) copies every step, as before the layout cache (batch.py `_packed_layout`);
- `cublaslt`: `buffers+twins` with PyTorch's GEMMs through cuBLASLt (`preferred_blas_library`; the only
  path where the chats' SM carve-out, runner/chat_share.py, also reaches the bf16 GEMMs): its cost or gain;
- `fa4`: `buffers+twins` with every layer's attention through FlashAttention-4's CuTe-DSL kernel
  (`worldserve/bench/fa4.py`) with the tile `--fa4` names (bench/attention_fa4.py searches them);
- `fa4-prebuilt`: `buffers+twins` with the gen layers' attention through the FA4 kernel `--fa4-kernel` of
  the folder `--fa4-prebuilt` (compiled ahead of time by bench/fa4_export.py, loaded by
  models/layers/fa4_cluster.py's `load_kernels`: candidates beside the product's kernel);
- `diffusers`: diffusers' transformer with its default SDPA.
Variants alternate over --rounds (each round runs every variant --steps times, in the reverse order every
other round; one warm-up each first), so drift of the machine's clocks spreads over all of them.
`--variants` picks a subset. Reported: median seconds a step, TFLOP/s (performance.md's FLOP model), the
ratio to the first variant run (`concat` by default), the speed-up over diffusers, and the rel. L2 of each
variant's velocities against the first one's at the same inputs (bf16 rounding order only).

    PYTHONPATH=. python bench/step_levers.py --out $OUT/step_levers.json       # H200: ~4 min
    PYTHONPATH=. python bench/step_levers.py --tiny --device cpu --out /tmp/x  # smoke test of the script
With --profile-dir, one more step of each of our variants runs under torch.profiler (kernel tables there,
time by kernel category in the JSON), and the attention kernel is timed alone at the step's shape (random
q / K / V, CUDA events): its ms a call beside the profile's in-step ms a call.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from worldserve.bench.denoise import rel_error, snapshot

T_REF = 500  # timestep of the compared velocities
VARIANTS = (
    "concat",
    "buffers",
    "addmm-copy",
    "pack-each-step",
    "buffers+twins",
    "fa3",
    "cublaslt",
    "fa4",
    "fa4-prebuilt",
    "diffusers",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, required=True, help="JSON file (or folder for step-levers-<stamp>.json)"
    )
    ap.add_argument("--size", default=None, help="WIDTHxHEIGHT (default 1280x720; --tiny: 64x64)")
    ap.add_argument("--frames", type=int, default=None, help="pixel frames, 4k+1 (default 189; --tiny: 9)")
    ap.add_argument("--text-tokens", type=int, default=300, help="tokens of each prompt (cond, uncond)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke test)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of the variants")
    ap.add_argument("--fa4", default="128x128-rs-ovl-gqaauto", help="the fa4 variant's Fa4Config spec")
    ap.add_argument(
        "--fa4-prebuilt", type=Path, default=None, help="fa4-prebuilt: bench/fa4_export.py's folder"
    )
    ap.add_argument("--fa4-kernel", default="fa4_sm90_128x176_c2", help="fa4-prebuilt: the kernel's name")
    ap.add_argument(
        "--stacks", action="store_true", help="with --profile-dir: the Python stacks of copies and host syncs"
    )
    ap.add_argument(
        "--profile-dir", type=Path, default=None,
        help="after the rounds, one step of each of our variants under torch.profiler: kernel tables here",
    )  # fmt: skip
    args = ap.parse_args(argv)
    asked = [v for v in args.variants.split(",") if v]
    if not asked or set(asked) - set(VARIANTS):
        ap.error(f"--variants: a comma-separated subset of {', '.join(VARIANTS)}, got {args.variants!r}")
    args.variants = tuple(v for v in VARIANTS if v in asked)
    if "fa4-prebuilt" in args.variants and args.fa4_prebuilt is None:
        ap.error("the fa4-prebuilt variant needs --fa4-prebuilt DIR")
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be >= 1")
    args.size = args.size or ("64x64" if args.tiny else "1280x720")
    args.frames = args.frames or (9 if args.tiny else 189)
    return args


@functools.cache
def _compiled_finish_math(compiled: bool):
    """finish_math as compile_blocks compiled it before finish_residual_in_place (eager off the GPU, where
    the gen layers are not compiled)."""
    from worldserve.models.cosmos3.layer import finish_math

    return torch.compile(finish_math, dynamic=False) if compiled else finish_math


class _NoLayoutCache(dict):
    """A GenBatch layout cache that keeps nothing: every pack builds and copies its layout again."""

    def __setitem__(self, key, value) -> None:
        pass


@contextlib.contextmanager
def variant(model, name: str, fa4_spec: str = "128x128-rs-ovl-gqaauto", prebuilt=None):
    """Switch our model to one of the step's code paths for the duration (`prebuilt`: the fa4-prebuilt
    variant's `fa4_cluster.Fa4Kernel`)."""
    first = model.layers[0].gen
    lse_fn = first.attn_lse_fn
    with contextlib.ExitStack() as stack:
        if name == "concat":
            no_buffers = lambda *a, **k: None  # noqa: E731  (forward then takes the per-item path)
            stack.enter_context(
                mock.patch("worldserve.models.cosmos3.transformer.GenAttentionBuffers", no_buffers)
            )
        if name in ("concat", "buffers"):
            first.attn_lse_fn = None  # no LSEs: the first layer attends per item
        if name in ("concat", "buffers", "addmm-copy"):  # the compiled finish_math (its addmm copies h)
            finish = _compiled_finish_math(model.layers[0].gen.qkv_proj.weight.is_cuda)
            for block in (layer.gen for layer in model.layers):
                stack.callback(setattr, block, "finish_fn", block.finish_fn)
                block.finish_fn = finish
        if name == "pack-each-step":
            from worldserve.models.cosmos3 import batch as batch_mod

            stack.enter_context(mock.patch.object(batch_mod, "_LAYOUTS", _NoLayoutCache()))
        if name == "fa4":
            from worldserve.bench import fa4

            fa4.set_fa4_config(fa4.Fa4Config.parse(fa4_spec))
            for layer in model.layers:
                for block in (layer.und, layer.gen):
                    stack.callback(setattr, block, "attn_fn", block.attn_fn)
                    block.attn_fn = fa4.fa4_attention
            first.attn_lse_fn = fa4.fa4_forward
        if name in ("fa3", "fa4-prebuilt"):  # the gen layers only (the prompt's causal K/V are prefilled)
            from worldserve.models.layers import flash_attention as fa

            gen_fn, first.attn_lse_fn = (
                (fa.fa3_attention, fa.fa3_forward)
                if name == "fa3"
                else (prebuilt.attention, prebuilt.forward)
            )
            for block in (layer.gen for layer in model.layers):
                stack.callback(setattr, block, "attn_fn", block.attn_fn)
                block.attn_fn = gen_fn
        blas = torch.backends.cuda.preferred_blas_library() if torch.cuda.is_available() else None
        if name == "cublaslt" and blas is not None:
            torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            yield
        finally:
            first.attn_lse_fn = lse_fn
            if blas is not None:
                torch.backends.cuda.preferred_blas_library(blas)


def attention_alone(model, w, device: torch.device, repeats: int = 10) -> dict:
    """The gen layers' attention function alone on random q [N_g, Hq, D] over [T + N_g] keys (one item of
    the step): median ms of `repeats` back-to-back calls, and TFLOP/s (4 N_q N_k Hq D)."""
    import statistics

    from worldserve.bench.timing import time_once

    block = model.layers[0].gen
    n, nk = w.gen_tokens, w.gen_tokens + w.cond_text
    g = torch.Generator(device=device).manual_seed(0)
    dtype = block.qkv_proj.weight.dtype
    q = torch.randn(n, block.num_heads, block.head_dim, device=device, dtype=dtype, generator=g)
    k, v = (
        torch.randn(nk, block.num_kv_heads, block.head_dim, device=device, dtype=dtype, generator=g)
        for _ in range(2)
    )
    out = torch.empty_like(q)
    fn = lambda: block.attn_fn(q, k, v, out=out)  # noqa: E731
    fn()
    ms = statistics.median(time_once(fn, device) * 1e3 for _ in range(repeats))
    return {"ms": ms, "tflops": 4 * n * nk * block.num_heads * block.head_dim / ms / 1e9}


def run(args: argparse.Namespace, log=print, save=lambda res: None) -> dict:
    from worldserve.bench.denoise import DiffusersStep, OurStep, make_inputs
    from worldserve.bench.flops import TowerShape, tflops
    from worldserve.bench.models import build_diffusers_transformer, build_our_transformer
    from worldserve.bench.report import environment
    from worldserve.bench.timing import Timing, time_once
    from worldserve.bench.workload import Workload
    from worldserve.models.cosmos3.config import Cosmos3Config

    device = torch.device(args.device)
    width, height = (int(v) for v in args.size.lower().split("x"))
    w = Workload(width=width, height=height, num_frames=args.frames, sound=True,
                 cond_text=args.text_tokens, uncond_text=args.text_tokens)  # fmt: skip
    cfg = Cosmos3Config.tiny() if args.tiny else Cosmos3Config.nano()
    shape = TowerShape.from_config(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res: dict = {"environment": environment(device), "workload": w.label, "gen_tokens": w.gen_tokens,
                 "step_flops": w.step_flops(shape), "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    t0 = time.perf_counter()
    names = args.variants
    ref = build_diffusers_transformer(cfg, device, dtype, args.seed) if "diffusers" in names else None
    ours = build_our_transformer(cfg, device, dtype, ref, args.seed)
    res["attention"] = ours.set_attention_backend(None)
    if device.type == "cuda":
        ours.compile_gen_layers()
    inputs = make_inputs(w, cfg.vocab_size, device, args.seed)
    our_step = OurStep(ours, w, inputs)
    ref_step = DiffusersStep(ref, w, inputs) if ref is not None else None
    our_step.prefill()
    prebuilt = None
    if "fa4-prebuilt" in names:
        from worldserve.models.layers.fa4_cluster import load_kernels

        prebuilt = load_kernels(args.fa4_prebuilt)[args.fa4_kernel]
        res["fa4_prebuilt"] = {"kernel": prebuilt.name, "spec": prebuilt.spec}
    log(f"built both transformers ({w.gen_tokens} gen tokens, attention {res['attention']}) in "
        f"{time.perf_counter() - t0:.0f} s")  # fmt: skip

    def path(name: str):
        """(step, context) of a variant."""
        if name == "diffusers":
            return ref_step, contextlib.nullcontext()
        return our_step, variant(ours, name, args.fa4, prebuilt)

    snaps, timings = {}, {name: Timing() for name in names}
    for name in names:  # warm-up (compiles each path's graphs) and the velocities at T_REF
        step, ctx = path(name)
        t = time.perf_counter()
        with ctx:
            snaps[name] = snapshot(step, T_REF)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings[name].warmup.append(time.perf_counter() - t)
        log(f"warm-up {name}: {timings[name].warmup[0]:.1f} s")
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:  # alternate the order: no variant always last
            step, ctx = path(name)
            with ctx:
                for _ in range(args.steps):
                    timings[name].samples.append(time_once(lambda step=step: step(999), device))
        log(f"round {r + 1}: " + ", ".join(f"{n} {timings[n].median:.3f} s" for n in names))
        res["variants"] = {n: timings[n].to_dict() for n in names}
        save(res)
    if args.profile_dir is not None:
        from worldserve.bench.variants import profile_step

        res["profile"] = {}
        for name in (n for n in names if n != "diffusers"):
            step, ctx = path(name)
            with ctx:
                res["profile"][name] = profile_step(
                    lambda step=step: step(999),
                    device,
                    args.profile_dir / f"profile_step_{name.replace('+', '_')}.txt",
                    stacks=args.stacks,
                )
            cats = res["profile"][name]["by_category_ms"]
            log(f"profile {name}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in cats.items()))
            log(f"  GPU idle: {res['profile'][name]['gpu_idle']}")
        res["attention_alone"] = attention_alone(ours, w, device)
        log(f"attention alone at the step's shape: {res['attention_alone']}")
    first = res["first"] = names[0]  # the reference of vs_first / err_vs_first ("concat" by default)
    base = timings[first].median
    diff = timings["diffusers"].median if "diffusers" in names else None
    for name in names:
        s = timings[name].median
        res["variants"][name] |= {
            "step_s": s, "tflops": tflops(res["step_flops"], s), "vs_first": base / s,
            "speedup_vs_diffusers": None if diff is None else diff / s,
            "err_vs_first": {k: rel_error(snaps[name][k], snaps[first][k]) for k in ("video", "sound")},
        }  # fmt: skip
    res["wall_s"] = time.perf_counter() - t0
    return res


def table(res: dict) -> str:
    env = res["environment"]
    lines = [
        f"step levers, {res['workload']} ({res['gen_tokens']} gen tokens), {env.get('gpu', env.get('device'))}, "
        f"attention {res['attention']}",
        f"{'variant':15s} {'s/step':>8s} {'TF/s':>6s} {'vs ' + res['first']:>9s} {'vs diffusers':>12s} "
        f"{'video err':>9s} {'sound err':>9s}",
    ]
    for name, r in res.get("variants", {}).items():
        if "step_s" not in r:
            continue
        e = r["err_vs_first"]
        fmt = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
        fmt2 = lambda x: "-" if x is None else f"{x:.3f}x"  # noqa: E731
        lines.append(
            f"{name:15s} {r['step_s']:8.3f} {r['tflops']:6.0f} {r['vs_first']:8.3f}x "
            f"{fmt2(r['speedup_vs_diffusers']):>12s} {fmt(e['video']):>9s} {fmt(e['sound']):>9s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from worldserve.bench.report import run_script

    return run_script(parse_args(argv), run, table, "step-levers")


if __name__ == "__main__":
    sys.exit(main())

"""Fused-epilogue GEMMs (quack, CuTe DSL) vs the step's cuBLAS GEMMs + separate elementwise, one GPU.

A compiled gen layer runs its MLP as cuBLAS gate_up GEMM [M, 4096] x [4096, 24,576] -> [M, 24,576], then
inductor's SwiGLU kernel (read [M, 24,576], write [M, 12,288]: ~6.5 GB at M = 88,714, a CFG step's
packed rows), then the down GEMM added into the residual stream in place (cuBLAS beta = 1). quack
(Tri Dao's CuTe-DSL kernels, a flash-attn-4 dependency) has GEMMs whose epilogue applies the SwiGLU to the
fp32 accumulator and writes only the [M, 12,288] product (`gemm_act`, gate and up concatenated in the
weight as ours are: `concat_layout=("B",)`), and in-place residual GEMMs (`gemm_add_inplace`). Timed
(CUDA events, median of --repeats after quack's autotuning on the first call):
- `mlp_up`: cuBLAS gate_up + compiled SwiGLU (the product's graph minus its RMSNorm) vs quack gemm_act;
- `qkv`, `gate_up` (no activation), `o` / `down` added into h in place: cuBLAS vs quack's plain GEMMs.
Each quack result's rel. L2 against the cuBLAS path (bf16 rounding order; the fused SwiGLU also skips the
bf16 rounding of gate and up). Prints ms, TF/s and the seconds a step would spend (x 36 layers).

    PYTHONPATH=. python bench/gemm_fused.py --out $OUT/gemm_fused.json     # H200: minutes (autotuning)

The JSON is rewritten after each case (the one run so far, 2026-11-30, was cut by the call's time limit
while quack autotuned the in-place `o` GEMM). quack-kernels 0.6.5 does not import its epilogues against
nvidia-cutlass-dsl 4.8.1 (its epilogue cache keys meet a ContextVar and a method descriptor it has no key
for); that run patched quack/gemm_runtime/identity.py to key such values by their type. `--untuned` runs
quack's default config instead of autotuning.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from worldserve.bench.denoise import rel_error
from worldserve.bench.timing import event_ms


def main(argv: list[str] | None = None) -> None:
    from quack.gemm_interface import gemm, gemm_act, gemm_add_inplace

    from worldserve.bench.report import environment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=2 * 44_357)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--untuned", action="store_true", help="quack's default configs, no autotuning")
    args = ap.parse_args(argv)
    dev, bf = torch.device("cuda"), torch.bfloat16
    m, d, inter = args.rows, 4096, 12_288
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, std=1.0):
        return torch.randn(*shape, device=dev, dtype=bf, generator=g) * std

    x = rand(m, d)
    w = {"qkv": rand(6144, d, std=0.02), "o": rand(d, d, std=0.02),
         "gate_up": rand(2 * inter, d, std=0.02), "down": rand(d, inter, std=0.02)}  # fmt: skip
    act = rand(m, inter)
    h0 = rand(m, d)
    swiglu = torch.compile(lambda gu: F.silu(gu[:, :inter]) * gu[:, inter:], dynamic=False)
    res: dict = {"environment": environment(dev), "rows": m, "cases": {}}

    def case(name, flops, ours, theirs):
        h.copy_(h0)
        want = ours().clone()
        h.copy_(h0)
        got = theirs().clone()
        c = {"cublas_ms": event_ms(ours, args.repeats, warmup=1),
             "quack_ms": event_ms(theirs, args.repeats, warmup=1), "rel_l2": rel_error(got, want)}  # fmt: skip
        c |= {f"{k}_tflops": flops / c[f"{k}_ms"] / 1e9 for k in ("cublas", "quack")}
        res["cases"][name] = c
        args.out.write_text(json.dumps(res, indent=1))
        print(f"{name}: cuBLAS {c['cublas_ms']:.2f} ms, quack {c['quack_ms']:.2f} ms, rel L2 {c['rel_l2']:.1e}",
              flush=True)  # fmt: skip

    args.out.parent.mkdir(parents=True, exist_ok=True)
    tuned = not args.untuned
    h = h0.clone()
    post = torch.empty(m, inter, device=dev, dtype=bf)
    case("mlp_up", 2 * m * d * 2 * inter,
         lambda: swiglu(F.linear(x, w["gate_up"])),
         lambda: gemm_act(x, w["gate_up"].t(), activation="swiglu", store_preact=False, postact_out=post,
                          concat_layout=("B",), tuned=tuned)[1])  # fmt: skip
    for name, a in (("qkv", x), ("gate_up", x)):
        case(name, 2 * m * d * w[name].shape[0], lambda a=a, n=name: F.linear(a, w[n]),
             lambda a=a, n=name: gemm(a, w[n].t(), tuned=tuned))  # fmt: skip
    for name, a in (("o", x), ("down", act)):
        case(name, 2 * m * a.shape[1] * d, lambda a=a, n=name: h.addmm_(a, w[n].t()),
             lambda a=a, n=name: (gemm_add_inplace(a, w[n].t(), h, tuned=tuned), h)[1])  # fmt: skip
    c = res["cases"]
    for way in ("cublas", "quack"):  # a layer: mlp_up + qkv + o + down
        res[f"step_s_{way}"] = (
            args.layers * sum(c[k][f"{way}_ms"] for k in ("mlp_up", "qkv", "o", "down")) / 1e3
        )
    args.out.write_text(json.dumps(res, indent=1))
    print(f"{'case':10s} {'cuBLAS ms':>9s} {'TF/s':>5s} {'quack ms':>9s} {'TF/s':>5s} {'rel L2':>8s}")
    for name, r in c.items():
        print(f"{name:10s} {r['cublas_ms']:9.2f} {r['cublas_tflops']:5.0f} {r['quack_ms']:9.2f} "
              f"{r['quack_tflops']:5.0f} {r['rel_l2']:8.1e}")  # fmt: skip
    print(f"a step's GEMMs (+SwiGLU): cuBLAS {res['step_s_cublas']:.3f} s, quack {res['step_s_quack']:.3f} s")


if __name__ == "__main__":
    main()

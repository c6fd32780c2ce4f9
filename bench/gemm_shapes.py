"""The gen tower's four GEMMs at a CFG step's shapes, through each way PyTorch can run them on one GPU.

A 720p x 189 + audio CFG step packs both branches' gen tokens (M = 2 x 44,357 = 88,714 rows) through
qkv_proj (4096 -> 6144), o_proj (4096 -> 4096, added into the residual stream in place: `h.addmm_`, the
product's finish_residual_in_place, cuBLAS beta = 1), gate_up_proj (4096 -> 24,576) and down_proj
(12,288 -> 4096, added in place). Each is timed (CUDA events, median of --repeats after a warm-up) as
- `cublas`: PyTorch's default (cuBLAS's own heuristic; what the step runs);
- `cublaslt`: `torch.backends.cuda.preferred_blas_library("cublaslt")` (cuBLASLt's first heuristic choice);
- `halves`: the default path on each CFG branch's 44,357 rows separately (is packing the branches a loss?).
The residual GEMMs are also timed out of place (`torch.addmm(h, x, w^T)`, which first copies h into its
output: what inductor emitted for `h + linear(x)`): `out_of_place_ms`.
Reported: ms, TFLOP/s (2 M K N), and the seconds a step spends in each GEMM (x 36 layers) per way.
(PyTorch's TunableOp is no further way on CUDA builds: its documentation says their only candidate is
the default implementation; a run of the first version of this script, commit 22141be, confirmed it.)

    PYTHONPATH=. python bench/gemm_shapes.py --out $OUT/gemm_shapes.json     # H200: ~1 min
    PYTHONPATH=. python bench/gemm_shapes.py --device cpu --rows 64 --repeats 1 --out /tmp/g.json  # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

WAYS = ("cublas", "cublaslt", "halves")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file (or folder)")
    ap.add_argument("--rows", type=int, default=2 * 44_357, help="M: packed gen tokens of a step")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--device", default="cuda")
    return ap.parse_args(argv)


def gemm_cases(m: int, d: int, q: int, kv: int, inter: int) -> dict[str, tuple[int, int, int, bool]]:
    """name -> (M, K, N, residual) of the gen layer's GEMMs."""
    return {
        "qkv": (m, d, q + 2 * kv, False),
        "o": (m, q, d, True),
        "gate_up": (m, d, 2 * inter, False),
        "down": (m, inter, d, True),
    }


@contextlib.contextmanager
def way(name: str):
    """Route the following bf16 GEMMs the way `name` says for the duration."""
    blas = torch.backends.cuda.preferred_blas_library()
    try:
        if name == "cublaslt" and torch.cuda.is_available():  # (off the GPU all ways are the CPU's GEMM)
            torch.backends.cuda.preferred_blas_library("cublaslt")
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(blas)


def event_ms(fn, repeats: int, device: torch.device) -> float:
    """Median ms of `repeats` calls after one warm-up (CUDA events; the host clock off the GPU)."""
    from worldserve.bench.timing import time_once

    fn()
    return statistics.median(time_once(fn, device) * 1e3 for _ in range(repeats))


def run(args: argparse.Namespace, log=print, save=lambda res: None) -> dict:
    from worldserve.bench.report import environment
    from worldserve.models.cosmos3.config import Cosmos3Config

    device = torch.device(args.device)
    cfg = Cosmos3Config.nano()
    res: dict = {"environment": environment(device), "rows": args.rows, "cases": {}}
    for name, (m, k, n, residual) in gemm_cases(
        args.rows, cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    ).items():
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * 0.02
        h = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=g) if residual else None
        acc = None if h is None else h.clone()  # the in-place GEMMs' accumulator (values drift; times do not)

        def gemm(rows: slice = slice(None), x=x, w=w, acc=acc):
            return acc[rows].addmm_(x[rows], w.t()) if acc is not None else torch.mm(x[rows], w.t())

        halves = (slice(0, m // 2), slice(m // 2, None))
        case = {"m": m, "k": k, "n": n, "residual": residual}
        ref = (torch.addmm(h, x, w.t()) if residual else torch.mm(x, w.t())).float()
        for wname in WAYS:
            with way(wname):
                fn = gemm
                if wname == "halves":
                    fn = lambda gemm=gemm, halves=halves: [gemm(r) for r in halves]  # noqa: E731
                ms = event_ms(fn, args.repeats, device)
                out = None
                if wname != "halves":
                    out = torch.addmm(h, x, w.t()) if residual else torch.mm(x, w.t())
            case[wname] = {
                "ms": ms,
                "tflops": 2 * m * k * n / ms / 1e9,
                "step_s": ms * args.layers / 1e3,
                "rel_l2_vs_cublas": None if out is None else float((out.float() - ref).norm() / ref.norm()),
            }
            log(f"{name} {wname}: {ms:.2f} ms, {case[wname]['tflops']:.0f} TF/s")
        if residual:
            case["out_of_place_ms"] = event_ms(
                lambda x=x, w=w, h=h: torch.addmm(h, x, w.t()), args.repeats, device
            )
            log(f"{name} out of place (copy of h first): {case['out_of_place_ms']:.2f} ms")
        res["cases"][name] = case
        save(res)
        del x, w, h, acc, ref
    res["step_s"] = {wn: sum(c[wn]["step_s"] for c in res["cases"].values()) for wn in WAYS}
    return res


def table(res: dict) -> str:
    env = res["environment"]
    lines = [
        f"gen GEMMs at M={res['rows']}, {env.get('gpu')}, torch {env.get('torch')}",
        f"{'gemm':8s} " + " ".join(f"{w:>17s}" for w in WAYS),
    ]
    for name, c in res["cases"].items():
        lines.append(f"{name:8s} " + " ".join(f"{c[w]['ms']:8.2f}ms {c[w]['tflops']:4.0f}TF" for w in WAYS))
    lines.append(f"{'step s':8s} " + " ".join(f"{res['step_s'][w]:17.3f}" for w in WAYS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from worldserve.bench.report import run_script

    return run_script(parse_args(argv), run, table, "gemm-shapes")


if __name__ == "__main__":
    sys.exit(main())

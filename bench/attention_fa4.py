"""FlashAttention-4 (CuTe DSL) tiles vs FlashAttention-3 at the gen tower's attention shape, one GPU.

At the joint shape of one CFG item of a 720p x 189 + audio step (44,357 gen queries over 300 text + 44,357
gen keys, GQA 32 / 8, head dim 128, bf16, random N(0, 1) q / K / V): FA3 (`flash_attention.fa3_forward`,
the product default on Hopper) and FA4 (`worldserve/bench/fa4.py`) with each config of --configs
(or a built-in grid of tiles, P @ V operand sources and GQA packing). For each: the first call's seconds
(FA4 compiles there), the median ms of --repeats back-to-back calls in each of --rounds rounds (the order
of the candidates reversed every other round, so clock drift spreads over all), TFLOP/s (4 N_q N_k H d),
the rel. L2 error against a float32 reference on 512 sampled query rows, and the largest difference of
the output and the LSE against FA3. Failing configs (compile errors, register or shared-memory overflow)
are recorded with the error and skipped. The JSON names the fastest exact FA4 config (`best`).

    PYTHONPATH=. python bench/attention_fa4.py --out $OUT/attention_fa4.json     # H200: ~2-5 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from worldserve.bench.denoise import rel_error
from worldserve.bench.timing import event_ms

GRID = (
    "128x128-rs-ovl-gqaauto",  # FA4's own choice at d = 128
    "128x176-rs-ovl-gqaauto",  # FA3's tile at d = 128 (non-causal)
    "128x160-rs-ovl-gqaauto",
    "128x192-rs-ovl-gqaauto",
    "128x144-rs-ovl-gqaauto",
    "128x176-ss-ovl-gqaauto",
    "128x128-ss-ovl-gqaauto",
    "192x128-ss-ovl-gqaauto",
    "192x112-ss-ovl-gqaauto",
    "128x176-rs-ovl-gqaoff",
    "128x176-rs-ovl-gqaon",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="JSON output path")
    ap.add_argument("--configs", default=",".join(GRID), help="comma-separated Fa4Config specs")
    ap.add_argument("--gen-tokens", type=int, default=44_357)
    ap.add_argument("--text-tokens", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per candidate and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--time-budget", type=float, default=420.0, help="stop compiling new configs after (s)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from bench.attention_backends import reference_rows
    from worldserve.bench import fa4
    from worldserve.bench.report import environment
    from worldserve.models.layers.flash_attention import fa3_forward, fa3_unavailable_reason

    args = parse_args(argv)
    device = torch.device("cuda")
    n, nk = args.gen_tokens, args.gen_tokens + args.text_tokens
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(n, 32, 128, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(nk, 8, 128, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    rows = torch.linspace(0, n - 1, 512, device=device).long()
    ref = reference_rows(q, k, v, rows)
    flops = 4.0 * n * nk * 32 * 128
    res: dict = {"environment": environment(device), "shape": {"q": n, "k": nk, "hq": 32, "hkv": 8, "d": 128},
                 "fa4_unavailable": fa4.fa4_unavailable_reason(device, torch.bfloat16, 128),
                 "fa3_unavailable": fa3_unavailable_reason(device, torch.bfloat16, 128), "candidates": {}}  # fmt: skip
    out = torch.empty_like(q)
    fns, base = {}, None
    if res["fa3_unavailable"] is None:
        fns["fa3"] = lambda: fa3_forward(q, k, v, out=out)
    start = time.perf_counter()
    for spec in [s for s in args.configs.split(",") if s] if res["fa4_unavailable"] is None else []:
        if time.perf_counter() - start > args.time_budget:
            res["candidates"][spec] = {"skipped": "time budget"}
            continue
        cfg = fa4.Fa4Config.parse(spec)

        def call(cfg=cfg):
            fa4.set_fa4_config(cfg)
            return fa4.fa4_forward(q, k, v, out=out)

        t0 = time.perf_counter()
        try:
            call()
            torch.cuda.synchronize()
        except Exception as e:  # compile / launch failure of this tile: record and go on
            res["candidates"][spec] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{spec}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        res["candidates"][spec] = {"first_call_s": time.perf_counter() - t0}
        fns[spec] = call
        print(f"{spec}: first call {time.perf_counter() - t0:.1f} s", flush=True)
    for name, fn in fns.items():  # accuracy (outputs land in `out`: read them right after each call)
        o, lse = (t.clone() for t in fn())
        entry = res["candidates"].setdefault(name, {})
        entry["rel_l2_vs_fp32"] = rel_error(o[rows], ref)
        if base is None:
            base = (o, lse)
        entry["max_abs_out_vs_first"] = (o.float() - base[0].float()).abs().max().item()
        entry["max_abs_lse_vs_first"] = (lse - base[1]).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fns[name]()
            times[name].append(event_ms(fns[name], args.repeats))
    for name, ms in times.items():
        med = statistics.median(ms)
        res["candidates"][name] |= {"ms_rounds": ms, "ms": med, "tflops": flops / med / 1e9}
    exact = {
        name: c for name, c in res["candidates"].items()
        if name != "fa3" and "ms" in c and c["rel_l2_vs_fp32"] < 2 * res["candidates"].get("fa3", c)["rel_l2_vs_fp32"]
    }  # fmt: skip
    res["best"] = min(exact, key=lambda s: exact[s]["ms"]) if exact else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    fa3_ms = res["candidates"].get("fa3", {}).get("ms")
    print(f"{'kernel':28s} {'ms':>7s} {'TF/s':>6s} {'vs FA3':>7s} {'rel L2':>8s} {'first s':>7s}")
    for name, c in res["candidates"].items():
        if "ms" not in c:
            print(f"{name:28s} {c.get('error') or c.get('skipped')}"[:150])
            continue
        ratio = f"{fa3_ms / c['ms']:.3f}x" if fa3_ms else "-"
        print(f"{name:28s} {c['ms']:7.2f} {c['tflops']:6.0f} {ratio:>7s} {c['rel_l2_vs_fp32']:8.1e} "
              f"{c.get('first_call_s', 0):7.1f}")  # fmt: skip
    print(f"best FA4 config: {res['best']}")


if __name__ == "__main__":
    main()

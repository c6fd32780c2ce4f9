"""A LoRA adapter's cost on the denoising step, at full size on one GPU: the same step without and with adapters.

Builds the full-size Cosmos3-Nano transformer with random bf16 weights (worldserve/bench/models.py), compiles
the gen layers (the product default), times the 720p x 189 + audio CFG step (cond + uncond packed, 300-token
prompts; worldserve/bench/denoise.py) with no adapter, then with random PEFT adapters of each `--ranks` on
every module worldserve applies LoRA to (both towers' layer linears, the gen pathway's embeddings and
heads), written to disk in bf16 and read through the served path (weights/lora_adapter.py inspect + load:
the load time is reported). Per rank: seconds a step, the slowdown against no adapter, the adapter's bytes on
the device, the extra FLOPs of its GEMM pairs (2 N r (in + out) a linear) as a share of the step's, and the
rel. L2 distance of the velocities from the base model's (the adapter does change them).

Last, the last rank's adapter merged into the gen pathway's weights (runner/lora_cache.py merge_lora, what serve
does with --lora-path alone): its step, the merge's seconds (in "load s") and the rel. L2 distance of its
velocities from the unmerged adapter's (and how many gen-pathway linears merged whole, with the largest share of a row's delta the rounding
changed: `merge`).

Predicted (before any run): the pairs' FLOPs are ~0.7 % of a step at rank 64; the cost is memory traffic,
each adapted GEMM's output read and written once more by the delta's addmm and its input read once more
by x A^T, ~18 GB a gen layer at 720p with CFG, ~3 % of the step at rank 64 if none of it fuses.

    PYTHONPATH=. python bench/lora_step.py --out $OUT/lora_step.json          # H200: ~3 min
    PYTHONPATH=. python bench/lora_step.py --tiny --device cpu --out /tmp/x   # smoke test
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from worldserve.bench.denoise import rel_error, snapshot

T_REF = 500


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, required=True, help="JSON file (or folder for lora-step-<stamp>.json)"
    )
    ap.add_argument("--size", default="1280x720", help="WIDTHxHEIGHT (default 1280x720)")
    ap.add_argument("--frames", type=int, default=189, help="pixel frames, 4k+1 (default 189)")
    ap.add_argument("--text-tokens", type=int, default=300, help="tokens of each prompt (cond, uncond)")
    ap.add_argument("--ranks", default="16,64", help="adapter ranks to time, comma-separated")
    ap.add_argument(
        "--forms",
        default="",
        help="also time the last rank with its delta added these other "
        f"ways, comma-separated ({', '.join(DELTA_FORMS)}; compiled again for each)",
    )
    ap.add_argument(
        "--delta-std",
        type=float,
        default=0.02,
        help="std of the random adapters' B (A's is 0.2; B A's std is ~0.2 x this x sqrt(rank)): at rank 64, "
        "0.02 gives deltas ~1.5x the base weights' 0.02; 0.0002 ~1 %% of them, a trained adapter's size",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (after 1 warm-up)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true", help="no torch.compile (compiled is the default on CUDA)")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke test)")
    return ap.parse_args(argv)


def _delta_addmm(y, x, pair):
    return torch.addmm(y, F.linear(x, pair[0]), pair[1].t())  # copies y into its result first


def _delta_in_place(y, x, pair):
    return y.addmm_(F.linear(x, pair[0]), pair[1].t())  # y += (x A^T) B^T, no copy of y


DELTA_FORMS = {"add": None, "addmm": _delta_addmm, "addmm_": _delta_in_place}
"""Ways of adding a delta (models/layers/lora.py add_delta; "add": the product's own, set in run)."""


def lora_flops(w, cfg, rank: int) -> float:
    """FLOPs of one step's adapter GEMM pairs: the gen tower's four fused linears a layer over both branches'
    gen tokens (the und tower's run once a request, in the prefill)."""
    d, q, kv, inter = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    per_row = 3 * d + (q + 2 * kv) + 2 * (q + d) + (d + 2 * inter) + (inter + d)  # sum of (in + out) x parts
    return 2.0 * 2 * w.gen_tokens * rank * per_row * cfg.num_hidden_layers  # x2: cond and uncond


def run(args: argparse.Namespace, log=print, save=lambda res: None) -> dict:
    """No adapter, then each rank; `save(res)` after each variant, so a run cut short keeps what it measured."""
    import worldserve.models.layers.lora as lora_layers
    from worldserve.bench.clocks import ClockLog
    from worldserve.bench.denoise import OurStep, make_inputs
    from worldserve.bench.flops import TowerShape, tflops
    from worldserve.bench.models import build_our_transformer
    from worldserve.bench.report import environment
    from worldserve.bench.timing import peak_gib, reset_peak, time_region
    from worldserve.bench.workload import Workload
    from worldserve.models.cosmos3.config import Cosmos3Config
    from worldserve.params import LoraRequest
    from worldserve.runner.kernel_options import KernelOptions
    from worldserve.runner.lora_cache import merge_lora
    from worldserve.weights.lora_adapter import inspect_adapter, load_adapter, write_random_adapter

    device = torch.device(args.device)
    width, height = (int(v) for v in args.size.lower().split("x"))
    w = Workload(width=width, height=height, num_frames=args.frames, sound=True, cond_text=args.text_tokens,
                 uncond_text=args.text_tokens)  # fmt: skip
    cfg = Cosmos3Config.tiny() if args.tiny else Cosmos3Config.nano()
    shape = TowerShape.from_config(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compiled = device.type == "cuda" and not args.eager
    res: dict = {"environment": environment(device), "workload": w.label, "gen_tokens": w.gen_tokens,
                 "step_flops": w.step_flops(shape), "compiled": compiled,
                 "args": {k: v for k, v in vars(args).items() if k != "out"}, "variants": {}}  # fmt: skip
    t0 = time.perf_counter()
    model = build_our_transformer(cfg, device, dtype, None, args.seed)
    res["kernels"] = KernelOptions(compile=compiled).apply(model)  # as serve: the attention kernel, compiled
    step = OurStep(model, w, make_inputs(w, cfg.vocab_size, device, args.seed))
    # the board's clock and power beside each variant: under the 700 W cap larger weights (a merged random
    # adapter's) may draw more power a FLOP and so run at a lower clock (bench/clocks.py)
    clocks = ClockLog().start() if device.type == "cuda" else ClockLog()
    try:

        def variant(name: str, rank: int = 0, extra: dict | None = None) -> None:
            step.prefill()
            reset_peak(device)
            with clocks.phase(name):
                timing = time_region(lambda: step(T_REF), device, warmup=1, repeats=args.steps)
            out = snapshot(step, T_REF)
            board = clocks.summary().get(name) or {}
            row = {"step_s": timing.median, "tflops": tflops(res["step_flops"], timing.median), "peak_gib": peak_gib(device),
                   "lora_flops_share": lora_flops(w, cfg, rank) / res["step_flops"] if rank else 0.0,
                   "sm_mhz": board.get("sm_mhz"), "power_w": board.get("power_w"), **(extra or {})}  # fmt: skip
            if "base" in res["variants"]:
                row["slowdown"] = timing.median / res["variants"]["base"]["step_s"]
                row["rel_l2_vs_base"] = rel_error(out["video"], base_out["video"])
            res["variants"][name] = row
            log(f"{name}: {timing.median:.3f} s a step")
            save(res)
            return out

        product_form = lora_layers.add_delta
        step.lora = None
        base_out = variant("base")
        with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
            for rank in (int(r) for r in args.ranks.split(",")):
                folder = write_random_adapter(Path(tmp) / f"r{rank}", cfg, rank=rank, alpha=rank, seed=rank,
                                              std=args.delta_std, dtype=torch.bfloat16)  # fmt: skip
                t1 = time.perf_counter()
                spec = inspect_adapter(folder, cfg)
                step.lora = load_adapter(
                    spec, 1.0, cfg, dtype=dtype, device=device
                ).mark_ranks_dynamic()  # (as served)
                load_s = time.perf_counter() - t1
                unmerged = variant(
                    f"rank {rank}", rank, {"load_s": load_s, "adapter_gib": step.lora.nbytes / 2**30}
                )
            for form in filter(
                None, args.forms.split(",")
            ):  # the last rank's adapter, its delta added otherwise
                lora_layers.add_delta = DELTA_FORMS[form] or product_form
                torch._dynamo.reset()  # (the compiled layers trace the new form)
                variant(f"rank {rank} {form}", rank)
            lora_layers.add_delta, step.lora = product_form, None
            torch._dynamo.reset()
            # the last rank's adapter merged into the gen pathway's weights, as serve does with a static one: the
            # base step's kernels again; its velocities against the unmerged adapter's (bf16 rounding of W + BA)
            t1 = time.perf_counter()
            merged, total, worst = merge_lora(model, LoraRequest("bench", folder, 1.0), device)
            merge_s = time.perf_counter() - t1
            res["merge"] = {"linears_merged_whole": merged, "linears": total, "largest_erasure": worst}
            if model.merged_lora is not None:
                step.lora = model.merged_lora.rest  # (the und deltas: the prefill applies them)
                out = variant(f"rank {rank} merged", 0, {"load_s": merge_s})
                res["variants"][f"rank {rank} merged"]["rel_l2_vs_unmerged"] = rel_error(
                    out["video"], unmerged["video"]
                )
            save(res)
    finally:
        clocks.stop()
    res["wall_s"] = time.perf_counter() - t0
    return res


def table(res: dict) -> str:
    lines = [
        f"LoRA step: {res['workload']}, {res['gen_tokens']} gen tokens, {res['step_flops'] / 1e15:.2f} PF a step, "
        f"{res['environment'].get('gpu', res['environment']['device'])}, kernels {res['kernels']}",
        "",
        f"{'variant':15s} {'s/step':>8s} {'TF/s':>7s} {'slowdown':>8s} {'LoRA FLOPs':>10s} {'GiB':>6s} "
        f"{'load s':>6s} {'vs base':>8s} {'vs unmerged':>11s} {'SM MHz':>6s} {'W':>5s}",
    ]
    for name, r in res["variants"].items():
        mhz, watts = r.get("sm_mhz"), r.get("power_w")
        lines.append(
            f"{name:15s} {r['step_s']:8.3f} {r['tflops']:7.1f} {r.get('slowdown', 1.0):7.3f}x "
            f"{100 * r['lora_flops_share']:9.2f}% {r.get('adapter_gib', 0.0):6.2f} {r.get('load_s', 0.0):6.1f} "
            f"{r.get('rel_l2_vs_base', 0.0):8.4f} {r.get('rel_l2_vs_unmerged', 0.0):11.5f} "
            f"{'-' if mhz is None else f'{mhz:.0f}':>6s} {'-' if watts is None else f'{watts:.0f}':>5s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from worldserve.bench.report import run_script

    return run_script(parse_args(argv), run, table, "lora-step")


if __name__ == "__main__":
    sys.exit(main())

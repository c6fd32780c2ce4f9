"""`--enable-layerwise-offload` against the resident model on one GPU: step time, GPU memory, equality.

Builds the full-size Cosmos3-Nano transformer with random bf16 weights on the GPU (worldserve/bench/models.py),
compiles the gen layers as the product does, and for each --points entry (CFG-batched step with audio,
worldserve/bench/denoise.py) times the denoising step and records its peak GPU memory. Then it moves the
layers to the CPU, turns on layerwise offload (models/layers/offload.py: pinned host blocks, two device
slots per tower, copies on a side stream) and repeats every point: step time, peak memory, and whether the
velocities are bitwise equal to the resident ones. It also times one und pass over a single token (the
Reasoner's decode step: all 36 und blocks, pure weight streaming when offloaded), the pinned host->device
copy bandwidth, and, with --memory-cap-gib, reruns the first point with the process capped to that much
GPU memory (torch.cuda.set_per_process_memory_fraction): does the step fit a card of that size?
Writes JSON to --out (a .json file or a folder) and prints a short table last.

    PYTHONPATH=. python bench/layerwise_offload.py --out $OUT --memory-cap-gib 32      # H200: ~4 min
    PYTHONPATH=. python bench/layerwise_offload.py --tiny --device cpu --out /tmp/x     # smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

T_REF = 500


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file (or folder for offload-<stamp>.json)")
    ap.add_argument("--points", default="1280x720x189,832x480x121", help="WxHxFRAMES, comma separated")
    ap.add_argument("--text-tokens", type=int, default=300, help="tokens of each prompt (cond, uncond)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per point (after 1 warm-up)")
    ap.add_argument(
        "--memory-cap-gib", type=float, default=None, help="rerun point 1 offloaded under this cap"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true", help="no torch.compile (compiled is the default on CUDA)")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke test)")
    return ap.parse_args(argv)


def measure_points(model, points, inputs, device, args, log) -> list[dict]:
    from worldserve.bench.denoise import OurStep, snapshot
    from worldserve.bench.flops import tflops
    from worldserve.bench.timing import peak_gib, reset_peak, time_region

    out = []
    for w in points:
        step = OurStep(model, w, inputs[w.label])
        reset_peak(device)
        step.prefill()
        log(f"{w.label}: warm-up, then {args.steps} timed steps")
        t = time_region(lambda step=step: step(999), device, warmup=1, repeats=args.steps)
        out.append({"point": w.label, **t.to_dict(), "step_s": t.median,
                    "tflops": tflops(w.step_flops(args.shape), t.median), "peak_gib": peak_gib(device),
                    "velocity": snapshot(step, T_REF)})  # fmt: skip
        del step
    return out


def copy_bandwidth(model, device) -> float | None:
    """GB/s of one pinned gen block host->device copy (what the streamer issues per layer)."""
    blocks = model.gen_blocks
    if blocks is None or device.type != "cuda":
        return None
    host, dst = blocks.host[0], torch.empty_like(blocks.host[0], device=device)
    from worldserve.bench.timing import time_region

    t = time_region(lambda: dst.copy_(host, non_blocking=True), device, warmup=2, repeats=5).median
    return blocks.block_bytes / t / 1e9


def run(args: argparse.Namespace, log=print, save=lambda res: None) -> dict:
    from worldserve.bench.denoise import make_inputs, rel_error
    from worldserve.bench.flops import TowerShape
    from worldserve.bench.models import build_our_transformer
    from worldserve.bench.report import environment
    from worldserve.bench.timing import allocated_gib, free_memory
    from worldserve.bench.und_decode import make_decoder, und_decode_seconds
    from worldserve.bench.workload import parse_point
    from worldserve.models.cosmos3.config import Cosmos3Config

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = Cosmos3Config.tiny() if args.tiny else Cosmos3Config.nano()
    args.shape = TowerShape.from_config(cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kw = {"cond_text": args.text_tokens, "uncond_text": args.text_tokens}
    points = [parse_point(p, **kw) for p in args.points.split(",")]
    inputs = {w.label: make_inputs(w, cfg.vocab_size, device, args.seed) for w in points}
    res: dict = {"environment": environment(device), "points": [w.label for w in points],
                 "args": {k: v for k, v in vars(args).items() if k not in ("out", "shape")}}  # fmt: skip
    t0 = time.perf_counter()
    model = build_our_transformer(cfg, device, dtype, None, args.seed)
    model.set_attention_backend(None)
    if device.type == "cuda" and not args.eager:
        model.compile_gen_layers()
    res["resident"] = {"weights_gib": allocated_gib(device)}
    res["resident"]["points"] = measure_points(model, points, inputs, device, args, log)
    res["resident"]["und_token_s"] = und_decode_seconds(
        model, device, make_decoder(model, max_batch=1, tokens=0)
    )
    save(res)

    log("moving the layers to host memory and turning layerwise offload on")
    t1 = time.perf_counter()
    for layer in model.layers:
        layer.to("cpu")
    free_memory(device)
    model.enable_layerwise_offload(device)
    free_memory(device)
    res["offload"] = {"setup_s": time.perf_counter() - t1, "weights_gib": allocated_gib(device),
                      "block_mib": model.gen_blocks.block_bytes / 2**20,
                      "host_gib": (model.gen_blocks.host_bytes + model.und_blocks.host_bytes) / 2**30,
                      "copy_gb_s": copy_bandwidth(model, device)}  # fmt: skip
    res["offload"]["points"] = measure_points(model, points, inputs, device, args, log)
    res["offload"]["und_token_s"] = und_decode_seconds(
        model, device, make_decoder(model, max_batch=1, tokens=0)
    )
    for r, o in zip(res["resident"]["points"], res["offload"]["points"], strict=True):
        o["bitwise_equal"] = all(
            torch.equal(r["velocity"][k], o["velocity"][k])
            for k in r["velocity"]
            if r["velocity"][k] is not None
        )
        o["rel_error"] = rel_error(o["velocity"]["video"], r["velocity"]["video"])
        o["slowdown"] = o["step_s"] / r["step_s"]
    save(res)

    if args.memory_cap_gib and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(args.memory_cap_gib * 2**30 / total, device)
        free_memory(device)
        log(f"capped at {args.memory_cap_gib} GiB: {points[0].label} offloaded")
        try:
            capped = measure_points(model, points[:1], inputs, device, args, log)[0]
            res["capped"] = {"cap_gib": args.memory_cap_gib, "fits": True, "step_s": capped["step_s"],
                             "peak_gib": capped["peak_gib"]}  # fmt: skip
        except torch.OutOfMemoryError as e:
            res["capped"] = {"cap_gib": args.memory_cap_gib, "fits": False, "error": str(e)[:300]}
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    for phase in ("resident", "offload"):
        for p in res[phase]["points"]:
            p.pop("velocity")
    res["wall_s"] = time.perf_counter() - t0
    return res


def table(res: dict) -> str:
    env, off = res["environment"], res["offload"]
    lines = [
        f"layerwise offload: {env.get('gpu', env['device'])}; blocks {off['block_mib']:.0f} MiB each, "
        f"{off['host_gib']:.1f} GiB pinned on the host, copy {off['copy_gb_s'] or float('nan'):.1f} GB/s",
        f"weights on the GPU: resident {res['resident']['weights_gib']:.2f} GiB -> offloaded "
        f"{off['weights_gib']:.2f} GiB",
        "",
        f"{'point':26s} {'resident s':>10s} {'offload s':>9s} {'slowdown':>8s} {'peak res':>8s} "
        f"{'peak off':>8s} {'bitwise':>7s}",
    ]
    for r, o in zip(res["resident"]["points"], off["points"], strict=True):
        lines.append(
            f"{r['point']:26s} {r['step_s']:10.3f} {o['step_s']:9.3f} {o['slowdown']:7.3f}x "
            f"{r['peak_gib']:8.2f} {o['peak_gib']:8.2f} {str(o['bitwise_equal']):>7s}"
        )
    lines.append(
        f"{'und pass, 1 token':26s} {res['resident']['und_token_s']:10.4f} {off['und_token_s']:9.4f} "
        f"{off['und_token_s'] / res['resident']['und_token_s']:7.1f}x"
    )
    if "capped" in res:
        c = res["capped"]
        verdict = f"fits: {c['step_s']:.3f} s a step, peak {c['peak_gib']:.2f} GiB" if c["fits"] else "OOM"
        lines.append(f"capped at {c['cap_gib']} GiB, {res['points'][0]} offloaded: {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from worldserve.bench.report import run_script

    return run_script(parse_args(argv), run, table, "offload")


if __name__ == "__main__":
    sys.exit(main())

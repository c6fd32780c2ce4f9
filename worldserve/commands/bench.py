"""`worldserve bench`: time the Cosmos3-Nano denoising step (ours vs diffusers' transformer, same random
weights and inputs), the Wan2.2 VAE and audio decoders and the MP4 mux on one GPU, and estimate a request.

Needs a CUDA GPU for meaningful numbers (`--tiny --device cpu` smoke-tests the harness). Writes
`bench-<stamp>.json` / `.md` and profiler tables to `--out-dir` and prints the summary table last.
Implementation: `worldserve/bench/`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_POINTS = "1280x720x189,832x480x121"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--points",
        default=DEFAULT_POINTS,
        help=f"comma-separated WIDTHxHEIGHTxFRAMES; the first also gets profile/decode/variants "
        f"(default {DEFAULT_POINTS})",
    )
    p.add_argument("--steps", type=int, default=3, help="timed denoising steps per point and implementation")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up steps (reported)")
    p.add_argument("--text-tokens", type=int, default=300, help="prompt (und) tokens of the cond branch")
    p.add_argument("--neg-text-tokens", type=int, default=300, help="prompt tokens of the uncond branch")
    p.add_argument("--fps", type=float, default=24.0, help="frame rate of every point")
    p.add_argument("--no-sound", action="store_true", help="video only (no audio tokens, no audio decode)")
    p.add_argument(
        "--phases",
        default="transformer,profile,decode,variants",
        help="subset of transformer,profile,decode,variants",
    )
    p.add_argument("--skip-diffusers", action="store_true", help="time only our transformer")
    p.add_argument(
        "--no-diffusers-cudnn",
        action="store_true",
        help="skip the second diffusers timing with our SDPA backend priority (cuDNN first)",
    )
    p.add_argument(
        "--attention-backend",
        default=None,
        choices=("FLASH_ATTN", "TORCH_SDPA", "CUDNN_ATTN"),
        help="our attention kernel (default: auto, FA3 where it runs, as serve / generate)",
    )
    p.add_argument("--e2e-steps", type=int, default=35, help="steps of the end-to-end estimate")
    p.add_argument(
        "--time-budget",
        type=float,
        default=540.0,
        help="seconds; the torch.compile variant is skipped when it would not fit",
    )
    p.add_argument("--out-dir", type=Path, default=Path("bench/results"), help="results folder")
    p.add_argument("--device", default="cuda", help="torch device (cuda for real numbers)")
    p.add_argument("--tiny", action="store_true", help="tiny model/VAE configs: a smoke run of the harness")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import torch

    from worldserve.bench.runner import PHASES, Bench, BenchOptions
    from worldserve.bench.workload import parse_point

    phases = frozenset(x.strip() for x in args.phases.split(",") if x.strip())
    if bad := phases - set(PHASES):
        raise SystemExit(f"--phases: unknown {sorted(bad)}; choose from {','.join(PHASES)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("worldserve bench needs a CUDA GPU (or --device cpu --tiny for a smoke run)")
    if not args.tiny and not args.device.startswith("cuda"):
        raise SystemExit("full-size models on the CPU would take hours; use --tiny with --device cpu")
    points = tuple(
        parse_point(
            s,
            fps=args.fps,
            sound=not args.no_sound,
            cond_text=args.text_tokens,
            uncond_text=args.neg_text_tokens,
        )
        for s in args.points.split(",")
        if s.strip()
    )
    opts = BenchOptions(
        points=points,
        steps=args.steps,
        warmup=args.warmup,
        phases=phases,
        diffusers=not args.skip_diffusers,
        tiny=args.tiny,
        device=args.device,
        out_dir=args.out_dir,
        seed=args.seed,
        time_budget_s=args.time_budget,
        e2e_steps=args.e2e_steps,
        diffusers_cudnn=not args.no_diffusers_cudnn,
        attention_backend=args.attention_backend,
    )

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    text = Bench(opts, log=log).run()
    print(text, flush=True)
    return 0

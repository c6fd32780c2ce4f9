"""`worldserve bench`: time the Cosmos3-Nano denoising step (ours vs diffusers' transformer, same random
weights and inputs), the Wan2.2 VAE and audio decoders and the MP4 mux on one GPU, and estimate a request.

Needs a CUDA GPU for meaningful numbers (`--tiny --device cpu` smoke-tests the harness). Writes
`bench-<stamp>.json` / `.md` and profiler tables to `--out-dir` and prints the summary table last.
Implementation: `worldserve/bench/`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from worldserve.config_values import int64_seed
from worldserve.params import MAX_FPS

if TYPE_CHECKING:
    import torch

    from worldserve.bench.runner import BenchOptions
    from worldserve.bench.workload import Workload

DEFAULT_POINTS = "1280x720x189,832x480x121"
TINY_POINTS = "64x48x9"
"""--tiny's points when --points is not given: a smoke run of every phase in seconds on a CPU (the full-size
points took the tiny model's CPU decode past ten minutes)."""
MAX_TEXT_TOKENS = 131072
"""--text-tokens / --neg-text-tokens at most: the largest max_sequence_length a request may set."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--points",
        default=None,
        help=f"comma-separated WIDTHxHEIGHTxFRAMES; the first also gets profile/decode/variants "
        f"(default {DEFAULT_POINTS}; with --tiny {TINY_POINTS})",
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
        help="our attention kernel (default: auto as serve / generate: FA3, the gen tower FA4's cluster kernel where it runs)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="time our gen layers eagerly (as serve --enforce-eager); by default they are torch.compile'd as "
        "serve runs them, and the variants phase times the eager step beside",
    )
    p.add_argument("--e2e-steps", type=int, default=35, help="steps of the end-to-end estimate")
    p.add_argument(
        "--time-budget",
        type=float,
        default=540.0,
        help="seconds; under --enforce-eager the compiled variant is skipped when it would not fit",
    )
    p.add_argument(
        "--out-dir", type=Path, default=Path("bench/results"),
        help="results folder (default bench/results, under the current folder)",
    )  # fmt: skip
    p.add_argument("--device", default="cuda", help="torch device (cuda for real numbers)")
    p.add_argument("--tiny", action="store_true", help="tiny model/VAE configs: a smoke run of the harness")
    p.add_argument(
        "--seed", type=int64_seed, default=0, help="seed of the random weights and inputs (default 0)"
    )


def run(args: argparse.Namespace) -> int:
    from worldserve.bench.runner import Bench
    from worldserve.params import ParamError

    try:
        opts = options(args)
    except ParamError as e:  # argparse's style: one line, exit 2, before any model is built
        print(f"worldserve bench: error: {e.message}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    text = Bench(opts, log=log).run()
    print(text, flush=True)
    return 0


def options(args: argparse.Namespace) -> BenchOptions:
    """The BenchOptions of `args`; ParamError (its message naming the flag) for any value the run would trip on
    later (each was a traceback, some after minutes of timing, or a report of NaNs)."""
    from worldserve.bench.runner import BenchOptions

    # checked in this order: with several bad flags, the first one here is the one reported
    phases = _parse_phases(args.phases)
    _check_counts(args)
    device = _check_device(args.device, args.tiny)
    if args.attention_backend == "FLASH_ATTN":
        _check_fa3(device, args.tiny)
    _check_pyav(phases)
    points = _parse_points(args)
    _make_out_dir(args.out_dir)
    return BenchOptions(
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
        compile=not args.enforce_eager,
    )


def _parse_phases(value: str) -> frozenset[str]:
    """--phases as a set of known phase names (at least one)."""
    from worldserve.bench.runner import PHASES
    from worldserve.params import ParamError

    phases = frozenset(x.strip() for x in value.split(",") if x.strip())
    if bad := phases - set(PHASES):
        raise ParamError("phases", f"--phases: unknown {sorted(bad)}; choose from {','.join(PHASES)}")
    if not phases:
        raise ParamError("phases", f"--phases names no phase; choose from {','.join(PHASES)}")
    return phases


def _check_counts(args: argparse.Namespace) -> None:
    """The step and token counts, --fps and --time-budget within the ranges the run can use."""
    from worldserve.params import ParamError

    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                               ("--e2e-steps", args.e2e_steps, 1), ("--text-tokens", args.text_tokens, 1),
                               ("--neg-text-tokens", args.neg_text_tokens, 1)):  # fmt: skip
        if value < least:
            raise ParamError(flag, f"{flag} must be >= {least}, got {value}")
    for flag, value in (("--text-tokens", args.text_tokens), ("--neg-text-tokens", args.neg_text_tokens)):
        if value > MAX_TEXT_TOKENS:  # (99999999 ran the machine out of memory building the prompt)
            raise ParamError(flag, f"{flag} must be <= {MAX_TEXT_TOKENS}, got {value}")
    if not 1 <= args.fps <= MAX_FPS:  # (a request's range; the audio length divides by it)
        raise ParamError("fps", f"--fps must be in [1, {MAX_FPS}], got {args.fps}")
    if not args.time_budget > 0:
        raise ParamError("time_budget", f"--time-budget must be > 0 seconds, got {args.time_budget}")


def _check_device(name: str, tiny: bool) -> torch.device:
    """--device as a torch.device that exists here and can run the models (full size: a CUDA GPU only)."""
    import torch

    from worldserve.params import ParamError
    from worldserve.runner.devices import check_device

    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ParamError("device", f"--device {name}: worldserve bench needs a CUDA GPU (or --device "
                         "cpu --tiny for a smoke run)")  # fmt: skip
    try:
        check_device(name)
    except ValueError as e:
        raise ParamError("device", str(e)) from None
    device = torch.device(name)
    if not tiny and device.type != "cuda":
        raise ParamError("device", f"--device {name}: full-size models on the CPU would take hours; "
                         "use --tiny with --device cpu")  # fmt: skip
    return device


def _check_pyav(phases: frozenset[str]) -> None:
    """PyAV importable where the decode phase runs."""
    from worldserve.params import ParamError

    if "decode" in phases and importlib.util.find_spec("av") is None:
        # (the decode phase muxes the clip it decoded: without PyAV it failed after the transformer phase's minutes)
        raise ParamError("phases", "--phases decode muxes an MP4 and needs PyAV (pip install av); "
                         "leave decode out of --phases to run without it")  # fmt: skip


def _parse_points(args: argparse.Namespace) -> tuple[Workload, ...]:
    """--points (or the default points, --tiny's without it) as Workloads with the run's fps, sound and
    prompt lengths; at least one."""
    from worldserve.bench.workload import parse_point
    from worldserve.params import ParamError

    try:
        points = tuple(
            parse_point(s, fps=args.fps, sound=not args.no_sound, cond_text=args.text_tokens,
                        uncond_text=args.neg_text_tokens)
            for s in (args.points or (TINY_POINTS if args.tiny else DEFAULT_POINTS)).split(",")
            if s.strip()
        )  # fmt: skip
    except ValueError as e:
        raise ParamError("points", f"--points: {e}") from None
    if not points:
        raise ParamError("points", "--points names no WIDTHxHEIGHTxFRAMES point")
    return points


def _make_out_dir(out_dir: Path) -> None:
    """--out-dir writable, and made now."""
    from worldserve.commands.cli_inputs import check_writable
    from worldserve.params import ParamError

    check_writable(out_dir, "out_dir", "--out-dir", folder=True)
    try:  # made now: a folder that cannot be (under /proc, a full disk) failed with a traceback after the run
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ParamError("out_dir", f"--out-dir {out_dir}: cannot create it ({e.strerror or e})") from None


def _check_fa3(device: torch.device, tiny: bool) -> None:
    """--attention-backend FLASH_ATTN where FlashAttention-3 cannot run: why, before the models are built."""
    import torch

    from worldserve.models.cosmos3.config import Cosmos3Config
    from worldserve.models.layers.flash_attention import fa3_unavailable_reason
    from worldserve.params import ParamError

    config = Cosmos3Config.tiny() if tiny else Cosmos3Config.nano()
    if reason := fa3_unavailable_reason(device, torch.bfloat16, config.head_dim):
        raise ParamError("attention_backend", f"--attention-backend FLASH_ATTN: {reason}")

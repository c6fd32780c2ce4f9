"""One CFG denoising step on one GPU (cond + uncond packed in one forward) against a multi-GPU mode, same
checkpoint, params and seed: `--cfg-parallel-size 2` (cond on cuda:0, uncond on cuda:1; the default),
`--cfg-parallel-size 1 --ulysses-degree N` (Ulysses over cuda:0..N-1), both (2 x N GPUs), or
`--cfg-parallel-size 1 --tensor-parallel-size N`.

Loads VideoPipeline on cuda:0, prepares one request (default 1280x720 x 189 frames + audio, guidance 6),
runs --warmup steps (torch.compile on the first), times --steps steps (s/step, median), keeps the latents;
frees it, then does the same through ParallelPipeline (for each of --modes, against the one baseline).
Prints both, the speedup, and the rel. L2 of the final video / sound latents (bf16 batched-vs-split rounding only; ~1e-3 expected). Writes JSON to --out.
Weights: --model (a real-layout checkpoint on local disk), --random-nano DIR (writes, once, a checkpoint with
the Nano transformer config (15.2B params, ~30 GB bf16), the real-size Wan2.2 VAE and AVAE, random weights,
the tiny byte tokenizer; the GPU hosts have no network), or --tiny for a CPU smoke run.

    PYTHONPATH=. python bench/parallel_step.py --random-nano /tmp/nano-random --write-only --out x  # once (not timed yet)
    PYTHONPATH=. python bench/parallel_step.py --random-nano /tmp/nano-random --out $OUT/cfg_step.json
    PYTHONPATH=. python bench/parallel_step.py --random-nano /tmp/nano-random --cfg-parallel-size 1 --ulysses-degree 2 --out $OUT/usp2.json
    PYTHONPATH=. python bench/parallel_step.py --random-nano /tmp/nano-random --modes cfg2,usp2,tp2 --out $OUT/modes.json
    PYTHONPATH=. python bench/parallel_step.py --model /path/to/Cosmos3-Nano --out $OUT/cfg_step.json
    PYTHONPATH=. python bench/parallel_step.py --tiny --device cpu --size 80x48 --frames 9 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (or a cached HF repo id)")
    ap.add_argument(
        "--tiny", action="store_true", help="write and use the tiny random checkpoint (smoke test)"
    )
    ap.add_argument(
        "--random-nano", type=Path, default=None, help="write (once) and use a random Nano checkpoint"
    )
    ap.add_argument(
        "--write-only", action="store_true", help="with --random-nano: write the checkpoint, exit"
    )
    ap.add_argument("--out", type=Path, required=True, help="JSON file")
    ap.add_argument("--size", default="1280x720", help="WIDTHxHEIGHT (default 1280x720)")
    ap.add_argument("--frames", type=int, default=189, help="pixel frames, 4k+1 (default 189)")
    ap.add_argument("--no-sound", action="store_true")
    ap.add_argument("--guidance", type=float, default=6.0)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--device", default="cuda", help="cuda (cuda:0 + cuda:1) or cpu (gloo smoke test)")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"))
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    ap.add_argument("--cfg-parallel-size", type=int, default=2, choices=(1, 2), help="CFG branch groups")
    ap.add_argument("--ulysses-degree", type=int, default=1, help="ranks per branch group (Ulysses)")
    ap.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="tensor-parallel ranks (with cfg 1 only)"
    )
    ap.add_argument(
        "--modes", default=None,
        help="several modes against one single-GPU baseline, e.g. cfg2,usp2,tp2,cfg2xusp2 (overrides the "
        "three flags above)",
    )  # fmt: skip
    return ap.parse_args(argv)


def parse_mode(spec: str) -> dict[str, int]:
    """'cfg2xusp2' -> {'cfg_parallel_size': 2, 'ulysses_degree': 2, 'tensor_parallel_size': 1}."""
    names = {"cfg": "cfg_parallel_size", "usp": "ulysses_degree", "tp": "tensor_parallel_size"}
    mode = dict.fromkeys(names.values(), 1)
    for part in spec.lower().split("x"):
        key = part.rstrip("0123456789")
        if key not in names or key == part:
            raise SystemExit(f"--modes entry {spec!r}: use cfgN, uspN, tpN joined by 'x'")
        mode[names[key]] = int(part[len(key) :])
    if mode["cfg_parallel_size"] * mode["ulysses_degree"] * mode["tensor_parallel_size"] < 2:
        raise SystemExit(f"--modes entry {spec!r} runs on one GPU: nothing to compare")
    return mode


def mode_label(mode: dict[str, int]) -> str:
    return f"cfg{mode['cfg_parallel_size']}_ulysses{mode['ulysses_degree']}_tp{mode['tensor_parallel_size']}"


def reasoner_bench_parser(doc: str) -> argparse.ArgumentParser:
    """The Reasoner benches' common flags: --out, and --random-nano DIR or --tiny (reasoner_setup)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--random-nano", type=Path, help="write / reuse a random full-size Nano checkpoint here")
    src.add_argument("--tiny", action="store_true", help="the tiny checkpoint, float32 on the CPU")
    return ap


def reasoner_bench_main(args: argparse.Namespace, run, table) -> int:
    """The Reasoner benches' main: results = run(args), written as JSON to --out, table(results) printed."""
    import json

    args.out.parent.mkdir(parents=True, exist_ok=True)
    res = run(args)
    args.out.write_text(json.dumps(res, indent=2))
    print(table(res))
    return 0


def reasoner_setup(tiny: bool, random_nano: Path | None) -> tuple:
    """(checkpoint folder, device, dtype, sync, what keeps the folder alive) of the Reasoner benches: the tiny
    checkpoint in a temporary folder (removed when the last item is dropped), float32 on the CPU, or the random
    full-size Nano written to `random_nano`, bf16 on the GPU."""
    import torch

    scratch = None
    if tiny:
        from worldserve.weights.tiny import make_tiny

        scratch = tempfile.TemporaryDirectory()
        root = make_tiny(Path(scratch.name) / "Cosmos3-Tiny", seed=0)
    else:
        root = write_random_checkpoint(random_nano)
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return root, device, dtype, sync, scratch


def write_random_checkpoint(out: Path, shapes: str = "nano", seed: int = 0) -> Path:
    """`make_tiny(out, shapes=shapes)`: the checkpoint layout at full size ("nano", ViT included) with random
    weights and the tiny byte tokenizer. Reused when `out/.complete` names the same shapes and seed (a folder
    written otherwise, or before the ViT was part of it, is removed and written again)."""
    import shutil

    from worldserve.weights.tiny import make_tiny

    marker = f"{shapes} seed {seed} with vision_encoder\n"
    if (out / ".complete").is_file() and (out / ".complete").read_text() == marker:
        return out
    shutil.rmtree(out, ignore_errors=True)  # no stale shards of another size beside the new index
    t0 = time.perf_counter()
    make_tiny(out, seed=seed, shapes=shapes)
    (out / ".complete").write_text(marker)
    print(f"wrote random {shapes} checkpoint to {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def run_steps(pipe, params, warmup: int, steps: int) -> dict:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(0)  # this mode's peak, not the run's
    state = pipe.prepare("bench", params)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        pipe.denoise([state])  # synchronizes rank 0's device before returning
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    out = {
        "s_per_step": statistics.median(times),
        "step_times": times,
        "latents": state.latents.float().cpu(),
        "sound": None if state.sound is None else state.sound.float().cpu(),
        "peak_mem_gib_rank0": torch.cuda.max_memory_allocated(0) / 2**30
        if torch.cuda.is_available()
        else 0.0,
    }
    pipe.release(state)
    return out


def main(argv: list[str] | None = None) -> int:
    from worldserve.bench.denoise import rel_error
    from worldserve.params import VideoParams
    from worldserve.runner.kernel_options import KernelOptions
    from worldserve.runner.video_pipeline import load_pipeline
    from worldserve.weights.checkpoint import resolve_model

    args = parse_args(argv)
    if args.tiny:
        from worldserve.weights.tiny import make_tiny

        root = make_tiny(Path(tempfile.mkdtemp()) / "Cosmos3-Tiny", seed=0)
    elif args.random_nano is not None:
        root = write_random_checkpoint(args.random_nano)
        if args.write_only:
            return 0
    elif args.model:
        root = resolve_model(args.model, None)
    else:
        print("give --model PATH, --random-nano DIR or --tiny", file=sys.stderr)
        return 2
    width, height = (int(v) for v in args.size.lower().split("x"))
    steps_total = args.warmup + args.steps
    params = VideoParams(
        prompt="A red fox runs through a snowy forest at dawn, cinematic lighting.",
        width=width, height=height, num_frames=args.frames, num_inference_steps=max(steps_total, 2),
        guidance_scale=args.guidance, seed=0, generate_sound=False if args.no_sound else None,
    )  # fmt: skip
    dtype = getattr(torch, args.dtype) if args.dtype else None
    kw = dict(dtype=dtype, kernels=KernelOptions(compile=not args.eager), progress=False)
    device = "cpu" if args.device == "cpu" else "cuda"
    if args.modes:
        modes = [parse_mode(m) for m in args.modes.split(",")]
    else:
        modes = [{"cfg_parallel_size": args.cfg_parallel_size, "ulysses_degree": args.ulysses_degree,
                  "tensor_parallel_size": args.tensor_parallel_size}]  # fmt: skip
        if math.prod(modes[0].values()) < 2:
            raise SystemExit(
                "nothing to compare: give --cfg-parallel-size 2, --ulysses-degree > 1 or -tp > 1"
            )
    runs = {"single": {}} | {mode_label(m): m for m in modes}
    report = {
        "model": str(root), "size": args.size, "frames": args.frames, "sound": not args.no_sound,
        "guidance": args.guidance, "steps_timed": args.steps, "device": args.device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__, "modes": {},
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    one = None
    for name, parallel in runs.items():
        dev = device if parallel else ("cpu" if device == "cpu" else "cuda:0")
        t0 = time.perf_counter()
        pipe = result = None
        try:
            pipe = load_pipeline(root, device=dev, **parallel, **kw)
            load_s = time.perf_counter() - t0
            pipe.validate(params)
            result = run_steps(pipe, params, args.warmup, args.steps) | {"load_s": load_s}
        except Exception as e:  # one broken mode must not hide the others' numbers
            report["modes"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"{name}: FAILED {type(e).__name__}: {e}", flush=True)
        finally:
            if pipe is not None:
                pipe.close()
        del pipe
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if result is None:
            if name == "single":
                break  # no baseline: nothing to compare the modes with
            continue
        if name == "single":
            one = result
            report["single"] = {"s_per_step": one["s_per_step"], "step_times": one["step_times"],
                                "load_s": load_s, "peak_mem_gib_rank0": one["peak_mem_gib_rank0"]}  # fmt: skip
            print(f"single GPU         {one['s_per_step']:.3f} s/step", flush=True)
        else:
            r = report["modes"][name] = {
                "s_per_step": result["s_per_step"], "speedup": one["s_per_step"] / result["s_per_step"],
                "rel_l2_video_latents": rel_error(result["latents"], one["latents"]),
                "rel_l2_sound_latents": rel_error(result["sound"], one["sound"]),
                "step_times": result["step_times"], "load_s": load_s,
                "peak_mem_gib_rank0": result["peak_mem_gib_rank0"],
            }  # fmt: skip
            print(f"{name:<18} {r['s_per_step']:.3f} s/step  ({r['speedup']:.2f}x)  rel L2 after "
                  f"{steps_total} steps: video {r['rel_l2_video_latents']:.2e}, "
                  f"sound {r['rel_l2_sound_latents'] or 0:.2e}", flush=True)  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if one is not None and all("error" not in r for r in report["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""One compiled Wan2.2 decoder residual block per decoder level: its 3x3x3 convs as plain Conv3d vs Winograd
F(2, 3) along time (`TimeWinogradConv3d`), and how much of the FLOP saving the transforms' memory traffic eats.

Each level's block at the shape of a full 720p chunk (4 latent frames): mid / up 0 (1024 ch, 45x80, 4
frames), up 1 (1024, 90x160, 8), up 2 (1024 -> 512 and 512, 180x320, 16), up 3 (512 -> 256 and 256,
360x640, 16). bf16, channels_last_3d, random weights; CUDA-event medians of --repeats calls after a
warm-up that compiles. FLOPs are the direct convs' (what the block computes), so Winograd variants show
TF/s above what the GEMMs run at. With --profile-dir, one call of each variant at the largest level goes
through torch.profiler (kernel tables).

    PYTHONPATH=. python3 bench/vae_residual_block.py --out $OUT/vae_residual_block.json --profile-dir $OUT
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from worldserve.bench.timing import time_once
from worldserve.models.cosmos3.wan_decoder_blocks import ResidualBlock

LEVELS = {  # name: (in channels, out channels, frames, height, width)
    "mid": (1024, 1024, 4, 45, 80),
    "up1": (1024, 1024, 8, 90, 160),
    "up2_first": (1024, 512, 16, 180, 320),
    "up2": (512, 512, 16, 180, 320),
    "up3_first": (512, 256, 16, 360, 640),
    "up3": (256, 256, 16, 360, 640),
}


VARIANTS = {"direct": False, "winograd": True}  # the block's convs' time_winograd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--levels", default=",".join(LEVELS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--profile-dir", type=Path, default=None)
    ap.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="let cuDNN time its algorithms per shape (default: heuristics)",
    )
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    device, dtype, cl = torch.device("cuda"), torch.bfloat16, torch.channels_last_3d
    res: dict = {"torch": torch.__version__, "python": platform.python_version(),
                 "device": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version(),
                 "cudnn_benchmark": args.cudnn_benchmark, "levels": {}}  # fmt: skip
    for level in args.levels.split(","):
        cin, cout, t, h, w = LEVELS[level]
        torch.manual_seed(0)
        with torch.device(device):
            block = ResidualBlock(cin, cout).to(dtype).eval().requires_grad_(False)
            for p in block.parameters():
                if p.ndim == 5:
                    p.data = p.data.normal_(0, 0.02).contiguous(memory_format=cl)
            x = torch.randn(1, cin, t, h, w, dtype=dtype).contiguous(memory_format=cl)
            ctx1 = torch.randn(1, cin, 2, h, w, dtype=dtype).contiguous(memory_format=cl)
            ctx2 = torch.randn(1, cout, 2, h, w, dtype=dtype).contiguous(memory_format=cl)
        convs_macs = t * h * w * 27 * (cin * cout + cout * cout) + (
            t * h * w * cin * cout if cin != cout else 0
        )
        row: dict = {"shape": [cin, cout, t, h, w], "tflop": 2 * convs_macs / 1e12}
        ref = None
        for name in args.variants.split(","):
            wino = VARIANTS[name]
            block.conv1.time_winograd = block.conv2.time_winograd = wino
            torch._dynamo.reset()
            compiled = torch.compile(block, dynamic=False)

            def fn(compiled=compiled, x=x, ctx1=ctx1, ctx2=ctx2):
                return compiled(x, ctx1, ctx2)

            with torch.inference_mode():
                warm = time_once(fn, device)
                samples = sorted(time_once(fn, device) for _ in range(args.repeats))
                out = fn()[0].float()
                if ref is None:
                    ref = out
                rel = float((out - ref).norm() / ref.norm())
                if args.profile_dir is not None and level == "up3":
                    from worldserve.bench.variants import profile_step

                    profile_step(fn, device, args.profile_dir / f"profile_rb_{name}.txt")
            med = samples[len(samples) // 2]
            row[name] = {"ms": med * 1e3, "warmup_s": warm, "tflops": row["tflop"] / med, "rel_vs_first": rel}
            print(
                f"{level:<10} {name:<22} {med * 1e3:8.2f} ms  {row['tflop'] / med:6.0f} TF/s  rel {rel:.2e}",
                flush=True,
            )
        res["levels"][level] = row
        args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\n{'level':<10}" + "".join(f"{n:>22}" for n in args.variants.split(",")))
    for level, row in res["levels"].items():
        print(f"{level:<10}" + "".join(f"{row[n]['ms']:>19.2f} ms" for n in args.variants.split(",")))


if __name__ == "__main__":
    main()

"""The MP4 mux of one 1280x720 x 189-frame video + 48 kHz stereo audio, with the frame conversion serial vs
on threads (media/video.py `yuv_frames`), on this host's CPU.

Frames: a horizontal gradient plus per-column noise (`--content gradient`, an easy picture) or uniform
noise (`--content noise`, the worst case for x264; what random weights decode to). Reports the seconds of
`encode_mp4` per way (median of --repeats) and whether the MP4 bytes are identical.

    PYTHONPATH=. python bench/mux_encode.py --out $OUT/mux_encode.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def make_frames(content: str, frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if content == "noise":
        return rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    ramp = np.linspace(0, 215, width, dtype=np.float32)[None, None, :, None]
    jitter = rng.integers(0, 40, (frames, 1, width, 3)).astype(np.float32)
    return np.broadcast_to(ramp + jitter, (frames, height, width, 3)).astype(np.uint8)


def run(args: argparse.Namespace) -> dict:
    import av

    from worldserve.media import video

    res: dict = {
        "cpus": os.cpu_count(), "conversion_workers": video.conversion_workers(), "av": av.__version__,
        "ffmpeg": {k: ".".join(map(str, v)) for k, v in av.library_versions.items()}, "cases": {},
    }  # fmt: skip
    audio = np.random.default_rng(1).standard_normal((2, 48000 * args.frames // 24)).astype(np.float32) * 0.1
    default_workers = video.conversion_workers
    for content in args.content.split(","):
        frames = make_frames(content, args.frames, args.height, args.width)
        case: dict = {}
        outputs = {}
        for way, workers in (("serial", lambda: 1), ("threads", default_workers)):
            video.conversion_workers = workers
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                outputs[way] = video.encode_mp4(frames, 24.0, audio)
                times.append(time.perf_counter() - t)
            case[way] = {"s": statistics.median(times), "samples": times, "bytes": len(outputs[way])}
        video.conversion_workers = default_workers
        case["identical"] = outputs["serial"] == outputs["threads"]
        case["speedup"] = case["serial"]["s"] / case["threads"]["s"]
        res["cases"][content] = case
        print(f"{content}: serial {case['serial']['s']:.2f} s, threads {case['threads']['s']:.2f} s, "
              f"identical {case['identical']}", file=sys.stderr, flush=True)  # fmt: skip
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--content", default="gradient,noise")
    ap.add_argument("--frames", type=int, default=189)
    ap.add_argument("--height", type=int, default=720)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    res = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(
        f"{'content':10s} {'serial s':>9s} {'threads s':>9s} {'speed-up':>8s} identical  ({res['cpus']} CPUs)"
    )
    for name, c in res["cases"].items():
        print(
            f"{name:10s} {c['serial']['s']:9.2f} {c['threads']['s']:9.2f} {c['speedup']:7.2f}x {c['identical']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The realtime route's encode (media/fragments.py `encode_fragments`) at 1280x720 x 189 frames + 48 kHz
stereo, under several x264 settings, on this host's CPU: how long after the decode hands over its chunks
the parts come out.

The frames arrive as the VAE decodes them (frame 0, then 16 a chunk), one chunk every `--pace` seconds
(0.33 s: the H200's 720p decode), or all at once with `--pace 0`. For each setting it reports, median of
`--repeats`:
- `first_s`: from the arrival of the chunk after frame 0 to the first part holding frames;
- `tail_s`: from the last chunk's arrival to the last part (the whole video after the decode ends);
- `lag_s`: the mean, over parts, of the time from the arrival of the last chunk a part's frames came in
  to the part;
- `total_s`: the encode's wall time;
and each part's frame counts (they must sum to the frames). Frames: `make_frames` of bench/mux_encode.py
(noise by default: what random weights decode to, x264's worst case).

    PYTHONPATH=. python bench/fragment_encode.py --out $OUT/fragment_encode.json
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
from mux_encode import make_frames

SETTINGS = {
    "zerolatency": {"tune": "zerolatency"},
    "frame-threads auto": {},
    "frame-threads 4": {"threads": 4},
    "frame-threads 8": {"threads": 8},
    "zerolatency threads 16": {"tune": "zerolatency", "threads": 16},
}
"""x264 settings tried (each on top of media/video.py's defaults: preset ultrafast, threads 0)."""


def paced_chunks(frames: np.ndarray, pace: float, arrivals: list[float]):
    """Frame 0, then 16 frames a chunk, chunk k not before t0 + k * pace (a decode that keeps its pace
    whatever the encoder does: late reads get their chunk at once). `arrivals`: each chunk's arrival time."""
    t0 = time.perf_counter()
    bounds = [0, 1, *range(17, len(frames), 16), len(frames)]
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        wait = t0 + k * pace - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        arrivals.append(max(time.perf_counter(), t0 + k * pace))
        yield frames[lo:hi]


def one_run(frames: np.ndarray, audio: np.ndarray, options: dict, pace: float) -> dict:
    from worldserve.media.fragments import encode_fragments
    from worldserve.media.frame_stream import FrameStream

    arrivals: list[float] = []
    stream = FrameStream(len(frames), frames.shape[1], frames.shape[2], paced_chunks(frames, pace, arrivals))
    t0 = time.perf_counter()
    parts = []  # (time, frames, bytes)
    for data, n in encode_fragments(stream, 24.0, audio, codec_options=options):
        parts.append((time.perf_counter(), n, len(data)))
    total = time.perf_counter() - t0
    chunk_ends = np.cumsum([1, *[16] * ((len(frames) - 1) // 16), (len(frames) - 1) % 16][: len(arrivals)])
    lags, seen = [], 0
    for at, n, _ in parts:
        if n:
            seen += n
            last_chunk = int(np.searchsorted(chunk_ends, seen))  # the chunk holding the part's last frame
            lags.append(at - arrivals[min(last_chunk, len(arrivals) - 1)])
    first = next(at for at, n, _ in parts if n)
    return {
        "first_s": first - arrivals[1], "tail_s": parts[-1][0] - arrivals[-1], "lag_s": float(np.mean(lags)),
        "total_s": total, "frames": [n for _, n, _ in parts], "bytes": sum(b for *_, b in parts),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--content", default="noise", choices=["noise", "gradient"])
    ap.add_argument("--frames", type=int, default=189)
    ap.add_argument("--pace", type=float, default=0.33)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    args = ap.parse_args(argv)
    import av

    frames = make_frames(args.content, args.frames, 720, 1280)
    audio = np.random.default_rng(1).standard_normal((2, 48000 * args.frames // 24)).astype(np.float32) * 0.1
    res: dict = {"cpus": os.cpu_count(), "av": av.__version__, "pace_s": args.pace, "content": args.content,
                 "command": " ".join(sys.argv), "settings": {}}  # fmt: skip
    for name in args.settings.split(","):
        runs = [one_run(frames, audio, SETTINGS[name], args.pace) for _ in range(args.repeats)]
        assert all(sum(r["frames"]) == args.frames for r in runs), "the parts' frames do not add up"
        med = {k: statistics.median(r[k] for r in runs) for k in ("first_s", "tail_s", "lag_s", "total_s")}
        res["settings"][name] = {**med, "options": SETTINGS[name], "runs": runs}
        print(f"{name}: {med}", file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(
        f"{res['cpus']} CPUs, a chunk every {args.pace} s, {args.content}; seconds, median of {args.repeats}"
    )
    print(f"{'setting':24s} {'first':>6s} {'lag':>6s} {'tail':>6s} {'total':>6s}  frames per part")
    for name, s in res["settings"].items():
        parts = s["runs"][0]["frames"]
        print(
            f"{name:24s} {s['first_s']:6.2f} {s['lag_s']:6.2f} {s['tail_s']:6.2f} {s['total_s']:6.2f}  {parts}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

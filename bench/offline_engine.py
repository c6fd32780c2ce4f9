"""The offline Python API (`worldserve.Engine`) at full size: load, T2V and I2V MP4s, chats, on one GPU.

What `examples/offline_video.py` / `examples/offline_chat.py` do, at the recipe's 1280x720 x 189 frames (fewer
steps: the step itself is `worldserve bench`'s), against a random full-size Nano checkpoint written once
(bench/parallel_step.py `write_random_checkpoint`): the Engine's load (the server's: pipeline, warm-up,
Reasoner sharing the und tower), `generate_video` text-to-video and image-to-video with each MP4 decoded back
(H.264 frames, AAC 48 kHz stereo samples), `chat` (one conversation, then a batch of 8 together), `stream_chat`
(time to the first piece), `chat(n=4)`, a list of two same-shape videos (`--list-shape`: batched, the
requests a step held). Prints a short table last; `--out` writes the JSON.

    PYTHONPATH=. python bench/offline_engine.py --random-nano /tmp/nano-random --steps 2 --out $OUT/offline.json
    PYTHONPATH=. python bench/offline_engine.py --tiny --size 64x48 --frames 9 --steps 2 --list-shape 64x48x9 --out /tmp/o.json  # CPU
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parallel_step import write_random_checkpoint  # noqa: E402

PROMPT = "A red fox trots through fresh snow at dawn, its breath visible."


def decoded(mp4: bytes) -> dict:
    """Codecs, frame count, size, audio rate / channels / samples of an MP4, decoded back with PyAV."""
    import av

    with av.open(io.BytesIO(mp4)) as box:
        v = box.streams.video[0]
        frames = sum(1 for _ in box.decode(v))
        info = {"video_codec": v.codec_context.name, "frames": frames, "size": f"{v.width}x{v.height}"}
    with av.open(io.BytesIO(mp4)) as box:
        if box.streams.audio:
            a = box.streams.audio[0]
            samples = sum(f.samples for f in box.decode(a))
            info |= {"audio_codec": a.codec_context.name, "rate": a.rate, "channels": a.channels,
                     "samples": samples}  # fmt: skip
    return info


def batch_steps(engine) -> tuple[int, float]:
    """(denoising steps run, the requests they held together) so far: `worldserve:step_batch_size`."""
    for h in (m for m in engine.get_metrics() if m.name == "worldserve:step_batch_size"):
        return h.count, h.sum
    return 0, 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--random-nano", type=Path, help="write / reuse a random full-size Nano checkpoint here")
    src.add_argument("--tiny", action="store_true", help="the embedded tiny checkpoint (CPU smoke)")
    ap.add_argument("--size", default="1280x720")
    ap.add_argument("--frames", type=int, default=189)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--list-shape", default="832x480x121", help="WxHxF of the two-video list")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from worldserve import Engine, VideoParams

    width, height = (int(s) for s in args.size.split("x"))
    root = None if args.tiny else write_random_checkpoint(args.random_nano)
    fields = dict(width=width, height=height, num_frames=args.frames, num_inference_steps=args.steps, seed=7)
    rows: list[tuple[str, str]] = []
    result: dict = {"command": " ".join(sys.argv), "python": platform.python_version(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", **fields}  # fmt: skip

    t0 = time.perf_counter()
    with Engine(root, max_batch_size=2) as engine:  # (the list below batches its two videos)
        result["load_s"] = time.perf_counter() - t0
        rows.append(("Engine load (pipeline, warm-up, Reasoner)", f"{result['load_s']:.1f} s"))
        image = np.zeros((height, width, 3), np.uint8)
        image[..., 0], image[..., 1] = 220, 110
        for name, extra in (("t2v", {}), ("i2v", {"image": image})):
            out = engine.generate_video(PROMPT, **fields, **extra)
            check = decoded(out.video)
            result[name] = {"seconds": out.seconds, "stages": out.stage_seconds, "peak_memory_mb": out.peak_memory_mb,
                            "mp4_bytes": len(out.video), **check}  # fmt: skip
            rows.append((f"{name} {args.size} x {args.frames}, {args.steps} steps", f"{out.seconds:.1f} s"))
            rows.append((f"{name} MP4 decoded", f"{check['frames']} {check['video_codec']} frames {check['size']}, "
                         f"{check.get('audio_codec')} {check.get('rate')} Hz x {check.get('channels')}"))  # fmt: skip
        # a list of two same-shape videos (a smaller shape: two 720p x 189 would not fit one 80 GB card)
        lw, lh, lf = (int(v) for v in args.list_shape.split("x"))
        listed = [VideoParams(prompt=PROMPT, width=lw, height=lh, num_frames=lf, num_inference_steps=args.steps,
                              seed=seed) for seed in (1, 2)]  # fmt: skip
        before = batch_steps(engine)
        t = time.perf_counter()
        takes = engine.generate_video(listed)
        took = time.perf_counter() - t
        steps, held = (a - b for a, b in zip(batch_steps(engine), before, strict=True))
        result["list2"] = {"seconds": took, "shape": args.list_shape, "steps": steps, "requests_per_step": held / steps,
                           "frames": [decoded(o.video)["frames"] for o in takes]}  # fmt: skip
        rows.append((f"generate_video([2 x {args.list_shape}]), {args.steps} steps", f"{took:.1f} s, "
                     f"{held / steps:.1f} videos a step"))  # fmt: skip
        t = time.perf_counter()
        answer = engine.chat("What does a red fox eat in winter?", max_tokens=args.max_tokens, temperature=0)
        result["chat"] = {"seconds": time.perf_counter() - t, "finish_reason": answer.finish_reason,
                          "prompt_tokens": answer.usage.prompt_tokens,
                          "completion_tokens": answer.usage.completion_tokens}  # fmt: skip
        rows.append(("chat, one conversation", f"{result['chat']['seconds']:.2f} s, "
                     f"{answer.usage.completion_tokens} tokens"))  # fmt: skip
        batch = [[{"role": "user", "content": f"Name {i + 2} animals of the snow."}] for i in range(8)]
        t = time.perf_counter()
        answers = engine.chat(batch, max_tokens=args.max_tokens, temperature=0.7, seed=1)
        took = time.perf_counter() - t
        tokens = sum(a.usage.completion_tokens for a in answers)
        result["chat_batch8"] = {"seconds": took, "completion_tokens": tokens}
        rows.append(("chat, 8 conversations together", f"{took:.2f} s, {tokens / took:.0f} tok/s"))
        t = time.perf_counter()
        sampled = engine.chat(
            "Name an animal of the snow.", n=4, max_tokens=args.max_tokens, temperature=0.8, seed=1
        )
        took = time.perf_counter() - t
        result["chat_n4"] = {"seconds": took, "completion_tokens": sampled.usage.completion_tokens,
                             "distinct_texts": len({o.text for o in sampled.outputs})}  # fmt: skip
        rows.append(("chat, n=4 samples", f"{took:.2f} s, {len(sampled.outputs)} samples, "
                     f"{result['chat_n4']['distinct_texts']} distinct"))  # fmt: skip
        t, first = time.perf_counter(), None
        pieces = 0
        for _ in engine.stream_chat("Describe snow.", max_tokens=args.max_tokens, temperature=0):
            first = first if first is not None else time.perf_counter() - t
            pieces += 1
        result["stream_chat"] = {"first_piece_s": first, "seconds": time.perf_counter() - t, "pieces": pieces}
        shown = "no piece (an end token first)" if first is None else f"{first:.3f} s"
        rows.append(
            ("stream_chat, first piece / whole", f"{shown} / {result['stream_chat']['seconds']:.2f} s")
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}, torch {result['torch']}\n| what | measured |\n|---|---|")
    for what, value in rows:
        print(f"| {what} | {value} |")


if __name__ == "__main__":
    main()

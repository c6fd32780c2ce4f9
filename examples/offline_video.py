"""Text-to-video and image-to-video in your own process with `worldserve.Engine` (no server), to MP4 files.

Run it as it is (the embedded tiny random checkpoint: seconds on a CPU, its videos are noise):

    python examples/offline_video.py

Real weights (a Hugging Face repo id or a local folder) at the model's own defaults:

    python examples/offline_video.py --model nvidia/Cosmos3-Nano \\
        --size 1280x720 --num-frames 189 --steps 35 --fps 24

Each MP4 holds H.264 video and, unless --no-sound, the jointly generated AAC 48 kHz stereo audio; --takes N
more takes of the prompt (take0.mp4, ...) are made together, as one list.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image

from worldserve import Engine, VideoParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default=None,
        help="repo id or folder (default: the embedded tiny checkpoint; real: nvidia/Cosmos3-Nano)",
    )
    parser.add_argument("--prompt", default="A red fox runs through fresh snow, morning light")
    parser.add_argument("--i2v-prompt", default="The fox turns its head towards the camera")
    parser.add_argument(
        "--image",
        default=None,
        help="first frame for image-to-video (default: a plain orange PNG written here)",
    )
    parser.add_argument("--size", default="320x192", help="WIDTHxHEIGHT, multiples of 16 (real: 1280x720)")
    parser.add_argument("--num-frames", type=int, default=17, help="1 or 4k+1 (real: 189)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (real: 35)")
    parser.add_argument("--fps", type=int, default=24)
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--no-sound", action="store_true", help="video only, no audio track")
    parser.add_argument(
        "--takes", type=int, default=2, help="takes of --prompt made together (take0.mp4, ...)"
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--output-dir", default=".", help="where t2v.mp4, i2v.mp4 (and first_frame.png) go")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    width, height = (int(side) for side in args.size.lower().split("x"))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the fields every request here shares; any field left out takes Cosmos3's default
    fields = dict(
        width=width,
        height=height,
        num_frames=args.num_frames,
        num_inference_steps=args.steps,
        fps=args.fps,
        seed=args.seed,
        generate_sound=not args.no_sound,
    )

    # Engine's options are `worldserve serve`'s flags without dashes (device, dtype, max_batch_size, ...);
    # the `with` block stops the engine's threads at its end
    options = {} if args.device is None else {"device": args.device}
    with Engine(args.model, **options) as engine:
        # text-to-video: blocks until the MP4 is encoded
        t2v = engine.generate_video(args.prompt, **fields)
        t2v.save(out / "t2v.mp4")
        print(f"t2v.mp4: seed {t2v.seed}, {t2v.seconds:.1f} s, stages {t2v.stage_seconds}")

        # image-to-video: `image` is a path, PIL image, uint8 (H, W, 3) array or encoded bytes; an image of
        # another size is resized and center-cropped to the video's
        image = args.image
        if image is None:
            image = out / "first_frame.png"
            Image.new("RGB", (width, height), (220, 110, 40)).save(image)
        i2v = engine.generate_video(args.i2v_prompt, image=image, **fields)
        i2v.save(out / "i2v.mp4")
        print(f"i2v.mp4: seed {i2v.seed}, {i2v.seconds:.1f} s")

        # several takes at once (vLLM's LLM.generate(prompts)): a list of prompts and / or VideoParams, the
        # same shapes batched up to max_batch_size; keyword fields apply to every item, so each take's own
        # seed comes in its VideoParams
        takes = engine.generate_video(
            [VideoParams(prompt=args.prompt, **{**fields, "seed": args.seed + i}) for i in range(args.takes)]
        )
        for i, take in enumerate(takes):
            take.save(out / f"take{i}.mp4")
        # what `worldserve serve` would export at /metrics for these requests (vLLM's LLM.get_metrics())
        done = {m.name: m.value for m in engine.get_metrics() if m.name == "worldserve:request_success"}
        print(f"takes: seeds {[t.seed for t in takes]}; videos made so far {done}")


if __name__ == "__main__":
    main()

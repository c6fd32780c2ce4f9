"""Videos from a running `worldserve serve` with the official `openai` SDK (the OpenAI / vLLM-Omni Videos API):
an async job created, polled and downloaded (text-to-video), the same with a first frame (image-to-video),
then the synchronous route `POST /v1/videos/sync` with httpx, a multipart form with an `input_reference` file.

Start a server, then run this against it:

    worldserve serve                                  # the embedded tiny random checkpoint (noise), port 8000
    python examples/openai_video_client.py

Real weights, at the model's own defaults (a 720p job takes minutes on one GPU):

    worldserve serve nvidia/Cosmos3-Nano --host 0.0.0.0 --port 8000 --init-timeout 1800 --omni
    python examples/openai_video_client.py --base-url http://HOST:8000 \\
        --size 1280x720 --num-frames 189 --steps 35 --timeout 1800

`--api-key` (default: $OPENAI_API_KEY, else "EMPTY") must be one of the server's `--api-key`s when it has any.
"""

from __future__ import annotations

import argparse
import io
import os
import time
import warnings
from pathlib import Path

import httpx
import openai
from PIL import Image


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://localhost:8000", help="the server, without /v1")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    parser.add_argument("--prompt", default="A red fox runs through fresh snow, morning light")
    parser.add_argument("--image", default=None, help="first frame for image-to-video (default: a plain PNG)")
    parser.add_argument("--size", default="320x192", help="WIDTHxHEIGHT (real default: 1280x720)")
    parser.add_argument("--num-frames", type=int, default=17, help="1 or 4k+1 (real default: 189)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (real default: 35)")
    parser.add_argument("--fps", type=int, default=24)
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for each video")
    parser.add_argument("--output-dir", default=".", help="where t2v.mp4, i2v.mp4 and sync.mp4 go")
    return parser.parse_args()


def first_frame(path: str | None, size: str) -> tuple[str, bytes, str]:
    """An image file as the (name, bytes, content type) triple that both the SDK and httpx upload."""
    if path is not None:
        return (Path(path).name, Path(path).read_bytes(), "application/octet-stream")
    width, height = (int(side) for side in size.lower().split("x"))
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (220, 110, 40)).save(buffer, format="PNG")
    return ("first_frame.png", buffer.getvalue(), "image/png")


def wait_for(client: openai.OpenAI, video_id: str, timeout: float) -> None:
    """Poll the job until it completes (`client.videos.create_and_poll` does the same in one call). A failed
    job's GET answers with its failure's status code, so `retrieve` raises with the job JSON as the body."""
    deadline = time.monotonic() + timeout
    while True:
        video = client.videos.retrieve(video_id)
        print(f"  {video.id}: {video.status} {video.progress}%")
        if video.status == "completed":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{video_id} still {video.status} after {timeout} s")
        time.sleep(0.5)


# the SDK warns on every videos call that OpenAI's hosted Sora API is shutting down: not about this server
warnings.filterwarnings("ignore", message="The Sora API", category=DeprecationWarning)


def main() -> None:
    args = parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    # the model the server serves (any of its --served-model-name works)
    model = client.models.list().data[0].id
    # vLLM-Omni's fields the SDK has no argument for go in extra_body (sent as form fields); OpenAI's
    # `seconds` works too (seconds x fps, rounded to a frame count Cosmos3 takes)
    extra = {
        "num_frames": args.num_frames,
        "num_inference_steps": args.steps,
        "fps": args.fps,
        "seed": args.seed,
    }

    # 1. text-to-video: create answers at once with a queued job; poll it, then download its MP4
    job = client.videos.create(model=model, prompt=args.prompt, size=args.size, extra_body=extra)
    print(f"created {job.id} ({job.status}, {job.size})")
    wait_for(client, job.id, args.timeout)
    client.videos.download_content(job.id).write_to_file(out / "t2v.mp4")
    print(f"wrote {out / 't2v.mp4'}")

    # 2. image-to-video: the first frame as the `input_reference` file part (create_and_poll: steps 1 in one)
    image = first_frame(args.image, args.size)
    done = client.videos.create_and_poll(
        model=model,
        prompt="The fox turns its head",
        size=args.size,
        input_reference=image,
        extra_body=extra,
        poll_interval_ms=500,
    )
    if done.status != "completed":
        raise SystemExit(f"{done.id} {done.status}: {done.error}")
    client.videos.download_content(done.id).write_to_file(out / "i2v.mp4")
    print(f"wrote {out / 'i2v.mp4'}")

    # 3. the sync route (the recipe's curl): one multipart POST answered with the MP4 itself; past the
    # server's --sync-timeout it answers 504 with the job's id in X-Video-Id, the job running on
    form = {
        "model": model,
        "prompt": "The fox turns its head",
        "size": args.size,
        **{key: str(value) for key, value in extra.items()},
    }
    response = httpx.post(
        f"{args.base_url}/v1/videos/sync",
        data=form,
        files={"input_reference": image},
        headers={"Authorization": f"Bearer {args.api_key}", "Accept": "video/mp4"},
        timeout=args.timeout,
    )
    response.raise_for_status()
    (out / "sync.mp4").write_bytes(response.content)
    print(f"wrote {out / 'sync.mp4'} (stages: {response.headers.get('x-stage-durations')})")


if __name__ == "__main__":
    main()

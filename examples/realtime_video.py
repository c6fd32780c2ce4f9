"""Stream a video from a running `worldserve serve` over the `/v1/realtime/video` WebSocket (vLLM-Omni's
streaming video output) and write its parts, as they arrive, to one fragmented MP4 (H.264 + AAC).

The protocol: send `session.start` (the fields of a `POST /v1/videos` JSON body); the server answers
`video.start` (the request as it will be made), then for each part a `video.chunk_metadata` JSON message
followed by the part's bytes (the init segment first, then a fragment per decoded chunk), then `session.done`.
Joined in order the parts are one playable MP4. `{"type": "error", ...}` reports anything wrong.

Start a server, then run this against it:

    worldserve serve                                  # the embedded tiny random checkpoint (noise), port 8000
    python examples/realtime_video.py

Real weights, at the model's own defaults:

    worldserve serve nvidia/Cosmos3-Nano --host 0.0.0.0 --port 8000 --init-timeout 1800 --omni
    python examples/realtime_video.py --base-url http://HOST:8000 --size 1280x720 --num-frames 189 --steps 35

`--api-key` (default: $OPENAI_API_KEY) is sent as the bearer token when the server has `--api-key`s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://localhost:8000", help="the server (http or https)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--prompt", default="A red fox runs through fresh snow, morning light")
    parser.add_argument("--size", default="320x192", help="WIDTHxHEIGHT (real default: 1280x720)")
    parser.add_argument("--num-frames", type=int, default=17, help="1 or 4k+1 (real default: 189)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (real default: 35)")
    parser.add_argument("--fps", type=int, default=24)
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--output", default="realtime.mp4")
    return parser.parse_args()


async def stream_video(args: argparse.Namespace) -> None:
    url = args.base_url.replace("http", "ws", 1).rstrip("/") + "/v1/realtime/video"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    start = {
        "type": "session.start",
        "format": "m4s",
        "prompt": args.prompt,
        "size": args.size,
        "num_frames": args.num_frames,
        "num_inference_steps": args.steps,
        "fps": args.fps,
        "seed": args.seed,
    }
    began = time.monotonic()
    # max_size=None: a part of a 720p video can be larger than the client's default 1 MiB message limit
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        await ws.send(json.dumps(start))
        with open(args.output, "wb") as out:
            async for message in ws:
                if isinstance(message, bytes):
                    # the part announced by the last video.chunk_metadata: append it as it is
                    out.write(message)
                    continue
                event = json.loads(message)
                if event["type"] == "video.start":
                    print(
                        f"{event['request_id']}: {event['config']['width']}x{event['config']['height']}, "
                        f"{event['config']['num_frames']} frames"
                    )
                elif event["type"] == "video.chunk_metadata":
                    print(
                        f"  +{time.monotonic() - began:5.1f} s: part {event['transport_chunk_index']}, "
                        f"{event['num_frames']} frames, {event['byte_length']} bytes"
                    )
                elif event["type"] == "session.done":
                    print(
                        f"done: {event['chunks']} parts in {time.monotonic() - began:.1f} s -> {args.output}"
                    )
                    return
                elif event["type"] == "error":
                    raise SystemExit(f"error {event.get('code')}: {event['message']}")
    raise SystemExit("the server closed the socket before session.done")


def main() -> None:
    try:
        asyncio.run(stream_video(parse_args()))
    except InvalidStatus as exc:  # the HTTP answer to the upgrade (401 without the server's API key)
        status = exc.response.status_code
        hint = ": pass --api-key (or set $OPENAI_API_KEY)" if status == 401 else ""
        raise SystemExit(f"the server refused the WebSocket with HTTP {status}{hint}") from None


if __name__ == "__main__":
    main()

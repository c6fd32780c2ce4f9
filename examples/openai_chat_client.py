"""Ask the Cosmos3 Reasoner about an image through a running `worldserve serve` with the official `openai`
SDK: one chat completion with an image (a base64 `data:` URL) and a text part, streamed as it is sampled.

Start a server, then run this against it:

    worldserve serve                                  # the embedded tiny random checkpoint (noise), port 8000
    python examples/openai_chat_client.py

Real weights:

    worldserve serve nvidia/Cosmos3-Nano --host 0.0.0.0 --port 8000 --init-timeout 1800 --omni
    python examples/openai_chat_client.py --base-url http://HOST:8000 --image photo.jpg --max-tokens 512

`--api-key` (default: $OPENAI_API_KEY, else "EMPTY") must be one of the server's `--api-key`s when it has any.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys

import openai
from PIL import Image


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://localhost:8000", help="the server, without /v1")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"))
    parser.add_argument("--image", default=None, help="an image file to ask about (default: a drawn square)")
    parser.add_argument("--question", default="Describe this image in one sentence.")
    parser.add_argument("--max-tokens", type=int, default=16, help="answer length (real: a few hundred)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 is greedy (default: the server's, from the checkpoint's generation config)",
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def image_data_url(path: str | None) -> str:
    """The image as a base64 `data:` URL (an http(s) URL works too: the server downloads it)."""
    if path is not None:
        with open(path, "rb") as f:
            data = f.read()
    else:
        picture = Image.new("RGB", (64, 48), (30, 90, 200))
        picture.paste((240, 200, 40), (16, 12, 48, 36))
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        data = buffer.getvalue()
    return "data:image/png;base64," + base64.b64encode(data).decode()


def main() -> None:
    args = parse_args()
    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(args.image)}},
                {"type": "text", "text": args.question},
            ],
        }
    ]
    # optional fields left out take the server's defaults (the checkpoint's generation_config.json)
    optional = {} if args.temperature is None else {"temperature": args.temperature}
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stream=True,
        # the last chunk then carries the token counts
        stream_options={"include_usage": True},
        **optional,
    )
    print(f"Q: {args.question}\nA: ", end="", flush=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage is not None:
            print(
                f"\n({chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens)",
                file=sys.stderr,
            )
    print()


if __name__ == "__main__":
    main()

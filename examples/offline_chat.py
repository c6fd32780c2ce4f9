"""Chat with the Cosmos3 Reasoner in your own process with `worldserve.Engine`: a text question answered
whole (`Engine.chat`), the same question sampled several times at once (`n`), then a question about an image
streamed as it is sampled (`Engine.stream_chat`).

Run it as it is (the embedded tiny random checkpoint: seconds on a CPU, its answers are random tokens):

    python examples/offline_chat.py

Real weights (a Hugging Face repo id or a local folder), sampling as the checkpoint's generation config:

    python examples/offline_chat.py --model nvidia/Cosmos3-Nano --image photo.jpg --max-tokens 512
"""

from __future__ import annotations

import argparse
import base64
import io

from PIL import Image

from worldserve import Engine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        default=None,
        help="repo id or folder (default: the embedded tiny checkpoint; real: nvidia/Cosmos3-Nano)",
    )
    parser.add_argument("--question", default="What does a red fox eat in winter?")
    parser.add_argument("--image", default=None, help="an image file to ask about (default: a drawn square)")
    parser.add_argument("--image-question", default="Describe this image in one sentence.")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (real: a few hundred)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 is greedy (default: the checkpoint's generation_config.json)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--samples", type=int, default=3, help="answers sampled at once for the text question (n; 1 to 16)"
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    return parser.parse_args()


def image_data_url(path: str | None) -> str:
    """The image as a base64 `data:` URL, the form an OpenAI chat message's `image_url` takes."""
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
    # the chat completion's sampling fields by name; those left out take the checkpoint's generation config
    sampling = {"max_tokens": args.max_tokens, "seed": args.seed}
    if args.temperature is not None:
        sampling["temperature"] = args.temperature
    options = {} if args.device is None else {"device": args.device}
    with Engine(args.model, **options) as engine:
        # 1. text: OpenAI chat messages in, the whole answer out (a plain string is one user turn too)
        answer = engine.chat([{"role": "user", "content": args.question}], **sampling)
        print(f"Q: {args.question}\nA: {answer.text}")
        print(
            f"({answer.finish_reason}; {answer.usage.prompt_tokens} prompt + "
            f"{answer.usage.completion_tokens} completion tokens)"
        )

        # 1b. n answers to the same question, sampled together (one prefill, decoded as a batch; sample i
        # seeded seed + i, as the HTTP route's n choices): `outputs` holds them all, usage counts the prompt
        # once and every sample's tokens (n > 1 needs sampling: greedy answers would all be the same)
        if args.samples > 1 and args.temperature != 0:
            several = engine.chat(args.question, n=args.samples, **sampling)
            for sample in several.outputs:
                print(f"sample {sample.index}: {sample.text!r} ({sample.finish_reason})")
            print(f"({len(several.outputs)} samples; {several.usage.completion_tokens} completion tokens)")

        # 2. image + text, streamed: the image part is what the HTTP route takes (a data: URL here; a
        # {"type": "image_pil", "image_pil": PIL.Image} part works too)
        message = {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(args.image)}},
                {"type": "text", "text": args.image_question},
            ],
        }
        print(f"Q: {args.image_question}\nA: ", end="", flush=True)
        for piece in engine.stream_chat([message], **sampling):
            print(piece, end="", flush=True)
        print()


if __name__ == "__main__":
    main()

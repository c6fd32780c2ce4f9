"""The Reasoner's image preprocessing on this host's CPU: ours (models/cosmos3/vision.py ImagePreprocessor)
against transformers' Qwen2VLImageProcessorPil with Qwen3-VL's settings, the reference it replaced.

Per image size: the median milliseconds of each over --repeats rounds (the two called in turn; ours up to
the same float pixel values, normalised on the CPU here where serve sends the uint8 patches to the GPU and
normalises them there), the ratio, and whether the outputs are equal bit for bit. Runs on the API side of every image chat (the prompt is
built off the chat worker's thread), so its time is part of the chat's time to first token. Then an image
chat's whole media work as the API does it (api/chat_media.py `part` on a base64 JPEG data URL: decode, check,
then the preprocessing): a new image against the same image again, found in the Reasoner's processor cache
(media/processor_cache.py: neither decoded nor resized). Last, one request of four new images, their media
work and preprocessing one after another against on the media pool (media/work_pool.py).

    PYTHONPATH=. python bench/image_preprocess.py --out /tmp/image_preprocess.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """uint8 [h, w, 3]: smooth gradients plus noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = 127 + 120 * np.sin(xx[..., None] / (7 + 3 * np.arange(3)) + yy[..., None] / 11)
    return np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)


def medians_ms(fns, repeats: int) -> list[float]:
    """Each function's median milliseconds over `repeats` rounds that call them in turn (after one untimed
    round): both see the same allocator and cache state, which a block of calls of one then the other does not."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats + 1):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            if r:
                ts.append(1000 * (time.perf_counter() - t0))
    return [statistics.median(ts) for ts in times]


def main() -> int:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from worldserve.bench.report import environment
    from worldserve.models.cosmos3.vision import QWEN3VL_MAX_PIXELS, QWEN3VL_MIN_PIXELS, ImagePreprocessor

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file")
    ap.add_argument("--sizes", default="720x1280,1080x1920,480x854", help="HxW list")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    ours = ImagePreprocessor()
    ref = Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": QWEN3VL_MIN_PIXELS, "longest_edge": QWEN3VL_MAX_PIXELS},
    )  # fmt: skip
    rows = []
    for size in args.sizes.split(","):
        h, w = (int(x) for x in size.split("x"))
        img = photo(h, w)
        new_ms, repeat_ms = chat_media_ms(img, args.repeats)
        a, b = ours([img]), ref(images=[img], return_tensors="pt")
        mine, theirs = medians_ms(
            [
                lambda img=img: ours([img]).pixel_values(),
                lambda img=img: ref(images=[img], return_tensors="pt"),
            ],
            args.repeats,
        )
        rows.append({
            "size": f"{w}x{h}", "patches": int(a.patches.shape[0]), "ours_ms": mine, "reference_ms": theirs,
            "bit_equal": bool(torch.equal(a.pixel_values(), b["pixel_values"].float())),
            "chat_new_image_ms": new_ms, "chat_repeated_image_ms": repeat_ms,
        })  # fmt: skip
    res = {
        "environment": environment(torch.device("cpu")),
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print("| image | patches | ours ms | transformers ms | speed-up | bit-equal |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['patches']} | {r['ours_ms']:.1f} | {r['reference_ms']:.1f} | "
              f"{r['reference_ms'] / r['ours_ms']:.2f}x | {r['bit_equal']} |")  # fmt: skip
    several = several_images_ms(4, args.repeats)
    res["four_720p_images_one_request"] = several
    print(
        f"\none request of four new 720p images, media work + preprocessing: {several['one_by_one_ms']:.1f} ms "
        f"one after another, {several['pooled_ms']:.1f} ms on the media pool ({several['pool_threads']} threads)"
    )
    args.out.write_text(json.dumps(res, indent=2))
    print("\n| image | chat's media work, new image ms | same image again (processor cache) ms | speed-up |\n"
          "|---|---|---|---|")  # fmt: skip
    for r in rows:
        print(f"| {r['size']} | {r['chat_new_image_ms']:.1f} | {r['chat_repeated_image_ms']:.1f} | "
              f"{r['chat_new_image_ms'] / r['chat_repeated_image_ms']:.1f}x |")  # fmt: skip
    return 0


def several_images_ms(n: int, repeats: int) -> dict:
    """Median ms of a chat request of `n` new 720p JPEG images (data URLs) through api/chat.py build_params
    and the preprocessing, no processor cache: one image after another (a pool of one thread) and on the
    media pool (media/work_pool.py)."""
    import base64
    import io

    from PIL import Image

    from worldserve.api.chat import build_params
    from worldserve.api.chat_protocol import ChatCompletionRequest
    from worldserve.media import work_pool
    from worldserve.models.cosmos3.vision import ImagePreprocessor

    parts = []
    for seed in range(n):
        buf = io.BytesIO()
        Image.fromarray(photo(720, 1280, seed)).save(buf, format="JPEG", quality=90)
        url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": parts}]}
    )
    threads = work_pool.MAX_WORKERS

    def work(workers: int):
        work_pool.MAX_WORKERS = workers
        try:
            params = build_params(body, None)
            return ImagePreprocessor()([p.image for p in params.messages[0].content])
        finally:
            work_pool.MAX_WORKERS = threads

    alone, pooled = medians_ms([lambda: work(1), lambda: work(threads)], repeats)
    return {"images": n, "one_by_one_ms": alone, "pooled_ms": pooled, "pool_threads": threads}


def chat_media_ms(img: np.ndarray, repeats: int) -> tuple[float, float]:
    """Median ms of an image part's media work (api/chat_media.py `part` on a JPEG data URL, then the
    preprocessing with its content key): without a processor cache, and with one that holds the image."""
    import base64
    import io

    from PIL import Image

    from worldserve.api.chat_media import part
    from worldserve.api.chat_protocol import ContentPart
    from worldserve.chat_params import VideoSampling
    from worldserve.media.processor_cache import ProcessorCache
    from worldserve.models.cosmos3.vision import ImagePreprocessor

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    content = ContentPart(type="image_url", image_url={"url": url})
    cache = ProcessorCache()

    def work(cache):
        p = part(content, "messages[0].content[0]", None, VideoSampling(), None, cache)
        return ImagePreprocessor(cache=cache)([p.image], keys=[p.media_key])

    work(cache)  # the cache now holds the image
    return tuple(medians_ms([lambda: work(None), lambda: work(cache)], repeats))


if __name__ == "__main__":
    raise SystemExit(main())

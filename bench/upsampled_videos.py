"""bench/serve_chat.py --upsample: video jobs with `extra_params.upsample_prompt` against a running `worldserve
serve` (serve_chat.py starts it): a text-to-video and an image-to-video job (a 720p JPEG through the ViT),
each timed from its creation to its first denoising step (the Reasoner writing the JSON prompt, then
admission) and to the end; the prompt written must parse with the schema's keys.

With random weights the Reasoner writes noise, so every text runs to the schema's bound: the time is an upper
bound of the prompt's length, not a real answer's (~1k tokens).
"""

from __future__ import annotations

import io
import json
import time

import httpx
import numpy as np

from worldserve.engine.prompt_upsampling import UpsamplerConfig

KEYS = set(UpsamplerConfig().schema()["properties"])


def _jpeg(width: int = 1280, height: int = 720) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return buf.getvalue()


def upsampled_videos(url: str, size: str = "256x256", frames: int = 9, steps: int = 2) -> dict:
    """Both jobs, one after the other: timings, the written prompt's length and whether it parsed."""
    out: dict = {}
    fields = {"prompt": "A fox runs through the snow.", "size": size, "num_frames": str(frames),
              "num_inference_steps": str(steps), "seed": "3", "extra_params": json.dumps({"upsample_prompt": True})}  # fmt: skip
    for name, files in (("t2v", None), ("i2v", {"input_reference": ("ref.jpg", _jpeg(), "image/jpeg")})):
        t0 = time.perf_counter()
        job = httpx.post(url + "/v1/videos", data=fields, files=files, timeout=120).json()
        started, deadline = None, t0 + 600
        while (p := httpx.get(f"{url}/v1/videos/{job['id']}", timeout=60).json())["status"] in (
            "queued", "in_progress"
        ):  # fmt: skip
            if started is None and p["status"] == "in_progress":
                started = time.perf_counter() - t0
            if time.perf_counter() > deadline:
                raise TimeoutError(f"job {job['id']} still {p['status']} after 600 s")
            time.sleep(0.05)
        prompt = p.get("upsampled_prompt") or ""
        try:
            parsed = set(json.loads(prompt)) == KEYS
        except ValueError:
            parsed = False
        out[name] = {"status": p["status"], "error": p.get("error"), "to_first_step_s": started,
                     "total_s": time.perf_counter() - t0, "prompt_chars": len(prompt), "parsed": parsed,
                     "prompt_head": prompt[:300]}  # fmt: skip
        print(f"upsampled {name}: {out[name]['status']}, first step after {started} s, {len(prompt)} chars, "
              f"parsed {parsed}", flush=True)  # fmt: skip
    return out

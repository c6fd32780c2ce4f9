"""The offline Engine's text-to-image: `image_params` turns `generate_image`'s arguments into the `n` checked
one-frame VideoParams POST /v1/images/generations would make, `run_images` runs them through the engine
together and returns each frame as a PIL image (`ImageOutput`).

Defaults and seeds are the image route's, from the one function both call (image_params.py
`text_to_image_params`: Cosmos3's T2I defaults, the engine's `flow_shift` option as the route's --flow-shift,
a random seed when none is given, image i seeded `choice_seed(seed, i)`), not the engine's
`default_sampling_params` (the route does not apply them either). Fields that only mean something
for a video (fps, image / video conditioning, the duration template, sound) are a ParamError naming the
keyword, as the route answers a 400 naming them; so are num_frames other than 1 and generate_sound=True.

`run_images` queues the `n` requests in one piece without a job (the route's `client.jobless.generate`), so
they batch from their first step; with `upsample_prompt` the Reasoner writes the prompt once for all of them
first (the route's way). A cancellation (the caller's timeout, an interrupt) aborts them at their next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from worldserve.engine.client import EngineClient, VideoResult
from worldserve.engine.prompt_upsampling import UpsamplingFailed
from worldserve.engine.refusals import CancelledRequest
from worldserve.image_params import text_to_image_params
from worldserve.offline.outputs import ImageOutput
from worldserve.offline.video_requests import FIELDS, check_field_names, python_scalar, upsampling_error
from worldserve.param_errors import ParamError
from worldserve.param_types import is_real
from worldserve.params import (
    LoraRequest,
    VideoParams,
)

MAX_IMAGES = 10
"""The most images one call makes (the image route's `n` bound, OpenAI's)."""
VIDEO_ONLY_FIELDS = frozenset(
    {"fps", "image", "video", "condition_frame_indexes", "condition_video_keep", "add_duration_template",
     "sound_duration"}
)  # fmt: skip
"""VideoParams fields that mean nothing for one generated image (the route's VIDEO_ONLY_EXTRA, by field name)."""


def image_params(
    prompt: Any,
    n: Any,
    fields: Mapping[str, Any],
    *,
    default_flow_shift: float | None = None,
    static_lora: LoraRequest | None = None,
    per_request_lora: bool = False,
) -> list[VideoParams]:
    """The `n` images' VideoParams (seed, seed + 1, ...: choice_seed), validated: ParamError naming `prompt`,
    `n` or the first bad keyword field. `default_flow_shift` (the engine's `flow_shift` option, serve's
    --flow-shift) replaces T2I's 3.0 when no flow_shift is given, as the route's does."""
    if not isinstance(prompt, str):
        raise ParamError("prompt", f"prompt must be a string, got {type(prompt).__name__}")
    if isinstance(n, np.integer):  # (numpy scalars as Python's, as the other numeric fields)
        n = int(n)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_IMAGES:
        raise ParamError(
            "n", f"n must be an integer from 1 to {MAX_IMAGES} (the image route's bound), got {n!r}"
        )
    given = _image_fields(fields)
    # (numpy scalars as Python's, as generate_video's: outputs and logs see plain values)
    given = {name: python_scalar(value) for name, value in given.items()}
    from worldserve.api.lora_field import ENGINE_PER_REQUEST_OFF, LoraSettings

    # (a dict is the route's lora object, read as the route reads it; an adapter of its own needs enable_lora,
    # as the routes require)
    lora = LoraSettings(per_request_lora, static_lora, ENGINE_PER_REQUEST_OFF).for_argument(given.get("lora"))
    if lora is not None:
        given["lora"] = lora
    return text_to_image_params(prompt, n, given, default_flow_shift=default_flow_shift)


def _image_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword fields, each a VideoParams field that applies to an image: ParamError naming one that is
    not, num_frames other than 1, or generate_sound asked for."""
    check_field_names(fields, known=FIELDS - VIDEO_ONLY_FIELDS)
    for name in fields:
        if name in VIDEO_ONLY_FIELDS:
            raise ParamError(name, f"{name} applies to videos, not images (generate_video makes videos)")
    frames = fields.get("num_frames", 1)
    if isinstance(frames, bool) or not is_real(frames) or frames != 1:
        raise ParamError(
            "num_frames",
            f"an image is one frame: num_frames must be 1, got {frames!r} (generate_video makes videos)",
        )
    if fields.get("generate_sound"):
        raise ParamError("generate_sound", "sound cannot be generated for an image")
    return {k: v for k, v in fields.items() if k not in ("num_frames", "generate_sound")}


async def run_images(client: EngineClient, params_list: Sequence[VideoParams]) -> list[ImageOutput]:
    """Run the images' requests (image_params) through the engine together: their images in order. The
    model's checks first (ParamError naming the field); the first failure is raised and aborts the others, as
    does a cancellation of the call."""
    t0 = time.monotonic()
    # (tokenizes the prompts: off the loop, as the route does)
    checked = await asyncio.to_thread(lambda: [client.validate(p) for p in params_list])
    prefix = f"offline-image-{uuid.uuid4().hex}"
    if checked[0].upsample_prompt:
        checked = await _upsampled(client, checked, prefix)
    try:
        results = await client.jobless.generate(checked, prefix=prefix, timeout_s=1e9)
    except CancelledRequest as exc:  # the engine stopped (close(), or a crash) before they finished
        raise RuntimeError(f"the image request did not finish: {exc}") from None
    seconds = time.monotonic() - t0
    from PIL import Image

    return [
        ImageOutput(
            image=Image.fromarray(_frame(result)).convert("RGB"), params=params, seconds=seconds,
            stage_seconds={k: round(float(v), 4) for k, v in result.stage_seconds.items()},
            peak_memory_mb=float(result.peak_memory_mb),
        )
        for params, result in zip(checked, results, strict=True)
    ]  # fmt: skip


def _frame(result: VideoResult) -> np.ndarray:
    """A one-frame request's frame, uint8 (H, W, 3) (decoded whole: no `on_frames`, so no FrameStream)."""
    frames = result.frames
    assert isinstance(frames, np.ndarray), "a jobless request's frames are decoded whole"
    return frames[0]


async def _upsampled(client: EngineClient, checked: list[VideoParams], prefix: str) -> list[VideoParams]:
    """The requests with the prompt the Reasoner writes once for all of them (the first one's seed), as the
    route's `revised_prompt`: a ParamError naming the field when the request's own limits refused it, else a
    RuntimeError."""
    try:
        prompt = await client.jobless.admitted_upsampling(checked[0], prefix, 1e9, len(checked))
    except UpsamplingFailed as exc:
        raise upsampling_error(exc) from None
    return [dataclasses.replace(p, prompt=prompt, upsample_prompt=False) for p in checked]

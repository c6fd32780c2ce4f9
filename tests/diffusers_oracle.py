"""Test helper: drive diffusers' Cosmos3OmniPipeline with a VideoParams the way worldserve runs it.

Reference settings of cosmos3-model.md §13: no system prompt, diffusers' own templates off (our formatted
cond / uncond strings are passed), the native flow schedule (use_native_flow_schedule in the tiny
checkpoint's model_index.json) with the request's flow shift (its own, or the resolution tier's default:
the scheduler is rebuilt for the call with that `flow_shift`), a CPU generator seeded with the request's
seed. Image (I2V) and video (V2V) conditioning are passed through.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from worldserve.models.cosmos3.prompt import format_prompts
from worldserve.params import VideoParams


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def assert_frames_match(frames: np.ndarray, ref_video) -> None:
    """Our uint8 frames (F, H, W, 3) against diffusers' "np" output (floats in [0, 1]): the same shape and
    every value within 1/255 (our rounding to uint8 alone moves a value by at most 0.5/255)."""
    ref = np.asarray(ref_video)
    if ref.ndim == 5:
        ref = ref[0]
    assert frames.shape == ref.shape
    assert np.abs(frames.astype(np.float64) / 255.0 - ref).max() <= 1 / 255


def run_diffusers(pipe, params: VideoParams, output_type: str, sound: bool = False, **call_kwargs):
    texts = format_prompts(params)
    conditioning = {}
    if params.image is not None:
        conditioning["image"] = params.image
    if params.video is not None:
        conditioning.update(
            video=[Image.fromarray(f) for f in params.video],
            condition_frame_indexes_vision=list(params.condition_frame_indexes),
            condition_video_keep=params.condition_video_keep,
        )
    scheduler = pipe.scheduler
    pipe.scheduler = type(scheduler).from_config(scheduler.config, flow_shift=params.resolved_flow_shift())
    try:
        return pipe(
            prompt=texts.cond,
            negative_prompt=texts.uncond,
            num_frames=params.num_frames,
            height=params.height,
            width=params.width,
            fps=params.fps,
            num_inference_steps=params.num_inference_steps,
            guidance_scale=params.guidance_scale,
            enable_sound=sound,
            use_system_prompt=False,
            add_duration_template=False,
            add_resolution_template=False,
            generator=torch.Generator().manual_seed(params.seed),
            output_type=output_type,
            **conditioning,
            **call_kwargs,
        )
    finally:
        pipe.scheduler = scheduler


def run_diffusers_decoded(pipe, params: VideoParams, sound: bool = False):
    """One diffusers run -> (final latents [1, 48, T, h, w], decoded sound [2, N] or None, "np" frames): the
    latents are caught by a step-end callback after the last step, so one run gives all three."""
    last = {}

    def keep(_pipe, _i, _t, kwargs):
        last["latents"] = kwargs["latents"].clone()
        return {}

    out = run_diffusers(pipe, params, "np", sound=sound, callback_on_step_end=keep)
    return last["latents"], out.sound, out.video

"""Test helper: drive diffusers' Cosmos3OmniPipeline with a VideoParams the way worldserve runs it.

Reference settings of cosmos3-model.md §13: no system prompt, diffusers' own templates off (our formatted
cond / uncond strings are passed), the native flow schedule (from the tiny checkpoint's model_index.json),
a CPU generator seeded with the request's seed. Image (I2V) and video (V2V) conditioning are passed through.
"""

from __future__ import annotations

import torch
from PIL import Image

from worldserve.models.cosmos3.prompt import format_prompts
from worldserve.params import VideoParams


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run_diffusers(pipe, params: VideoParams, output_type: str, sound: bool = False):
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
    )

"""A video request's starting latents: the initial noise, drawn exactly as diffusers' Cosmos3OmniPipeline draws
it (a CPU generator seeded with the request's seed: the video noise, then the sound noise), and the
conditioning frames the VAE encodes from the request's image (I2V: latent frame 0) or clip (V2V: the latent
frames up to max(condition_frame_indexes)).

Separate from runner/video_pipeline.py, which runs the stages: this is what `VideoPipeline.prepare` starts a
request from, plain functions of the VAEs and the request's params. Everything is float32 on `device`.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from worldserve.params import ParamError, VideoParams

if TYPE_CHECKING:  # the VAEs import diffusers
    from worldserve.models.cosmos3.audio_vae import AudioVAE
    from worldserve.models.cosmos3.vae import VideoVAE


def initial_noise(
    params: VideoParams, vae: VideoVAE, audio_vae: AudioVAE | None, with_sound: bool, device: torch.device
) -> tuple[Tensor, Tensor | None]:
    """fp32 noise from a CPU generator seeded per request: video [48,T,h,w] first, then sound [64,T_s] when
    `with_sound` (VideoPipeline.sound_enabled)."""
    # (operator.index: manual_seed takes no numpy integer, which VideoParams accepts as an int)
    gen = torch.Generator(device="cpu").manual_seed(operator.index(params.seed))
    c, t, h, w = vae.latent_shape(params.num_frames, params.height, params.width)
    latents = torch.randn((c, t, h, w), generator=gen, dtype=torch.float32)
    sound = None
    if with_sound:
        if audio_vae is None:  # (validate refuses this; a prepare without it gets the same answer)
            raise ParamError(
                "generate_sound",
                "generate_sound was requested but this checkpoint has no sound tokenizer",
            )
        n = audio_vae.latent_frames(params.num_frames, params.fps)
        sound = torch.randn((audio_vae.latent_channels, n), generator=gen, dtype=torch.float32)
        sound = sound.to(device)
    return latents.to(device), sound


def encode_image(vae: VideoVAE, image: np.ndarray, params: VideoParams, device: torch.device) -> Tensor:
    """I2V: `image` (params.image) -> latent frame 0 [48, h, w] on the device."""
    from worldserve.media.image import resize_center_crop

    image = resize_center_crop(image, params.width, params.height)
    # The VAE is causal in time: latent frame 0 depends on pixel frame 0 only, so encoding one frame
    # equals frame 0 of encoding the image repeated over the whole clip, at a fraction of the cost.
    cond = vae.encode_condition(image, params.num_frames, first_frame_only=True)  # [1, 48, 1, h, w]
    return cond[0, :, 0].to(device)


def encode_video(vae: VideoVAE, video: np.ndarray, params: VideoParams, device: torch.device) -> Tensor:
    """diffusers' V2V conditioning (`video`: params.video): the clip's first (or last) max(idx)*4+1 frames, resized, the last
    frame repeated when the clip is shorter, VAE-encoded. diffusers encodes the whole `num_frames`
    video (the tail repeat-padded); the VAE is causal, so the latent frames up to max(idx) are the
    same from this prefix alone."""
    from worldserve.media.video_input import condition_budget, resize_video

    n = condition_budget(params.condition_frame_indexes, vae.scale_factor_temporal)
    clip = video[:n] if params.condition_video_keep == "first" else video[-n:]
    clip = resize_video(clip, params.width, params.height)
    if clip.shape[0] < n:
        pad = np.repeat(clip[-1:], n - clip.shape[0], axis=0)
        clip = np.concatenate([clip, pad], axis=0)
    return vae.encode_video(clip)[0].to(device)

"""The decode stage of a video request: its finished latents -> host uint8 frames + float audio.

The audio goes first (the AVAE decode is short: ~0.04 s at 720p x 189 frames on an H200), so a streaming
consumer knows the whole audio track before the first frame. The frames come from the Wan2.2 decoder chunk
by chunk (`VideoVAE.decode_frames`: frame 0, then 4 frames per latent frame of a chunk, 8 by default, each copied to the host
while the GPU decodes the next) as a `FrameStream`: the engine hands it to the MP4 encoder, which muxes the first chunks
while the GPU decodes the next (media/frame_stream.py); other callers read it whole (`stream=False`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from worldserve.engine.outputs import VideoResult
from worldserve.media.audio import fit_audio
from worldserve.media.frame_stream import FrameStream
from worldserve.media.video import clip_samples
from worldserve.params import LoraRequest, ParamError

if TYPE_CHECKING:  # the VAEs import diffusers: a peer rank, which only runs the transformer, never needs them
    from worldserve.models.cosmos3.audio_vae import AudioVAE
    from worldserve.models.cosmos3.vae import VideoVAE
    from worldserve.runner.video_state import VideoRequestState


@torch.inference_mode()
def decode_video(
    vae: VideoVAE,
    audio_vae: AudioVAE | None,
    state: VideoRequestState,
    *,
    stream: bool = False,
    server_lora: LoraRequest | None = None,
) -> VideoResult:
    """`state`'s latents and sound -> a VideoResult. `stream`: its frames are a FrameStream that decodes as
    it is read, to be read at once on this thread while `state` lives (the caller holds its model lock);
    the "vae.decode" stage and the peak device memory are filled in when its last chunk has been made.
    Otherwise the frames are one (F, H, W, 3) array, decoded here. A denoising that diverged fails here
    (check_finite; `server_lora`: the server's own adapter), not as a black video."""
    check_finite(state, server_lora)
    t0 = time.perf_counter()
    p, latents = state.params, state.latents  # latents [48, T, h, w]
    stages = dict(state.stage_seconds)
    audio = None
    if state.sound is not None:
        assert audio_vae is not None, "sound latents come only from a pipeline with an audio VAE"
        # the clip's length; a request's sound_duration then trims it or pads it with silence (the decoder's
        # output past the clip, up to a hop of it, is not silence)
        audio = audio_vae.decode(state.sound, clip_samples(p.num_frames, p.fps, audio_vae.sample_rate))
        if p.sound_duration is not None:
            audio = fit_audio(audio, round(p.sound_duration * audio_vae.sample_rate))
        stages["audio.decode"] = time.perf_counter() - t0
    s = vae.scale_factor_spatial
    frames = FrameStream(
        vae.num_decoded_frames(latents.shape[1]), latents.shape[2] * s, latents.shape[3] * s, ()
    )
    result = VideoResult(
        frames=frames, fps=float(p.fps), audio=audio, stage_seconds=stages,
        sample_rate=audio_vae.sample_rate if audio_vae is not None else 48000,
        prompt_tokens=state.prompt_tokens, gen_tokens=state.gen_tokens,
    )  # fmt: skip
    frames.chunks = _timed_chunks(vae, latents, result)
    if not stream:
        result.frames = frames.to_array()
    return result


class DivergedError(RuntimeError):
    """The denoised latents hold NaN or inf: the request's output would decode to a black video."""


def check_finite(state: VideoRequestState, server_lora: LoraRequest | None = None) -> None:
    """ParamError naming `lora` when a request's denoising with its own LoRA adapter diverged (a scale large
    enough to overflow the activations: 1e30 passes the adapter's own finite check and made a black video, HTTP
    200); DivergedError without one, or with the server's own adapter `server_lora` (the operator's
    --lora-path / --lora-scale: no request can lower it). One device sync a request, before the decode that
    reads the latents anyway."""
    finite = torch.isfinite(state.latents).all()
    if state.sound is not None:
        finite = finite & torch.isfinite(state.sound).all()
    if bool(finite):
        return
    lora = state.params.lora
    if lora is not None and lora.scale != 0:
        said = f"LoRA adapter {lora.name!r} at scale {lora.scale:g}"
        if lora == server_lora:
            raise DivergedError(f"the server's own {said} ({lora.path}: --lora-path / --lora-scale) makes the "
                                "generation diverge (its latents are not finite): the server needs a lower "
                                "--lora-scale")  # fmt: skip
        raise ParamError("lora", f"the generation with {said} diverged (its latents are not finite): lower the "
                         "scale")  # fmt: skip
    raise DivergedError("the denoised latents are not finite (NaN or inf); the request cannot be decoded")


@torch.inference_mode()
def _timed_chunks(vae: VideoVAE, latents: torch.Tensor, result: VideoResult) -> Iterator[np.ndarray]:
    t0 = time.perf_counter()
    yield from vae.decode_frames(latents)
    result.stage_seconds["vae.decode"] = time.perf_counter() - t0
    if vae.device.type == "cuda":
        result.peak_memory_mb = torch.cuda.max_memory_allocated(vae.device) / 2**20

"""Request-configuration parity: our VideoPipeline equals diffusers' Cosmos3OmniPipeline end to end on the tiny
checkpoint (float32, CPU) for the request settings test_pipeline_parity.py and test_v2v.py leave out.

Guidance 1 (no uncond branch) and 0 (the uncond branch alone), an empty negative prompt, flow shifts other
than the checkpoint's 10 (the oracle rebuilds diffusers' scheduler with the request's shift, the tier
default included), 1 and 5 steps, I2V with sound from a downscaled image of another aspect ratio, V2V with
sound (one clean latent frame from the clip's end; every latent frame clean, so no noisy video token), a
non-integer fps with sound, negative and 64-bit seeds (diffusers' CPU generator semantics), the smallest
sizes (odd one-patch-wide latents) and T2I without CFG. Each: final latents <= 1e-4 relative L2, audio
within 1e-5, every decoded value within 1/255. Then requests at different steps, shifts, guidance scales
and conditionings, one joining two steps late, denoised in shared batches: each equals its own diffusers run.
"""

from __future__ import annotations

import numpy as np
import pytest
from diffusers_oracle import assert_frames_match, rel_l2, run_diffusers, run_diffusers_decoded

from worldserve.media.video import clip_samples
from worldserve.params import VideoParams


def _image(h: int, w: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _clip(frames: int = 12, h: int = 40, w: int = 56, seed: int = 3) -> np.ndarray:
    """A moving random clip: one random frame brightened by 9 per frame (mod 256)."""
    base = np.random.default_rng(seed).integers(0, 256, (1, h, w, 3), dtype=np.int32)
    return ((base + np.arange(frames)[:, None, None, None] * 9) % 256).astype(np.uint8)


BASE = dict(prompt="A red fox runs through a snowy forest at dawn.", negative_prompt="blurry, distorted",
            num_frames=9, height=48, width=80, num_inference_steps=3, flow_shift=10.0, seed=1234,
            generate_sound=False)  # fmt: skip

CASES = {
    "no_cfg_sound": dict(guidance_scale=1.0, generate_sound=True),
    "cfg0_empty_negative": dict(guidance_scale=0.0, negative_prompt=""),
    "shift5_5steps_negative_seed": dict(flow_shift=5.0, num_inference_steps=5, seed=-5),
    "tier_shift_1step_sound_64bit_seed": dict(
        flow_shift=None, width=64, num_inference_steps=1, generate_sound=True, seed=2**62 + 12345
    ),
    "i2v_sound_downscaled_portrait": dict(image=_image(120, 90), generate_sound=True),
    "v2v_sound_last_one_index": dict(
        video=_clip(), condition_frame_indexes=(2,), condition_video_keep="last", generate_sound=True
    ),
    "v2v_every_latent_clean_sound": dict(video=_clip(), num_frames=5, generate_sound=True),
    "fps_29.97_sound": dict(fps=29.97, generate_sound=True),
    "size_112x16": dict(width=112, height=16, num_frames=5),
    "t2i_no_cfg_80x16": dict(num_frames=1, width=80, height=16, guidance_scale=1.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_request_matches_diffusers(ours_pipeline, diffusers_pipeline, case):
    params = VideoParams(**{**BASE, **CASES[case]})
    sound = params.generate_sound
    result, state = ours_pipeline.generate(params)
    ref_latents, ref_sound, ref_frames = run_diffusers_decoded(diffusers_pipeline, params, sound=sound)
    assert rel_l2(state.latents, ref_latents.reshape(state.latents.shape)) <= 1e-4
    if sound:
        assert result.audio.shape == (2, clip_samples(params.num_frames, params.fps, 48000))
        np.testing.assert_allclose(
            result.audio, ref_sound.float().numpy()[:, : result.audio.shape[1]], atol=1e-5
        )
    else:
        assert result.audio is None and ref_sound is None
    assert_frames_match(result.frames, ref_frames)


def test_requests_batched_at_different_steps_each_match_diffusers(ours_pipeline, diffusers_pipeline):
    """What the engine does: requests of one latent shape share every forward whatever their step, step
    count, shift, guidance scale (1: no uncond row) and conditioning; a newcomer joins at a step boundary."""
    shape = dict(num_frames=9, height=48, width=80, generate_sound=True)
    requests = [
        VideoParams(prompt="A red fox runs.", negative_prompt="blurry", num_inference_steps=3, flow_shift=10.0,
                    seed=1, **shape),
        VideoParams(prompt="cat", negative_prompt="x", num_inference_steps=4, flow_shift=5.0, seed=7,
                    guidance_scale=1.0, image=_image(60, 60), **shape),
        VideoParams(prompt="A dog on a skateboard in the city at night", negative_prompt="",
                    num_inference_steps=5, flow_shift=3.0, seed=9, video=_clip(), condition_frame_indexes=(0, 2),
                    **shape),
        VideoParams(prompt="late joiner", negative_prompt="bad", num_inference_steps=3, seed=11,
                    guidance_scale=4.0, **shape),
    ]  # fmt: skip
    states = [ours_pipeline.prepare(f"r{i}", p.validate()) for i, p in enumerate(requests[:3])]
    for _ in range(2):
        ours_pipeline.denoise(states)
    states.append(ours_pipeline.prepare("r3", requests[3].validate()))
    while running := [s for s in states if not s.done]:
        ours_pipeline.denoise(running)
    for params, state in zip(requests, states, strict=True):
        ref = run_diffusers(diffusers_pipeline, params, "latent", sound=True)
        assert rel_l2(state.latents, ref.video.reshape(state.latents.shape)) <= 1e-4, state.request_id
        audio = ours_pipeline.decode(state).audio
        np.testing.assert_allclose(audio, ref.sound.float().numpy()[:, : audio.shape[1]], atol=1e-5)
        ours_pipeline.release(state)

"""L1: VideoVAE / AudioVAE against diffusers' Cosmos3OmniPipeline on the tiny checkpoint.

The oracle is the pipeline itself: its `__call__` decode path (output_type "latent" vs "np" from the same
explicit initial latents), its I2V helpers (`_preprocess_conditioning_image`, `_encode_video`,
`prepare_latents`) and `decode_sound`. Everything runs in float32 on the CPU, so most checks are exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _preprocess_conditioning_image
from PIL import Image

from worldserve.media.image import resize_center_crop
from worldserve.models.cosmos3.audio_vae import AudioVAE
from worldserve.models.cosmos3.vae import VideoVAE

HEIGHT, WIDTH = 32, 48


@pytest.fixture(scope="module")
def pipe(tiny_ckpt):
    return Cosmos3OmniPipeline.from_pretrained(str(tiny_ckpt), enable_safety_checker=False)


@pytest.fixture(scope="module")
def vae(tiny_ckpt):
    return VideoVAE.from_pretrained(tiny_ckpt / "vae")


@pytest.fixture(scope="module")
def audio_vae(tiny_ckpt):
    return AudioVAE.from_pretrained(tiny_ckpt / "sound_tokenizer")


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth-ish random RGB image, so resizing and encoding see structure rather than pure noise."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 4 + 2, w // 4 + 2, 3)).astype(np.uint8)
    return np.array(Image.fromarray(base).resize((w, h), Image.BICUBIC))


def test_latent_statistics_match_pipeline(vae, pipe):
    assert vae.latents_mean.dtype == vae.dtype == torch.float32
    assert torch.equal(vae.latents_mean, pipe._vae_latents_mean)
    assert torch.equal(vae.latents_inv_std, pipe._vae_latents_inv_std)
    assert (vae.z_dim, vae.scale_factor_spatial, vae.scale_factor_temporal) == (48, 16, 4)
    assert vae.latent_shape(189, 720, 1280) == (48, 48, 45, 80)
    assert vae.latent_shape(9, HEIGHT, WIDTH) == (48, 3, 2, 3)
    assert vae.num_decoded_frames(48) == 189
    with pytest.raises(ValueError, match="multiples of 16"):
        vae.latent_shape(9, 30, 48)


def test_decode_matches_pipeline_call(vae, pipe):
    """One pipeline call with explicit initial latents: the step-end callback hands us the final latents
    (what the pipeline then decodes), output_type "np" its decoded frames. Our decode of those latents must
    give the pipeline's frames (as uint8; a value at a .5 rounding boundary may land one level away)."""
    init = torch.randn(1, 48, 3, 2, 3, generator=torch.Generator().manual_seed(1))
    seen = {}

    def keep_latents(_pipe, _step, _t, kwargs):
        seen["latents"] = kwargs["latents"].clone()
        return {}

    expected = pipe(
        prompt="a cat", num_frames=9, height=HEIGHT, width=WIDTH, num_inference_steps=1, guidance_scale=1.0,
        latents=init, output_type="np", callback_on_step_end=keep_latents,
    ).video  # float32 (F, H, W, 3) in [0, 1]  # fmt: skip
    final = seen["latents"]
    assert final.shape == init.shape and not torch.equal(final, init)
    ours = vae.decode(final)
    assert ours.shape == (1, 9, HEIGHT, WIDTH, 3) and ours.dtype == np.uint8
    _assert_frames_within_one_level(ours[0], (expected * 255).round().astype(np.uint8))
    # [48, T, h, w] input drops the batch axis
    np.testing.assert_array_equal(vae.decode(final[0]), ours[0])


def test_decode_pixels_matches_pipeline_ops(vae, pipe):
    latents = torch.randn(2, 48, 2, 2, 3, generator=torch.Generator().manual_seed(2))
    z_raw = latents / pipe._vae_latents_inv_std.view(1, -1, 1, 1, 1) + pipe._vae_latents_mean.view(
        1, -1, 1, 1, 1
    )
    with torch.no_grad():
        expected = pipe.vae.decode(z_raw).sample.float()
    ours = vae.decode_pixels(latents)
    assert ours.shape == (2, 3, 5, HEIGHT, WIDTH)
    # The sub-pixel upsample convs sum the 3x3 taps in another order: ~1e-7 relative in float32.
    assert float((ours - expected).norm() / expected.norm()) < 1e-5
    frames = vae.decode(latents)
    assert frames.shape == (2, 5, HEIGHT, WIDTH, 3)
    post = pipe.video_processor.postprocess_video(expected, output_type="np")  # (B, F, H, W, 3) float
    _assert_frames_within_one_level(frames, (post * 255).round().astype(np.uint8))


def _assert_frames_within_one_level(ours: np.ndarray, expected: np.ndarray) -> None:
    """uint8 frames equal up to a pixel value rounded the other way (float32 noise at a .5 boundary)."""
    diff = np.abs(ours.astype(np.int16) - expected.astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (diff.max(), (diff > 0).mean())


def test_single_latent_frame_decodes_one_frame(vae):
    latents = torch.randn(48, 1, 2, 3, generator=torch.Generator().manual_seed(3))
    assert vae.decode(latents).shape == (1, HEIGHT, WIDTH, 3)


def test_decode_frames_streams_the_decode_chunk_by_chunk(vae, tiny_ckpt):
    """decode_frames: frame 0, then 4 x decode_chunk_size frames a chunk (the last shorter), the same uint8
    frames as decode; diffusers' (tiled) decode comes as one chunk; a wrong shape is refused on first read."""
    latents = torch.randn(48, 4, 2, 3, generator=torch.Generator().manual_seed(7))  # 13 frames
    vae.decode_chunk_size = 2
    try:
        whole = vae.decode(latents)
        chunks = [np.asarray(c) for c in vae.decode_frames(latents)]
    finally:
        vae.decode_chunk_size = 4
    assert [c.shape[0] for c in chunks] == [1, 8, 4]
    np.testing.assert_array_equal(np.concatenate(chunks), whole)
    tiled = VideoVAE.from_pretrained(tiny_ckpt / "vae", tiling=True)
    (one,) = [np.asarray(c) for c in tiled.decode_frames(latents)]
    np.testing.assert_array_equal(one, tiled.decode(latents))
    with pytest.raises(ValueError, match=r"latents must be \[48, T, h, w\]"):
        next(vae.decode_frames(latents[None]))
    assert vae._lock.acquire(blocking=False), "a finished or failed stream holds no lock"
    vae._lock.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the side stream of the host copies)")
def test_decode_frames_on_cuda_equals_decode(tiny_ckpt):
    """On CUDA each chunk is copied on a side stream that waits for that chunk's event, one chunk behind
    the decode: the same frames as decode(), in order, whatever the chunking."""
    vae = VideoVAE.from_pretrained(tiny_ckpt / "vae", device="cuda")
    latents = torch.randn(48, 6, 2, 3, generator=torch.Generator().manual_seed(8)).cuda()
    for chunk_size in (1, 2, 4):
        vae.decode_chunk_size = chunk_size
        chunks = list(vae.decode_frames(latents))
        assert len(chunks) == 1 + -(-5 // chunk_size) and all(isinstance(c, np.ndarray) for c in chunks)
        np.testing.assert_array_equal(np.concatenate(chunks), vae.decode(latents))


def test_encode_condition_matches_pipeline(vae, pipe):
    """I2V: our resize + encode of the repeated-frame video equals the pipeline's helpers exactly; the
    one-frame fast path equals its latent frame 0 (the only frame I2V keeps) up to float rounding (the
    encoder's first chunk is the same computation, but `quant_conv` then runs over a shorter tensor)."""
    raw = _image(45, 70)
    num_frames = 9
    cond = _preprocess_conditioning_image(raw, height=HEIGHT, width=WIDTH)  # [1, 3, H, W] in [-1, 1]
    video = torch.zeros(1, 3, num_frames, HEIGHT, WIDTH)
    video[:, :, :] = cond.unsqueeze(2)  # the pipeline repeats the image over every frame
    with torch.no_grad():
        expected = pipe._encode_video(video).contiguous().float()

    image = resize_center_crop(raw, WIDTH, HEIGHT)
    ours = vae.encode_condition(image, num_frames)
    assert ours.shape == (1, 48, 3, 2, 3) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)

    first = vae.encode_condition(image, num_frames, first_frame_only=True)
    assert first.shape == (1, 48, 1, 2, 3)
    torch.testing.assert_close(first[:, :, 0], ours[:, :, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first_frame_only", [False, True])
def test_encode_condition_matches_prepare_latents(vae, pipe, first_frame_only):
    """End to end from a PIL image: the pipeline's initial latents carry our frame-0 latent."""
    raw = _image(60, 50, seed=4)
    with torch.no_grad():
        latents, *rest = pipe.prepare_latents(
            image=Image.fromarray(raw), num_frames=9, height=HEIGHT, width=WIDTH, fps=24.0,
            generator=torch.Generator().manual_seed(0), device="cpu", dtype=torch.float32,
        )  # fmt: skip
    mask = rest[4]  # vision_condition_mask [T, 1, 1]: 1 on latent frame 0 only
    assert mask.flatten().tolist() == [1.0, 0.0, 0.0]
    ours = vae.encode_condition(resize_center_crop(raw, WIDTH, HEIGHT), 9, first_frame_only=first_frame_only)
    tol = dict(rtol=1e-5, atol=1e-6) if first_frame_only else dict(rtol=0, atol=0)
    torch.testing.assert_close(ours[:, :, 0], latents[:, :, 0], **tol)


def test_encode_condition_rejects_bad_input(vae):
    with pytest.raises(ValueError, match="uint8"):
        vae.encode_condition(np.zeros((32, 48, 3), np.float32), 9)
    with pytest.raises(ValueError, match="multiples of 16"):
        vae.encode_condition(np.zeros((30, 48, 3), np.uint8), 9)


def test_tiling_option(tiny_ckpt):
    tiled = VideoVAE.from_pretrained(tiny_ckpt / "vae", tiling=True)
    assert tiled.model.use_tiling
    latents = torch.randn(1, 48, 1, 1, 17, generator=torch.Generator().manual_seed(5))  # 272 px > 256 tile
    assert tiled.decode(latents).shape == (1, 1, 16, 272, 3)


def test_bfloat16_keeps_stats_in_vae_dtype(tiny_ckpt):
    vae16 = VideoVAE.from_pretrained(tiny_ckpt / "vae", dtype=torch.bfloat16)
    assert vae16.dtype == vae16.latents_inv_std.dtype == torch.bfloat16
    std = torch.tensor(vae16.model.config.latents_std, dtype=torch.bfloat16)
    assert torch.equal(vae16.latents_inv_std, 1.0 / std)
    frames = vae16.decode(torch.randn(48, 2, 2, 3, generator=torch.Generator().manual_seed(6)))
    assert frames.shape == (5, HEIGHT, WIDTH, 3) and frames.dtype == np.uint8


# ---- audio -------------------------------------------------------------------------------------------


def test_audio_config(audio_vae):
    assert (audio_vae.sample_rate, audio_vae.hop_size, audio_vae.latent_channels, audio_vae.channels) == (
        48000, 1920, 64, 2,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("num_frames", "fps", "samples", "latent_frames"),
    [(189, 24.0, 378000, 197), (9, 24.0, 18000, 10), (121, 24.0, 242000, 127), (17, 30000 / 1001, 27227, 15)],
)
def test_audio_length_maths(audio_vae, pipe, num_frames, fps, samples, latent_frames):
    assert audio_vae.num_samples(num_frames, fps) == samples
    assert audio_vae.latent_frames(num_frames, fps) == latent_frames
    if num_frames <= 17:  # the pipeline's own count (it also encodes a zero video, so keep it small)
        with torch.no_grad():
            _, sound, *_ = pipe.prepare_latents(
                num_frames=num_frames, height=HEIGHT, width=WIDTH, fps=fps, device="cpu",
                dtype=torch.float32, enable_sound=True, generator=torch.Generator().manual_seed(0),
            )  # fmt: skip
        assert sound.shape == (64, latent_frames)


def test_audio_decode_matches_pipeline(audio_vae, pipe):
    latents = torch.randn(64, 10, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = pipe.decode_sound(latents).float()  # [2, 19200], untrimmed
    ours = audio_vae.decode(latents, 18000)
    assert ours.shape == (2, 18000) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected[:, :18000].numpy(), rtol=0, atol=1e-6)
    assert np.abs(ours).max() <= 1.0


def test_audio_decode_batch_and_padding(audio_vae):
    latents = torch.randn(2, 64, 3, generator=torch.Generator().manual_seed(8))
    out = audio_vae.decode(latents, 6000)  # 3 * 1920 = 5760 decoded: padded with 240 zeros
    assert out.shape == (2, 2, 6000)
    assert not out[..., 5760:].any()
    np.testing.assert_allclose(out[1], audio_vae.decode(latents[1], 6000), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="latents must be"):
        audio_vae.decode(torch.zeros(2, 32, 3), 100)


def test_weight_norm_folding_is_exact(tiny_ckpt):
    unfolded = AudioVAE.from_pretrained(tiny_ckpt / "sound_tokenizer", fold=False)
    folded = AudioVAE.from_pretrained(tiny_ckpt / "sound_tokenizer")
    assert not any(hasattr(m, "weight_g") for m in folded.model.decoder.modules())
    latents = torch.randn(1, 64, 4, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(
        folded.decode_waveform(latents), unfolded.decode_waveform(latents), rtol=0, atol=0
    )

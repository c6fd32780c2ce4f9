"""Video-to-video: clip decoding (PyAV), diffusers' resize, validation, and end-to-end parity with diffusers'
Cosmos3OmniPipeline(video=..., condition_frame_indexes_vision=..., condition_video_keep=...) on the tiny
checkpoint (same settings as tests/test_pipeline_parity.py: templates off, same seed, native schedule)."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import torch
from diffusers_oracle import rel_l2, run_diffusers
from PIL import Image

from worldserve.media.image import INVALID_REFERENCE_MESSAGE, encode_png
from worldserve.media.video import encode_mp4
from worldserve.media.video_input import decode_reference, decode_video, resize_video
from worldserve.params import ParamError, VideoParams


def _clip(frames=12, h=40, w=56, seed=3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (1, h, w, 3), dtype=np.uint8)
    steps = np.arange(frames, dtype=np.int32)[:, None, None, None] * 9
    return ((base.astype(np.int32) + steps) % 256).astype(np.uint8)


def _gradient_mp4(frames: int = 9) -> tuple[bytes, np.ndarray]:
    """A smooth clip (H.264 keeps it close) with a per-frame brightness ramp, and its source frames."""
    y, x = np.mgrid[0:32, 0:48]
    src = np.stack([np.stack([x * 5, y * 7, np.full_like(x, 20 * i)], -1) for i in range(frames)]).astype(
        np.uint8
    )
    return encode_mp4(src, fps=24.0, audio=None, crf=0), src


# ---------------------------------------------------------------- decoding and resizing
def test_decode_video_first_and_last_frames():
    data, src = _gradient_mp4(9)
    first = decode_video(data, 5, "first")
    last = decode_video(data, 5, "last")
    assert first.shape == last.shape == (5, 32, 48, 3) and first.dtype == np.uint8
    assert np.abs(first.astype(int) - src[:5]).mean() < 3
    assert np.abs(last.astype(int) - src[-5:]).mean() < 3
    assert decode_video(data, 100, "first").shape[0] == 9


def test_decode_reference_sniffs_image_first_then_video_and_rejects_garbage():
    png = encode_png(np.zeros((8, 8, 3), np.uint8))
    image, video = decode_reference(png, max_frames=5)
    assert image is not None and video is None
    data, _ = _gradient_mp4(6)
    image, video = decode_reference(data, max_frames=5)
    assert image is None and video.shape == (5, 32, 48, 3)
    for bad in (b"", b"not a video at all" * 10, data[:40]):
        with pytest.raises(ParamError) as err:
            decode_reference(bad, max_frames=5)
        assert err.value.param == "input_reference" and err.value.message == INVALID_REFERENCE_MESSAGE


def test_an_image_pillow_refuses_is_not_a_one_frame_video():
    """A truncated JPEG: Pillow refuses it, FFmpeg reads it (jpeg_pipe) as a one-frame clip. As an upload it is
    an invalid image (not a V2V reference); sent as a video_reference, the video decoder still reads it."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), np.uint8)).save(buf, "JPEG")
    cut = buf.getvalue()[:-40]
    with pytest.raises(ParamError) as err:
        decode_reference(cut, max_frames=5)
    assert err.value.message == INVALID_REFERENCE_MESSAGE
    assert decode_video(cut, 5, param="video_reference").shape == (1, 32, 48, 3)


def rotated_mp4(frames: np.ndarray, matrix: tuple[int, ...]) -> bytes:
    """`frames` as an MP4 whose track header carries the display matrix `matrix` (16.16 fixed point, as a phone
    writes it: a portrait clip is stored landscape with the matrix turning it upright on display)."""
    data = bytearray(encode_mp4(frames, fps=24.0, audio=None, crf=0))
    identity = struct.pack(">9i", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
    at = data.index(identity, data.index(b"tkhd"))
    data[at : at + 36] = struct.pack(">9i", *matrix)
    return bytes(data)


ROTATE_90 = (0, 0x10000, 0, -0x10000, 0, 0, 0, 0, 0x40000000)
"""A phone's portrait clip: shown turned 90 degrees clockwise (ffprobe: "rotation of -90.00 degrees")."""
ROTATE_180 = (-0x10000, 0, 0, 0, -0x10000, 0, 0, 0, 0x40000000)


def _marked_clip(frames: int = 6) -> np.ndarray:
    """32x48 (HxW) frames: the top-left quarter red, the rest blue (large flat areas H.264 keeps)."""
    clip = np.zeros((frames, 32, 48, 3), np.uint8)
    clip[..., 2] = 255
    clip[:, :16, :24] = (255, 0, 0)
    return clip


def test_a_clips_display_rotation_is_applied():
    """A phone's portrait video (stored landscape, a display matrix turning it) decodes upright, as FFmpeg's
    players, OpenCV (vLLM's video loader) and diffusers' load_video show it: V2V had generated from (and, with
    no size, at the aspect ratio of) the sideways frames."""
    clip = _marked_clip()
    upright = decode_video(rotated_mp4(clip, ROTATE_90), 5)
    assert upright.shape == (5, 48, 32, 3)  # portrait
    # turned clockwise: the stored top-left corner is now the top-right one
    assert (upright[:, :12, -8:, 0] > 200).all() and (upright[:, :12, -8:, 2] < 60).all()
    assert (upright[:, -12:, :8, 2] > 200).all()
    flipped = decode_video(rotated_mp4(clip, ROTATE_180), 5, "last")
    assert flipped.shape == (5, 32, 48, 3)
    assert (flipped[:, -8:, -12:, 0] > 200).all() and (flipped[:, :8, :12, 2] > 200).all()
    _, video = decode_reference(rotated_mp4(clip, ROTATE_90), max_frames=5)
    assert video is not None and video.shape == (5, 48, 32, 3)


@pytest.mark.parametrize("size", [(48, 64), (32, 48), (80, 48), (32, 64)])
def test_resize_video_equals_diffusers_video_processor(size):
    from diffusers.video_processor import VideoProcessor

    height, width = size
    clip = _clip(3, 37, 61)
    ours_pipeline = resize_video(clip, width, height)
    proc = VideoProcessor(vae_scale_factor=16, resample="bilinear")
    ref = proc.preprocess_video([Image.fromarray(f) for f in clip], height=height, width=width)  # [1,3,F,H,W]
    mine = torch.from_numpy(ours_pipeline).permute(3, 0, 1, 2)[None].float() / 255.0 * 2.0 - 1.0
    torch.testing.assert_close(mine, ref, atol=0, rtol=0)


# ---------------------------------------------------------------- validation
def _params(**kw) -> VideoParams:
    base = dict(prompt="a fox", num_frames=9, height=48, width=64, video=_clip(6))
    return VideoParams(**{**base, **kw})


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(condition_frame_indexes=(0, 3)), "condition_frame_indexes"),
        (dict(condition_frame_indexes=()), "condition_frame_indexes"),
        (dict(condition_frame_indexes=(-1,)), "condition_frame_indexes"),
        (dict(condition_video_keep="middle"), "condition_video_keep"),
        (dict(image=np.zeros((8, 8, 3), np.uint8)), "video"),
        (dict(num_frames=1), "video"),
        (dict(video=np.zeros((2, 8, 8), np.uint8)), "video"),
        (dict(video=np.zeros((0, 8, 8, 3), np.uint8)), "video"),
    ],
)
def test_validation_errors(kw, param):
    with pytest.raises(ParamError) as err:
        _params(**kw).validate()
    assert err.value.param == param


def test_validation_accepts_last_latent_index():
    _params(condition_frame_indexes=(2,)).validate()


# ---------------------------------------------------------------- parity with diffusers


CASES = {
    "first_default": dict(video=_clip(12), condition_frame_indexes=(0, 1)),
    "last": dict(video=_clip(12, seed=5), condition_frame_indexes=(0, 1), condition_video_keep="last"),
    "short_clip_gap": dict(video=_clip(3, 48, 64), condition_frame_indexes=(0, 2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_v2v_final_latents_and_frames_match_diffusers(ours_pipeline, diffusers_pipeline, case):
    params = VideoParams(
        prompt="A red fox runs through a snowy forest at dawn.",
        negative_prompt="blurry, distorted",
        num_frames=9,
        height=48,
        width=64,
        num_inference_steps=3,
        flow_shift=10.0,
        seed=1234,
        generate_sound=False,
        **CASES[case],
    )
    result, state = ours_pipeline.generate(params)
    assert state.clean_frames == tuple(sorted(params.condition_frame_indexes))
    ref = run_diffusers(diffusers_pipeline, params, "latent").video.reshape(state.latents.shape)
    assert rel_l2(state.latents, ref) <= 1e-4
    for i in state.clean_frames:  # the conditioning frames come out as they went in
        assert rel_l2(state.latents[:, i], ref[:, i]) <= 1e-5
    ref_frames = np.asarray(run_diffusers(diffusers_pipeline, params, "np").video)
    if ref_frames.ndim == 5:
        ref_frames = ref_frames[0]
    assert result.frames.shape == (9, 48, 64, 3)
    assert np.abs(result.frames.astype(np.float64) / 255.0 - ref_frames).mean() <= 1 / 255


def test_keep_last_differs_from_first(ours_pipeline):
    base = dict(prompt="a cat", num_frames=9, height=32, width=48, num_inference_steps=1, video=_clip(12))
    a = ours_pipeline.prepare("a", VideoParams(**base).validate())
    b = ours_pipeline.prepare("b", VideoParams(**base, condition_video_keep="last").validate())
    assert not torch.equal(a.latents[:, 0], b.latents[:, 0])
    assert torch.equal(a.latents[:, 2:], b.latents[:, 2:])  # the same noise on the generated frames


def test_v2v_defaults_to_vllm_omnis_flow_shift_at_every_size():
    """vLLM-Omni's COSMOS3_V2V_DEFAULT_FLOW_SHIFT (serving-api.md §4.2, §4.4): a video-to-video request without
    a flow_shift runs at 10.0 at any size (it had taken the resolution's training shift, 3 at 256p); T2V / I2V
    keep the resolution's, and a request's own shift wins."""
    clip = np.zeros((5, 96, 160, 3), np.uint8)
    small = dict(prompt="a fox", width=160, height=96, num_frames=9)
    assert VideoParams(**small, video=clip).resolved_flow_shift() == 10.0
    assert VideoParams(**small).resolved_flow_shift() == 3.0
    assert VideoParams(**small, image=clip[0]).resolved_flow_shift() == 3.0
    assert VideoParams(**small, video=clip, flow_shift=4.0).resolved_flow_shift() == 4.0

"""L0: media encoding and image inputs (no model): MP4 mux round trips through PyAV, PNG, npz, codec-option
validation, image decoding errors, and the conditioning resize against diffusers' own function."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _preprocess_conditioning_image
from media_probe import probe_mp4
from PIL import Image

from worldserve.media import fragments
from worldserve.media.audio import fit_audio
from worldserve.media.fragments import encode_fragments
from worldserve.media.frame_stream import FrameStream
from worldserve.media.image import INVALID_REFERENCE_MESSAGE, decode_image, encode_png, resize_center_crop
from worldserve.media.video import clip_samples, encode_mp4, frame_rate, h264_options, write_npz
from worldserve.params import ParamError

SR = 48000


def _frames(num_frames: int, height: int = 32, width: int = 48) -> np.ndarray:
    """Smooth moving gradients (moderately saturated): compressible, so a crf-18 round trip stays close."""
    y, x = np.mgrid[0:height, 0:width]
    out = np.empty((num_frames, height, width, 3), np.uint8)
    for t in range(num_frames):
        out[t, ..., 0] = 40 + (x * 150 // max(width - 1, 1) + 4 * t) % 170
        out[t, ..., 1] = 40 + y * 150 // max(height - 1, 1)
        out[t, ..., 2] = 110
    return out


def _sine(num_samples: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(num_samples) / SR
    return np.stack([0.5 * np.sin(2 * np.pi * freq * t), 0.3 * np.sin(2 * np.pi * 2 * freq * t)]).astype(
        np.float32
    )


@pytest.mark.parametrize("num_frames", [5, 9, 17])
def test_mp4_round_trip_with_audio(num_frames):
    n = clip_samples(num_frames, 24.0, SR)
    data = encode_mp4(_frames(num_frames), 24.0, _sine(n))
    p = probe_mp4(data, decode=True)
    assert data[4:8] == b"ftyp" and "mp4" in p.container_format
    assert (p.video_codec, p.pix_fmt, p.width, p.height) == ("h264", "yuv420p", 48, 32)
    assert p.num_frames == num_frames and p.fps == 24
    assert p.video_duration == pytest.approx(num_frames / 24)
    assert p.colorspace == 1  # tagged BT.709
    assert (p.audio_codec, p.sample_rate, p.channels) == ("aac", SR, 2)
    assert p.first_audio_pts == 0
    assert abs(p.audio_duration - p.video_duration) <= 1e-3  # MP4 edit lists are in milliseconds
    assert n <= p.audio_samples_decoded < n + 1024  # only the last AAC frame's padding is extra
    # pixels survive crf 18 + 4:2:0 chroma subsampling (colour accuracy: test_mp4_colours_survive)
    assert np.abs(p.frames.astype(int) - _frames(num_frames)).mean() < 4.0


def test_mp4_colours_survive():
    """Flat saturated patches come back within a few levels: the BT.709 conversion and the BT.709 tag agree
    (a BT.601/BT.709 mismatch moves saturated green by about 40 levels)."""
    colours = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [250, 200, 30], [128, 128, 128], [20, 20, 20]])
    frames = np.zeros((3, 32, 96, 3), np.uint8)
    for k, colour in enumerate(colours):
        frames[:, :, 16 * k : 16 * (k + 1)] = colour
    decoded = probe_mp4(encode_mp4(frames, 24.0), decode=True).frames
    centres = decoded[:, 8:24, [16 * k + 8 for k in range(len(colours))]].astype(int)  # (F, 16, 6, 3)
    assert np.abs(centres - colours[None, None]).max() <= 4


def test_audio_is_aligned_at_pts_zero():
    """The AAC priming delay is hidden by the edit list: decoded audio lines up with the input sample for
    sample (a shift by the 1024-sample priming would put the 440 Hz sine far out of phase)."""
    n = clip_samples(17, 24.0, SR)
    audio = _sine(n)
    p = probe_mp4(encode_mp4(_frames(17), 24.0, audio), decode=True)

    def snr(lag: int) -> float:
        decoded = p.audio[:, 2048 + lag : 2048 + lag + 20000]
        ref = audio[:, 2048 : 2048 + 20000]
        return float(10 * np.log10((ref**2).sum() / ((decoded - ref) ** 2).sum()))

    assert snr(0) > 20.0, snr(0)
    assert snr(0) > max(snr(-1), snr(1), snr(-1024), snr(1024))


@pytest.mark.parametrize(
    ("fps", "expected"),
    [(30000 / 1001, Fraction(30000, 1001)), (23.976, Fraction(2997, 125)), (Fraction(24000, 1001), None),
     (12.5, Fraction(25, 2))],
)  # fmt: skip
def test_mp4_non_integer_fps(fps, expected):
    expected = expected or fps
    assert frame_rate(fps) == expected
    n = clip_samples(9, float(fps), SR)
    p = probe_mp4(encode_mp4(_frames(9), fps, _sine(n)))
    assert p.num_frames == 9
    assert p.fps == expected
    assert p.video_duration == pytest.approx(float(9 / expected), abs=1e-4)
    assert abs(p.audio_duration - p.video_duration) <= 1e-3


def test_threaded_yuv_conversion_keeps_order_and_bytes(monkeypatch):
    """yuv_frames' worker threads give the serial conversion's planes in frame order (a window smaller than
    the clip, chunks of several sizes), and encode_mp4 writes the same bytes with them as without."""
    from worldserve.media import video

    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (11, 32, 48, 3), dtype=np.uint8)
    serial = [f.to_ndarray() for f in video.yuv_frames([frames], workers=1)]
    threaded = [f.to_ndarray() for f in video.yuv_frames([frames[:1], frames[1:6], frames[6:]], workers=2)]
    assert len(threaded) == len(frames)
    for a, b in zip(serial, threaded, strict=True):
        np.testing.assert_array_equal(a, b)
    threaded_mp4 = encode_mp4(frames, 8.0)
    monkeypatch.setattr(video, "conversion_workers", lambda: 1)
    assert encode_mp4(frames, 8.0) == threaded_mp4


def test_mp4_without_audio_and_single_frame():
    p = probe_mp4(encode_mp4(_frames(1, 16, 16), 24.0))
    assert (p.num_frames, p.width, p.height, p.audio_codec) == (1, 16, 16, None)


@pytest.mark.parametrize("extra", [-5000, 0, 1919, 7000])
def test_mp4_audio_keeps_its_own_length(extra):
    """The muxer keeps the track as long as it is (the pipeline fits it: the clip's length, or the request's
    sound_duration), shorter or longer than the video."""
    n = clip_samples(9, 24.0, SR)
    p = probe_mp4(encode_mp4(_frames(9), 24.0, _sine(n + extra)), decode=True)
    assert abs(p.audio_duration - (n + extra) / SR) <= 1e-3 and abs(p.video_duration - 9 / 24) <= 1e-3
    assert n + extra <= p.audio_samples_decoded < n + extra + 1024


def test_mp4_mono_audio():
    p = probe_mp4(encode_mp4(_frames(5), 24.0, _sine(10000)[:1]))
    assert p.channels == 1


def test_fit_audio():
    audio = np.array([[0.5, 2.0, -3.0, np.nan]], np.float32)
    np.testing.assert_array_equal(fit_audio(audio, 6), [[0.5, 1.0, -1.0, 0.0, 0.0, 0.0]])
    assert fit_audio(audio, 2).shape == (1, 2)
    with pytest.raises(ValueError, match="channels"):
        fit_audio(np.zeros((3, 10), np.float32), 10)


@pytest.mark.parametrize(
    ("frames", "match"),
    [(np.zeros((3, 32, 47, 3), np.uint8), "even"), (np.zeros((3, 31, 48, 3), np.uint8), "even"),
     (np.zeros((3, 32, 48, 3), np.float32), "uint8"), (np.zeros((0, 32, 48, 3), np.uint8), "uint8"),
     (np.zeros((32, 48, 3), np.uint8), "uint8")],
)  # fmt: skip
def test_mp4_rejects_bad_frames(frames, match):
    with pytest.raises(ValueError, match=match):
        encode_mp4(frames, 24.0)


@pytest.mark.parametrize("fps", [0.0, -24.0, float("inf"), float("nan")])
def test_mp4_rejects_bad_fps(fps):
    with pytest.raises(ValueError, match="fps"):
        encode_mp4(_frames(2), fps)


def test_codec_options_defaults_and_overrides():
    assert h264_options(None) == {"preset": "ultrafast", "threads": "0", "crf": "18"}
    opts = h264_options({"preset": "medium", "threads": 2, "crf": "23", "tune": "film", "g": 48.0}, crf=20)
    assert opts == {"preset": "medium", "threads": "2", "crf": "23", "tune": "film", "g": "48"}
    p = probe_mp4(
        encode_mp4(_frames(5), 24.0, codec_options={"preset": "veryfast", "bf": 2, "profile": "high"})
    )
    assert p.num_frames == 5


@pytest.mark.parametrize(
    "options",
    [{"x264-params": "keyint=1"}, {"filter_complex": "x"}, {"preset": "ultrafast -y"}, {"preset": 3},
     {"threads": "-1"}, {"threads": "1e9"}, {"crf": 52}, {"crf": True}, {"g": 0}, {"tune": ["film"]},
     ["preset"], {"bf": "²"}, {"g": "٣"}],
)  # fmt: skip
def test_codec_options_reject_anything_else(options):
    with pytest.raises(ParamError) as err:
        encode_mp4(_frames(2), 24.0, codec_options=options)
    assert err.value.param == "video_codec_options"


@pytest.mark.parametrize("profile", ["baseline", "main", "high"])
def test_a_lossless_encode_with_a_profile_is_refused_up_front(profile):
    """x264 cannot open crf 0 (quality 'lossless') in these profiles; the request learns it at submit,
    naming video_codec_options, not as a failed job after the GPU work. crf >= 1 with the profile encodes,
    as does crf 0 without one (x264 then picks High 4:4:4 Predictive)."""
    for crf, options in ((0, {"profile": profile}), (18, {"profile": profile, "crf": 0})):
        with pytest.raises(ParamError, match="losslessly") as err:
            h264_options(options, crf)
        assert err.value.param == "video_codec_options"
    assert probe_mp4(encode_mp4(_frames(3), 24.0, crf=1, codec_options={"profile": profile})).num_frames == 3
    assert probe_mp4(encode_mp4(_frames(3), 24.0, crf=0)).num_frames == 3


def test_png_round_trip():
    frame = _frames(1, 48, 80)
    for inp in (frame, frame[0]):
        data = encode_png(inp)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        np.testing.assert_array_equal(np.array(Image.open(io.BytesIO(data))), frame[0])
    with pytest.raises(ValueError):
        encode_png(frame[0, ..., :2])


def test_write_npz_is_lossless(tmp_path):
    frames, audio = _frames(5), _sine(1000)
    path = write_npz(tmp_path / "out.npz", frames, audio, 30000 / 1001, SR)
    with np.load(path) as z:
        np.testing.assert_array_equal(z["frames"], frames)
        np.testing.assert_array_equal(z["audio"], audio)
        assert float(z["fps"]) == 30000 / 1001 and int(z["sample_rate"]) == SR
    with np.load(write_npz(tmp_path / "v.npz", frames, None, 24.0)) as z:
        assert "audio" not in z.files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.npz", "v.npz"]


# ---- image inputs ----------------------------------------------------------------------------------------


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_decode_image_formats():
    rgb = _frames(1, 20, 30)[0]
    np.testing.assert_array_equal(decode_image(_encode(Image.fromarray(rgb), "PNG")), rgb)
    rgba = np.concatenate([rgb, np.full((20, 30, 1), 7, np.uint8)], axis=2)
    np.testing.assert_array_equal(decode_image(_encode(Image.fromarray(rgba), "PNG")), rgb)
    gray = decode_image(_encode(Image.fromarray(rgb[..., 1]), "PNG"))
    assert gray.shape == (20, 30, 3) and gray.dtype == np.uint8
    assert decode_image(_encode(Image.fromarray(rgb), "JPEG", quality=95)).shape == (20, 30, 3)


def test_decode_image_composites_rgba_over_the_chat_background():
    """I2V references drop alpha as diffusers does; chat images are composited over white, as vLLM's
    ImageMediaIO does (a transparent pixel is the background, not the colour hidden under it), LA and
    palette transparency too (as transformers' processor)."""
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[..., 0] = 255  # red everywhere; alpha 0, 255, 128, 255
    rgba[..., 3] = np.array([[0, 255], [128, 255]])
    data = _encode(Image.fromarray(rgba, "RGBA"), "PNG")
    np.testing.assert_array_equal(decode_image(data), np.broadcast_to([255, 0, 0], (2, 2, 3)))
    chat = decode_image(data, rgba_background=(255, 255, 255))
    assert chat[0, 0].tolist() == [255, 255, 255] and chat[0, 1].tolist() == [255, 0, 0]
    assert chat[1, 0, 0] == 255 and 120 <= chat[1, 0, 1] <= 135  # half: between white and red
    # LA and palette transparency too, as transformers' Qwen3-VL processor flattens them (the model's own
    # preprocessing; vLLM flattens RGBA only, and the hidden colour of a transparent LA pixel reached the ViT)
    grey = np.stack([np.full((2, 2), 9, np.uint8), np.array([[0, 255], [255, 255]], np.uint8)], -1)
    la = _encode(Image.fromarray(grey, "LA"), "PNG")
    assert decode_image(la)[0, 0].tolist() == [9, 9, 9]
    flat = decode_image(la, rgba_background=(255, 255, 255))
    assert flat[0, 0].tolist() == [255, 255, 255] and flat[0, 1].tolist() == [9, 9, 9]
    palette = Image.fromarray(np.array([[0, 1], [1, 1]], np.uint8), "P")
    palette.putpalette([10, 20, 30, 200, 0, 0])
    buf = io.BytesIO()
    palette.save(buf, format="PNG", transparency=0)  # (palette entry 0 transparent: a tRNS chunk)
    flat = decode_image(buf.getvalue(), rgba_background=(255, 255, 255))
    assert flat[0, 0].tolist() == [255, 255, 255] and flat[0, 1].tolist() == [200, 0, 0]
    assert decode_image(buf.getvalue())[0, 0].tolist() == [10, 20, 30]  # (I2V references: alpha dropped)
    from worldserve.api.chat_media import part  # a chat's image_url part is decoded the chat's way
    from worldserve.api.chat_messages import ContentPart
    from worldserve.chat_params import VideoSampling

    url = "data:image/png;base64," + base64.b64encode(data).decode()
    got = part(ContentPart(type="image_url", image_url={"url": url}), "messages[0].content[0]", None,
               VideoSampling())  # fmt: skip
    np.testing.assert_array_equal(got.image, chat)


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_decode_image_scales_16_bit_grayscale(fmt):
    """A 16-bit grayscale image (Pillow's I;16) is scaled to 8 bits: Pillow's convert("RGB") clips its values
    at 255, so an I2V reference of a 16-bit gradient conditioned on a white frame (an audit's finding)."""
    wide = np.tile(np.array([0, 128, 257, 32768, 65535], np.uint16), (3, 1))  # [3, 5]
    img = Image.fromarray(wide)
    assert img.mode.startswith("I;16")
    out = decode_image(_encode(img, fmt))
    assert out.shape == (3, 5, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out[0, :, 0], [0, 0, 1, 128, 255])
    assert (out == out[..., :1]).all()  # grey: the three channels equal
    np.testing.assert_array_equal(decode_image(_encode(img, fmt), rgba_background=(255, 255, 255)), out)
    if fmt == "PNG":  # a 16-bit PGM opens as mode "I" (as a 16-bit PNG did before Pillow 10.3)
        pgm = b"P5\n5 3\n65535\n" + wide.astype(">u2").tobytes()
        np.testing.assert_array_equal(decode_image(pgm), out)


def test_decode_image_applies_exif_orientation():
    img = Image.fromarray(_frames(1, 20, 30)[0])
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    out = decode_image(_encode(img, "JPEG", exif=exif.tobytes()))
    assert out.shape == (30, 20, 3)


@pytest.mark.parametrize("data", [b"", b"not an image at all", b"\x00" * 100, b"GIF89a" + b"\x00" * 10])
def test_decode_image_rejects_non_images(data):
    with pytest.raises(ParamError) as err:
        decode_image(data)
    assert err.value.param == "input_reference"
    assert str(err.value) == INVALID_REFERENCE_MESSAGE


@pytest.mark.parametrize("name", ["dds", "spider", "tiff"])
def test_decode_image_rejects_files_that_break_pillow(name):
    """Mutated files (found by fuzzing the API) on which Pillow's decoders raise NotImplementedError,
    AttributeError or TypeError rather than an OSError: a 400 naming the part, like any bad image."""
    data = (Path(__file__).parent / "data" / "bad_images" / f"{name}.bin").read_bytes()
    with pytest.raises(ParamError) as err:
        decode_image(data, param="messages[0].content[0].image_url")
    assert err.value.param == "messages[0].content[0].image_url"


def test_decode_image_rejects_truncated_file():
    data = _encode(Image.fromarray(_frames(1, 64, 64)[0]), "PNG")
    with pytest.raises(ParamError):
        decode_image(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("src", "size"),
    [((45, 70), (48, 32)), ((37, 50), (48, 32)), ((100, 60), (48, 32)), ((20, 30), (96, 64)),
     ((32, 48), (48, 32)), ((333, 777), (320, 192)), ((31, 17), (64, 96)), ((720, 1280), (832, 480)),
     ((64, 64), (320, 192)), ((1000, 1500), (320, 192))],
)  # fmt: skip
def test_resize_center_crop_matches_diffusers(src, size):
    """Compare the [-1, 1] tensors the pipeline feeds the VAE: ours (uint8 -> /127.5 - 1) vs diffusers'
    `_preprocess_conditioning_image` on the same uint8 image, given as numpy and as PIL."""
    (h, w), (width, height) = src, size
    image = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    ours = resize_center_crop(image, width, height)
    assert ours.shape == (height, width, 3) and ours.dtype == np.uint8
    ours_t = torch.from_numpy(ours).permute(2, 0, 1).float() / 127.5 - 1.0
    for ref_input in (image, Image.fromarray(image)):
        ref = _preprocess_conditioning_image(ref_input, height=height, width=width)[0]
        torch.testing.assert_close(ours_t, ref, rtol=0, atol=0)


def test_resize_center_crop_accepts_views():
    image = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    view = image[::-1, 5:55]
    view.flags.writeable = False
    np.testing.assert_array_equal(resize_center_crop(view, 48, 32), resize_center_crop(view.copy(), 48, 32))


def test_resize_center_crop_rejects_bad_input():
    with pytest.raises(ValueError):
        resize_center_crop(np.zeros((10, 10, 3), np.float32), 16, 16)
    with pytest.raises(ValueError):
        resize_center_crop(np.zeros((10, 10, 3), np.uint8), 0, 16)


def test_an_image_far_from_the_videos_aspect_ratio_is_refused_before_its_resize():
    """Covering 64x64 with a 1 x 80,000 image would resize it to 64 x 5,120,000 (a 4 GB float32 copy from a
    312-byte PNG): VideoParams refuses it, naming the reference, while an image at the bound still passes."""
    from worldserve.media.image import max_pixels
    from worldserve.params import ParamError, VideoParams

    strip = np.zeros((80_000, 1, 3), np.uint8)  # [H, W, 3]
    with pytest.raises(ParamError, match="would be resized to 64x5120000") as err:
        VideoParams(prompt="x", width=64, height=64, num_frames=5, image=strip).validate()
    assert err.value.param == "image"
    named = VideoParams(prompt="x", width=64, height=64, num_frames=5, image=strip)
    with pytest.raises(ParamError) as err:
        named.validate_as({"image": "image_reference"})
    assert err.value.param == "image_reference"
    tallest = max_pixels() // 64 // 64  # the tallest 1-pixel-wide image whose cover resize stays in bounds
    VideoParams(
        prompt="x", width=64, height=64, num_frames=5, image=np.zeros((tallest, 1, 3), np.uint8)
    ).validate()
    with pytest.raises(ParamError):
        VideoParams(
            prompt="x", width=64, height=64, num_frames=5, image=np.zeros((tallest + 1, 1, 3), np.uint8)
        ).validate()


def test_media_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import worldserve.media.video, worldserve.media.image, worldserve.media.audio\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _decode_chunks(frames: np.ndarray) -> FrameStream:
    """`frames` as the VAE hands them out: frame 0, then 16 a chunk."""
    chunks = [frames[:1]] + [frames[s : s + 16] for s in range(1, len(frames), 16)]
    return FrameStream(len(frames), frames.shape[1], frames.shape[2], iter(chunks))


@pytest.mark.parametrize("num_frames", [1, 17, 41])
def test_fragments_join_into_the_same_video_as_encode_mp4(num_frames):
    """encode_fragments: an init segment, then whole fragments (each starting with its chunk's keyframe)
    once the next chunk is out; the joined parts decode to the frames and the audio encode_mp4's file has
    (the init segment's audio edit list trims AAC's 1,024 leading samples of encoder delay, as the file's)."""
    frames, n = _frames(num_frames), clip_samples(num_frames, 24.0, SR)
    parts = list(
        encode_fragments(_decode_chunks(frames), 24.0, _sine(n), codec_options={"tune": "zerolatency"})
    )
    data = b"".join(part for part, _ in parts)
    assert parts[0][0][4:8] == b"ftyp" and parts[0][1] == 0
    assert all(part[4:8] == b"moof" for part, _ in parts[1:])
    chunk_sizes = [1] + [min(16, num_frames - s) for s in range(1, num_frames, 16)]
    assert [frames_in for _, frames_in in parts[1:]] == chunk_sizes
    fragmented, plain = (
        probe_mp4(data, decode=True),
        probe_mp4(encode_mp4(frames, 24.0, _sine(n)), decode=True),
    )
    assert (fragmented.num_frames, fragmented.fps, fragmented.width, fragmented.height) == (
        num_frames,
        24,
        48,
        32,
    )
    assert (fragmented.audio_codec, fragmented.sample_rate, fragmented.channels) == ("aac", SR, 2)
    assert np.abs(fragmented.frames.astype(int) - plain.frames.astype(int)).mean() < 2.0
    assert np.abs(fragmented.frames.astype(int) - frames).mean() < 4.0
    assert fragmented.audio_samples_decoded == plain.audio_samples_decoded
    assert np.abs(fragmented.audio[:, :n] - plain.audio[:, :n]).max() < 1e-3


def test_fragments_have_no_b_frames_and_count_frames_from_their_bytes():
    """A caller's B-frames (or a slow preset's) are turned off: the first frame shows at time 0, as the
    audio starts; the frames a part holds are read from its `trun` boxes, also when fed byte by byte."""
    n = 41
    options = {"preset": "medium", "bf": 3, "tune": "film", "threads": 1}
    parts = list(encode_fragments(_decode_chunks(_frames(n)), 24.0, _sine(clip_samples(n, 24.0, SR)),
                                  codec_options=options))  # fmt: skip
    data = b"".join(part for part, _ in parts)
    assert sum(frames_in for _, frames_in in parts) == n  # (x264's lookahead holds medium's to the end)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        packets = [p for p in container.demux(stream) if p.size]
    assert all(p.pts == p.dts for p in packets)  # no reordering: no B-frames
    assert min(p.pts for p in packets) * stream.time_base == 0
    counter = fragments._VideoSamples()
    assert sum(counter.count(data[i : i + 7]) for i in range(0, len(data), 7)) == n


def test_fragments_without_audio_or_zerolatency_and_their_checks():
    """x264's frame threads hold packets back: parts come later, and count the frames they really hold."""
    parts = list(encode_fragments(_decode_chunks(_frames(33)), 8.0, codec_options={"threads": 4}))
    assert sum(frames_in for _, frames_in in parts) == 33
    probe = probe_mp4(b"".join(part for part, _ in parts))
    assert probe.num_frames == 33 and probe.audio_codec is None
    with pytest.raises(ParamError, match="video_codec_options"):
        next(encode_fragments(_decode_chunks(_frames(5)), 8.0, codec_options={"tune": "loud"}))
    with pytest.raises(ValueError, match="even frame sizes"):
        next(encode_fragments(_decode_chunks(_frames(5, height=31)), 8.0))


@pytest.mark.parametrize(
    ("num_frames", "fps", "samples"),
    [
        (41, 10.0, 196_800),
        (189, 10.0, 907_200),
        (69, 30.0, 110_400),
        (5, 7.0, 34_286),
        (13, 29.97, 20_821),
        (189, 24.0, 378_000),
        (17, 30000 / 1001, 27_227),
    ],
)
def test_the_audio_track_is_as_long_as_the_video_to_the_sample(num_frames, fps, samples):
    """round(duration x 48 kHz) at the track's exact rate (serving-api.md §4.4): floats had cut whole lengths
    one sample short (41 @ 10 fps: 196799) and truncated the others (5 @ 7 fps: 34285)."""
    assert clip_samples(num_frames, fps, SR) == samples

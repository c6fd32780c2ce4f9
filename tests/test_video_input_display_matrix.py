"""A clip's display matrix, its mirror included, applied as FFmpeg's autorotate applies it (media/display_matrix.py)
on every path that reads a video: V2V decoding, an upload's image-then-video sniffing, a job's reference read
again after a restart, a video_reference through the API, and a chat video.

The clips are real MP4s whose track header carries the matrix, built as FFmpeg builds one
(`av_display_rotation_set`, then `av_display_matrix_flip` for a mirror); the expected frames are the stored ones
put through the very filters fftools' autorotate inserts for that matrix (PyAV's libavfilter graph)."""

from __future__ import annotations

import base64
import io
import math
import struct
from fractions import Fraction

import av
import numpy as np
import pytest

from worldserve.api.video_inputs import build_inputs
from worldserve.chat_params import VideoSampling
from worldserve.engine.job_files import inputs_from_record, inputs_record
from worldserve.engine.request import EncodeOptions
from worldserve.media.display_matrix import matrix_orientation
from worldserve.media.video import encode_mp4
from worldserve.media.video_input import decode_chat_video, decode_reference, decode_video


def rotation_matrix(clockwise_degrees: float) -> list[int]:
    """libavutil's av_display_rotation_set: a pure clockwise turn, 16.16 fixed point (2.30 for w)."""
    radians = -math.radians(clockwise_degrees)
    cos, sin = math.cos(radians), math.sin(radians)
    fixed = [round(cos * 65536), round(-sin * 65536), 0, round(sin * 65536), round(cos * 65536), 0]
    return [*fixed, 0, 0, 1 << 30]


def flipped(matrix: list[int], hflip: bool, vflip: bool = False) -> list[int]:
    """libavutil's av_display_matrix_flip: the first (hflip) or second (vflip) column negated."""
    signs = (-1 if hflip else 1, -1 if vflip else 1, 1)
    return [value * signs[i % 3] for i, value in enumerate(matrix)]


def mp4_with_matrix(frames: np.ndarray, matrix: list[int]) -> bytes:
    """`frames` as an MP4 whose track header (tkhd) holds `matrix`, as a phone or `ffmpeg -display_hflip`
    writes it (big-endian, in the layout of FFmpeg's display matrix)."""
    data = bytearray(encode_mp4(frames, fps=24.0, audio=None, crf=0))
    identity = struct.pack(">9i", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
    at = data.index(identity, data.index(b"tkhd"))
    data[at : at + 36] = struct.pack(">9i", *matrix)
    return bytes(data)


def marked_clip(frames: int = 6) -> np.ndarray:
    """32x48 (HxW): the top-left quarter red, the rest blue (flat areas H.264 keeps at crf 0)."""
    clip = np.zeros((frames, 32, 48, 3), np.uint8)
    clip[..., 2] = 255
    clip[:, :16, :24] = (255, 0, 0)
    return clip


AUTOROTATE = [
    # (clockwise turn, mirrored): the filters fftools/ffmpeg_filter.c inserts for that matrix
    ((0, False), []),
    ((0, True), [("hflip", None)]),  # get_rotation reads 180: hflip (a < 0), no vflip (d > 0)
    ((90, False), [("transpose", "clock")]),
    ((90, True), [("transpose", "cclock_flip")]),  # (c > 0)
    ((180, False), [("hflip", None), ("vflip", None)]),
    ((180, True), [("vflip", None)]),  # get_rotation reads 0, d < 0
    ((270, False), [("transpose", "cclock")]),
    ((270, True), [("transpose", "clock_flip")]),  # (c < 0)
]


def ffmpeg_shown(stored: np.ndarray, filters: list[tuple[str, str | None]]) -> np.ndarray:
    """uint8 RGB [F, H, W, 3] as stored, put through FFmpeg's own `filters`: [F, H', W', 3] as shown."""
    shown = []
    for frame in stored:
        graph = av.filter.Graph()
        last = source = graph.add_buffer(
            width=frame.shape[1], height=frame.shape[0], format="rgb24", time_base=Fraction(1, 24)
        )
        for name, args in filters:
            node = graph.add(name, args) if args else graph.add(name)
            last.link_to(node)
            last = node
        sink = graph.add("buffersink")
        last.link_to(sink)
        graph.configure()
        source.push(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24"))
        shown.append(sink.pull().to_ndarray(format="rgb24"))
    return np.stack(shown)


def stored_frames(data: bytes) -> np.ndarray:
    """The frames as the file stores them (PyAV decodes without turning them)."""
    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@pytest.mark.parametrize(("turn", "filters"), AUTOROTATE, ids=[f"{t}-{'mirrored' if m else 'plain'}" for (t, m), _ in AUTOROTATE])  # fmt: skip
def test_every_quarter_turn_and_mirror_decodes_as_ffmpeg_shows_it(turn, filters):
    """Each of the eight matrices a quarter turn and a mirror make: the decoded clip equals FFmpeg's filters
    on the stored frames. The mirrored ones had been turned instead (the 0-degree mirror upside down, the
    180-degree one not at all)."""
    data = mp4_with_matrix(marked_clip(), flipped(rotation_matrix(turn[0]), hflip=turn[1]))
    expected = ffmpeg_shown(stored_frames(data), filters)
    np.testing.assert_array_equal(decode_video(data, 6), expected)
    np.testing.assert_array_equal(decode_video(data, 3, "last"), expected[-3:])
    # an upload's sniffing (image first, then video), and a job's reference read again at restart
    image, video = decode_reference(data, max_frames=4, still_images=True)
    assert image is None
    np.testing.assert_array_equal(video, expected[:4])


def test_a_vertical_mirror_is_the_same_as_ffmpeg_writes_it_either_way():
    """`av_display_matrix_flip(m, 0, 1)` (vflip) of a plain matrix equals the hflip of the half-turned one."""
    for turn in (0, 90, 180, 270):
        by_vflip = matrix_orientation(tuple(flipped(rotation_matrix(turn), hflip=False, vflip=True)))
        by_hflip = matrix_orientation(tuple(flipped(rotation_matrix(turn + 180), hflip=True)))
        assert by_vflip == by_hflip


def test_a_mirrored_clip_shows_its_left_on_the_right():
    """A front camera's clip (a mirror, no turn): the red top-left corner as stored is shown top right."""
    shown = decode_video(mp4_with_matrix(marked_clip(), flipped(rotation_matrix(0), hflip=True)), 5)
    assert shown.shape == (5, 32, 48, 3)
    assert (shown[:, :12, -20:, 0] > 200).all() and (shown[:, :12, -20:, 2] < 60).all()
    assert (shown[:, :12, :20, 2] > 200).all()


def test_an_angle_ffmpeg_does_not_turn_in_quarters_or_a_singular_matrix_is_left_as_stored():
    clip = marked_clip(3)
    for matrix in (rotation_matrix(45), flipped(rotation_matrix(30), hflip=True), [0] * 8 + [1 << 30]):
        data = mp4_with_matrix(clip, matrix)
        np.testing.assert_array_equal(decode_video(data, 3), stored_frames(data))


def test_a_chat_videos_mirror_is_applied():
    """A mirrored portrait clip (a quarter turn plus a mirror: a plain transpose) in a video_url part reaches
    the Reasoner as shown: portrait, its red corner still top left (turned alone it had been top right)."""
    data = mp4_with_matrix(marked_clip(8), flipped(rotation_matrix(90), hflip=True))
    video = decode_chat_video(data, VideoSampling())
    height, width = video.frames.shape[1:3]
    assert (height, width) == VideoSampling().frame_size(4, 48, 32) and height > width
    top_left = video.frames[:, : height // 4, : width // 4]
    assert (top_left[..., 0] > 200).all() and (top_left[..., 2] < 60).all()
    assert (video.frames[:, : height // 4, -width // 4 :, 2] > 200).all()


@pytest.mark.anyio
async def test_a_video_reference_and_its_restart_read_are_mirrored_as_shown():
    """Through the API (a video_reference data URL) and again from the job's record, as a restarted server
    re-reads it: the frames as shown, the size from the shown (portrait) aspect."""
    data = mp4_with_matrix(marked_clip(), flipped(rotation_matrix(270), hflip=True))
    expected = ffmpeg_shown(stored_frames(data), [("transpose", "clock_flip")])
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    inputs = await build_inputs(
        {"prompt": "x", "num_frames": 5, "video_reference": {"video_url": url}}, served_model="m",
        has_sound=False,
    )  # fmt: skip
    params = inputs.params
    assert params.video is not None and params.height > params.width
    np.testing.assert_array_equal(params.video, expected[: len(params.video)])
    again, _ = inputs_from_record(inputs_record(params, EncodeOptions(crf=18)), inputs.reference)
    np.testing.assert_array_equal(again.video, params.video)

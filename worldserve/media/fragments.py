"""A fragmented MP4 ("m4s") handed out part by part while its frames are still being decoded: what
/v1/realtime/video sends (api/realtime.py).

The parts joined are one playable MP4 of the same frames as `encode_mp4`'s file (media/video.py, one
`Mp4Writer`), each chunk of frames one `moof` + `mdat` fragment starting with a keyframe. The frames a part
holds are counted from its bytes (the video track's `trun` sample counts), so the count is right however
long x264's threads or FFmpeg's interleaver hold packets back.
"""

from __future__ import annotations

import struct
from collections.abc import Generator, Iterator, Mapping
from fractions import Fraction

import numpy as np

from worldserve.media.audio import fit_audio
from worldserve.media.frame_stream import FrameStream
from worldserve.media.video import Mp4Writer, check_even_size, h264_options, yuv_frames

VIDEO_TRACK_ID = 1
"""Mp4Writer adds the video stream first."""


def encode_fragments(
    frames: FrameStream,
    fps: float | Fraction,
    audio: np.ndarray | None = None,
    sample_rate: int = 48000,
    crf: int = 18,
    codec_options: Mapping[str, object] | None = None,
) -> Generator[tuple[bytes, int], None, None]:
    """The same video as `encode_mp4`, as parts handed out while `frames` arrive: (bytes, n), n the frames
    they hold. The first part is the init segment (`ftyp` + an empty `moov` with the tracks' edit lists),
    which goes out with the first fragment (the muxer writes it once the first fragment is cut, when the
    AAC priming its audio edit list trims is known); a fragment is written once the next chunk's keyframe
    reaches the muxer, so after chunk k is encoded the fragments up to chunk k - 1's go out (later when
    x264's frame threads hold packets back: `tune zerolatency` avoids that); the last part holds the last
    fragment and the index (`mfra`). Empty parts are skipped. No B-frames (`bf` is set to 0: a B-frame's
    composition offset would start the video after the audio). Raises as `encode_mp4`."""
    check_even_size(frames)
    options = {**h264_options(codec_options, crf), "bf": "0"}
    audio = fit_audio(audio) if audio is not None else None
    out, samples = _Drain(), _VideoSamples()
    with Mp4Writer(out, frames.width, frames.height, fps, audio, sample_rate, options, fragmented=True) as w:
        for chunk in frames:
            w.write(yuv_frames([chunk]), keyframe_first=True)
            yield from _parts(out.take(), samples)  # the fragments written so far
        w.finish()
    yield from _parts(out.take(), samples)


def _parts(data: bytes, samples: _VideoSamples) -> Iterator[tuple[bytes, int]]:
    """`data` as parts (bytes, video frames in them): the init segment at its start, if there, a part of
    its own."""
    init = _init_segment_length(data)
    for part in (data[:init], data[init:]):
        if part:
            yield part, samples.count(part)


def _init_segment_length(data: bytes) -> int:
    """The length of the `ftyp` + `moov` at the start of `data` (0 when it does not start with `ftyp`)."""
    view, end = memoryview(data), 0
    while end < len(view):
        size, kind, _ = _box_header(view[end:])
        if size is None or kind not in (b"ftyp", b"moov") or (end == 0 and kind != b"ftyp"):
            break
        end += size
    return min(end, len(data))


class _Drain:
    """A write-only byte sink whose bytes are taken out as they come (no `seek`: PyAV then treats the output
    as a pipe, and the MP4 muxer never goes back over what it has handed out)."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self._parts = b"".join(self._parts), []
        return data


class _VideoSamples:
    """Counts the video track's samples in a stream of MP4 bytes fed part by part (a box may span parts):
    the `sample_count` of each `moof/traf/trun` whose `tfhd` names VIDEO_TRACK_ID. Other boxes (`mdat`,
    `moov`, `mfra`) are skipped without being kept."""

    def __init__(self) -> None:
        self._head = b""  # the start of a top-level box whose header (or whole moof) is not in yet
        self._skip = 0  # bytes of a skipped box still to come

    def count(self, data: bytes) -> int:
        total, view = 0, memoryview(self._head + data) if self._head else memoryview(data)
        self._head = b""
        while view:
            if self._skip:
                n = min(self._skip, len(view))
                self._skip, view = self._skip - n, view[n:]
                continue
            size, kind, header = _box_header(view)
            if size is None or (kind == b"moof" and len(view) < size):
                self._head = bytes(view)  # wait for the rest
                break
            if kind == b"moof":
                total += _moof_video_samples(view[header:size])
                view = view[size:]
            else:
                self._skip = size
        return total


def _box_header(data: memoryview) -> tuple[int | None, bytes, int]:
    """(size, type, header length) of the box at the start of `data`; size None when its header is cut."""
    if len(data) < 8:
        return None, b"", 0
    size, kind = struct.unpack(">I4s", data[:8])
    if size == 1:  # a 64-bit size follows the type
        if len(data) < 16:
            return None, b"", 0
        return struct.unpack(">Q", data[8:16])[0], kind, 16
    if size < 8:  # 0 ("to the end of the file") is never written before the last box of a pipe
        raise ValueError(f"malformed MP4 box {kind!r} of size {size}")
    return size, kind, 8


def _children(data: memoryview) -> Iterator[tuple[bytes, memoryview]]:
    while len(data) >= 8:
        size, kind, header = _box_header(data)
        if size is None or size > len(data):
            raise ValueError(f"MP4 box {kind!r} runs past its parent")
        yield kind, data[header:size]
        data = data[size:]


def _moof_video_samples(moof: memoryview) -> int:
    total = 0
    for kind, traf in _children(moof):
        if kind != b"traf":
            continue
        boxes = list(_children(traf))
        track = next(struct.unpack(">I", body[4:8])[0] for k, body in boxes if k == b"tfhd")
        if track == VIDEO_TRACK_ID:  # (tfhd, trun: a full box's version and flags, then its first field)
            total += sum(struct.unpack(">I", body[4:8])[0] for k, body in boxes if k == b"trun")
    return total

"""Video output: uint8 frames (F, H, W, 3) [+ float audio (C, N)] -> MP4 bytes, in memory, with PyAV.

The container matches serving-api.md §4.4 "Output encoding": H.264 (libx264) yuv420p at crf 18 with
`video_codec_options` (default preset ultrafast, threads 0), frame rate = the request fps (non-integer
rates such as 30000/1001 are exact, via a Fraction time base), exactly F frames; plus an AAC track (see
`media/audio.py`) lasting as long as the video. Frames are converted with the BT.709 matrix (limited range)
and tagged as such, so players that assume BT.709 for untagged HD video show the right colours; the
conversion runs on a few threads beside the encoder (`yuv_frames`).

`video_codec_options` is user input: only the allowlisted libx264 options below are accepted, each value
checked, and anything else raises `ParamError("video_codec_options", ...)`, so a request cannot pass
arbitrary FFmpeg options. `write_npz` stores the raw frames and audio losslessly (for parity checks).
Runs on the CPU (a pool off the engine loop); imports numpy and av only.
"""

from __future__ import annotations

import io
import math
import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from fractions import Fraction
from functools import cache
from pathlib import Path
from typing import Protocol

import av
import numpy as np
from av.video.reformatter import ColorRange, Colorspace

from worldserve.lasting_pool import LastingThreadPool
from worldserve.media.atomic_write import writing_atomically
from worldserve.media.audio import AacTrack, fit_audio
from worldserve.media.frame_stream import FrameStream, lower_thread_priority
from worldserve.params import ParamError

DEFAULT_CODEC_OPTIONS: dict[str, str] = {"preset": "ultrafast", "threads": "0"}
X264_PRESETS = (
    "ultrafast",
    "superfast",
    "veryfast",
    "faster",
    "fast",
    "medium",
    "slow",
    "slower",
    "veryslow",
)
X264_TUNES = ("film", "animation", "grain", "stillimage", "fastdecode", "zerolatency", "psnr", "ssim")
H264_PROFILES = ("baseline", "main", "high")
# Integer options and their inclusive ranges: CPU threads (0 = auto), quality, GOP length, B-frames.
INT_OPTION_RANGES: dict[str, tuple[int, int]] = {
    "threads": (0, 64),
    "crf": (0, 51),
    "g": (1, 1000),
    "bf": (0, 16),
}
CHOICE_OPTIONS: dict[str, tuple[str, ...]] = {
    "preset": X264_PRESETS,
    "tune": X264_TUNES,
    "profile": H264_PROFILES,
}
MAX_FRAME_RATE_DENOMINATOR = 10_000
_BT709 = 1  # AVCOL_SPC/PRI/TRC_BT709
_LIMITED_RANGE = 1  # AVCOL_RANGE_MPEG


def h264_options(codec_options: Mapping[str, object] | None, crf: int = 18) -> dict[str, str]:
    """Validated libx264 options: the defaults, then `crf`, then the caller's allowlisted overrides."""
    options = {**DEFAULT_CODEC_OPTIONS, "crf": str(_check_int("crf", crf))}
    if codec_options is None:
        return options
    if not isinstance(codec_options, Mapping):
        raise ParamError("video_codec_options", "video_codec_options must be an object of encoder options.")
    for key, value in codec_options.items():
        if key in CHOICE_OPTIONS:
            if not isinstance(value, str) or value not in CHOICE_OPTIONS[key]:
                allowed = ", ".join(CHOICE_OPTIONS[key])
                raise ParamError(
                    "video_codec_options", f"video_codec_options.{key} must be one of: {allowed}."
                )
            options[key] = value
        elif key in INT_OPTION_RANGES:
            options[key] = str(_check_int(key, value))
        else:
            allowed = ", ".join(sorted([*CHOICE_OPTIONS, *INT_OPTION_RANGES]))
            raise ParamError(
                "video_codec_options",
                f"Unsupported video_codec_options key {key!r}; allowed keys: {allowed}.",
            )
    if (
        "profile" in options and options["crf"] == "0"
    ):  # x264 refuses to open (a failed job, after the GPU work)
        raise ParamError(
            "video_codec_options",
            f"video_codec_options.profile {options['profile']!r} cannot encode losslessly (crf 0, as quality "
            "'lossless' sets); x264 picks the High 4:4:4 Predictive profile it needs when profile is omitted.",
        )
    return options


def _check_int(key: str, value: object) -> int:
    """An integer option given as int, integral float or decimal string, inside its allowed range."""
    lo, hi = INT_OPTION_RANGES[key]
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        number = int(value.strip())
    if number is None or not lo <= number <= hi:
        raise ParamError(
            "video_codec_options", f"video_codec_options.{key} must be an integer in [{lo}, {hi}]."
        )
    return number


def frame_rate(fps: float | Fraction) -> Fraction:
    """Exact frame rate: a Fraction stays as is; a float becomes the nearest fraction with a denominator
    of at most 10000 (29.97002997... -> 30000/1001, 23.976 -> 2997/125)."""
    if isinstance(fps, Fraction):
        rate = fps
    else:
        if not math.isfinite(fps):
            raise ValueError(f"fps must be finite, got {fps}")
        rate = Fraction(fps).limit_denominator(MAX_FRAME_RATE_DENOMINATOR)
    if rate <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    return rate


def clip_samples(num_frames: int, fps: float | Fraction, sample_rate: int) -> int:
    """Audio samples per channel as long as the clip's video track: round(num_frames / rate x sample_rate)
    in exact arithmetic at the track's own rate (`frame_rate`), serving-api.md's round(duration x rate).
    Floats had cut exact lengths one sample short (41 frames at 10 fps: 196799.99999999997 -> 196799 of
    196800). The sound latent's length keeps diffusers' own float count (AudioVAE.latent_frames)."""
    return round(num_frames * sample_rate / frame_rate(fps))


def check_even_size(frames: FrameStream) -> None:
    height, width = frames.height, frames.width
    if height % 2 or width % 2:
        raise ValueError(
            f"H.264 yuv420p needs even frame sizes, got {width}x{height} (Cosmos3 sizes are multiples of 16)"
        )


def _to_yuv420p(rgb: np.ndarray, threads: int | None = None) -> av.VideoFrame:
    """One uint8 (H, W, 3) RGB frame -> a yuv420p VideoFrame (BT.709 matrix, limited range; swscale, on
    `threads` of its own where PyAV takes the argument)."""
    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
    if threads is not None and _REFORMAT_TAKES_THREADS:
        return frame.reformat(
            format="yuv420p",
            dst_colorspace=Colorspace.ITU709,
            dst_color_range=ColorRange.MPEG,
            threads=threads,
        )
    return frame.reformat(format="yuv420p", dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG)


_REFORMAT_TAKES_THREADS = "threads=" in (av.video.reformatter.VideoReformatter.reformat.__doc__ or "")
"""PyAV >= 18 lets a reformat choose swscale's thread count (older ones take no `threads`)."""


def conversion_workers() -> int:
    """Threads converting frames to yuv420p, shared by all encodes: the CPUs this process may use, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus))


@cache
def _conversion_pool(workers: int) -> ThreadPoolExecutor:
    """One pool per size for the process (every concurrent encode shares it: at most `workers` threads),
    serving through the interpreter's exit (lasting_pool.py)."""
    return LastingThreadPool(workers, thread_name_prefix="worldserve-yuv", initializer=lower_thread_priority)


def yuv_frames(chunks: Iterable[np.ndarray], workers: int | None = None) -> Iterator[av.VideoFrame]:
    """The frames of `chunks` ((n_i, H, W, 3) each, in order) as yuv420p VideoFrames, converted on a shared
    pool of `workers` threads at most 2 x workers frames ahead of the consumer (each conversion
    single-threaded inside). swscale releases the GIL, so the conversion (~4-8 ms a 720p frame on one core,
    most of an ultrafast encode) runs beside the encoder; the frames are the same as converted one after
    another. A next chunk is asked for only when no converted frame waits (a `FrameStream` fed by a decode
    may block until the decoder has made it)."""
    workers = conversion_workers() if workers is None else workers
    if workers <= 1:
        for frames in chunks:
            yield from map(_to_yuv420p, frames)
        return
    pool = _conversion_pool(workers)
    pending: deque[Future[av.VideoFrame]] = deque()  # conversions in flight, in frame order
    ready: deque[np.ndarray] = deque()  # frames of a chunk not yet handed to the pool
    source = iter(chunks)
    try:
        while True:
            while len(pending) < 2 * workers:
                if not ready:
                    if pending:
                        break  # encode what is converted before waiting for the next chunk
                    chunk = next(source, None)
                    if chunk is None:
                        break
                    ready.extend(chunk)
                    continue
                pending.append(pool.submit(_to_yuv420p, ready.popleft(), 1))
            if not pending:
                return
            yield pending.popleft().result()
    finally:  # the consumer stopped early or failed: drop what is still queued
        for future in pending:
            future.cancel()


class ByteSink(Protocol):
    """Where an Mp4Writer's bytes go: a BytesIO, or a write-only sink (media/fragments.py)."""

    def write(self, data: bytes, /) -> int: ...


class Mp4Writer:
    """One H.264 (+ AAC) MP4 being muxed into `out` (a BytesIO, or anything with `write` alone: then the
    output is not seekable, as a pipe's). `fragmented`: an empty `moov` first, then a `moof` + `mdat`
    fragment from each keyframe to the next (`write(..., keyframe_first=True)` starts one), so what has been
    written so far plays while the rest is still coming. (vLLM-Omni cuts a fragment at every frame; with an
    AAC track FFmpeg then gives the first frame the AAC encoder's 1,024-sample delay as its duration, and a
    decoder loses a frame. The edit lists keep the video's timestamps where the non-fragmented file has
    them and trim the AAC encoder's priming as it does: `delay_moov` holds the `moov` back until the first
    fragment is cut, when the tracks' start offsets are known. With B-frames the first frame's composition
    offset would still start the video late, so a fragmented writer's caller sets `bf` 0:
    media/fragments.py.) A context manager: the container is closed on the way out, also when a frame
    fails."""

    def __init__(self, out: ByteSink, width: int, height: int, fps: float | Fraction, audio: np.ndarray | None,
                 sample_rate: int, options: dict[str, str], fragmented: bool = False) -> None:  # fmt: skip
        self.rate = frame_rate(fps)
        self.sample_rate = sample_rate
        self.frames_written = 0
        fragments = {
            "movflags": "+frag_keyframe+empty_moov+default_base_moof+delay_moov",
            "use_editlist": "1",
        }
        self.container = av.open(out, mode="w", format="mp4", options=fragments if fragmented else {})
        self.video = self.container.add_stream("libx264", rate=self.rate, options=options)
        self.video.width, self.video.height, self.video.pix_fmt = width, height, "yuv420p"
        ctx = self.video.codec_context
        ctx.colorspace, ctx.color_primaries, ctx.color_trc = _BT709, _BT709, _BT709
        ctx.color_range = _LIMITED_RANGE
        self.audio = AacTrack.add(self.container, audio, sample_rate) if audio is not None else None

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.container.close()

    def write(self, frames: Iterable[av.VideoFrame], keyframe_first: bool = False) -> None:
        """Encode and mux yuv420p frames, each followed by the audio up to its end (interleaved);
        `keyframe_first`: the first is encoded as a keyframe (an IDR: x264's GOPs are closed)."""
        frame_duration = 1 / self.rate
        for n, yuv in enumerate(frames):
            i = self.frames_written
            yuv.pts, yuv.time_base = i, frame_duration
            if keyframe_first and n == 0:
                yuv.pict_type = av.video.frame.PictureType.I
            self.container.mux(self.video.encode(yuv))
            if self.audio is not None:
                self.audio.write_until(self.container, math.floor((i + 1) * self.sample_rate / self.rate))
            self.frames_written = i + 1

    def finish(self) -> None:
        """Flush the encoders (the video's last packets, the audio's rest)."""
        self.container.mux(self.video.encode(None))
        if self.audio is not None:
            self.audio.finish(self.container)


def encode_mp4(
    frames: np.ndarray | FrameStream,
    fps: float | Fraction,
    audio: np.ndarray | None = None,
    sample_rate: int = 48000,
    crf: int = 18,
    codec_options: Mapping[str, object] | None = None,
) -> bytes:
    """Encode uint8 (F, H, W, 3) frames, and optionally float32 (C, N) audio, into MP4 bytes.

    `frames` may be a `FrameStream` whose chunks arrive while this runs (the same bytes as its frames in
    one array). The audio is muxed at its own length (the pipeline decodes it to the clip's duration,
    `AudioVAE.num_samples`, or to the request's sound_duration), NaN as silence and clipped to [-1, 1]. Raises
    ParamError for bad `codec_options`, ValueError for malformed frames or audio.
    """
    stream = frames if isinstance(frames, FrameStream) else FrameStream.of(frames)
    check_even_size(stream)
    options = h264_options(codec_options, crf)
    audio = fit_audio(audio) if audio is not None else None
    buf = io.BytesIO()
    with Mp4Writer(buf, stream.width, stream.height, fps, audio, sample_rate, options) as writer:
        writer.write(yuv_frames(stream))
        writer.finish()
    return buf.getvalue()


def write_npz(
    path: str | Path, frames: np.ndarray, audio: np.ndarray | None, fps: float, sample_rate: int = 48000
) -> Path:
    """Store frames (uint8), audio (float32 or absent), fps and sample_rate losslessly at `path`: the whole
    file or, when the write fails, `path` as it was (media/atomic_write.py)."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {
        "frames": np.ascontiguousarray(frames),
        "fps": np.asarray(float(fps), dtype=np.float64),
        "sample_rate": np.asarray(int(sample_rate), dtype=np.int64),
    }
    if audio is not None:
        arrays["audio"] = np.ascontiguousarray(audio, dtype=np.float32)
    with writing_atomically(path) as fh:
        np.savez(fh, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle's bool
    return path

"""What decoding a request's videos may cost, and the signal that stops it (media/video_input.py).

One `DecodeBudget` per request (api/chat.py; a video reference's: api/video_inputs.py), shared by its videos, which decode at once on the media pool
(thread-safe). The measure is decode work in pixels: every decoded frame counts its width x height (at least
MIN_FRAME_PIXELS: a frame has a fixed cost), a sampled frame CONVERT_WEIGHT times more besides, for it is
converted to RGB and resized at full size. Qwen3-VL samples the last frame, so the whole clip is always
decoded, and a tiny file of static 4K frames costs what a long real clip does. On a 2-CPU host ~1.1 ns a
unit, decoding (1080p) and converting alike: about a second of one core a G.
`plan` refuses a video from its container's metadata before a frame is decoded; `charge` counts each frame
as it decodes, since metadata can lie or be missing. Past the limit: ParamError naming the video's part.
`stop` (a threading.Event, set by media/work_pool.py `on_request_pool` when the request is abandoned: its
client left) makes the next check raise `DecodeCancelled`, so a decode ends within a frame, not at its end.
"""

from __future__ import annotations

import threading

from worldserve.config import DEFAULT_VIDEO_DECODE_GPIXELS
from worldserve.params import ParamError

DEFAULT_MAX_PIXELS = int(DEFAULT_VIDEO_DECODE_GPIXELS * 10**9)
"""A request's videos' decode work by default (`--max-video-decode-gpixels`)."""
CONVERT_WEIGHT = 10
"""A sampled frame's RGB conversion and resize, in decoded frames of its size (measured at 1080p: 10.8 ns a
pixel against 1.2 ns for decoding a noisy H.264 frame; ~10 ns at 4K)."""
MIN_FRAME_PIXELS = 1 << 15
"""The least a frame counts (~180 x 180): decoding a 64 x 64 frame still takes ~45 us, converting it ~240 us."""


class DecodeCancelled(Exception):
    """The request's media work was stopped: its client left. Not the request's fault: nobody is answered."""


class DecodeBudget:
    """The decode work a request's videos may take (`max_pixels`; None: no limit, a local caller's own
    files) and its `stop` signal."""

    def __init__(
        self, max_pixels: int | None = DEFAULT_MAX_PIXELS, stop: threading.Event | None = None
    ) -> None:
        self.max_pixels = max_pixels
        self.stop = stop if stop is not None else threading.Event()
        self.used = 0
        self._lock = threading.Lock()

    def check_stop(self) -> None:
        """DecodeCancelled once the request has been abandoned."""
        if self.stop.is_set():
            raise DecodeCancelled

    def plan(self, frames: int, sampled: int, width: int, height: int, param: str) -> None:
        """ParamError(param), before decoding, when `frames` frames of `width` x `height`, `sampled` of them
        converted, would take the request past its limit (its other videos' work so far counted)."""
        self.check_stop()
        if self.max_pixels is None:
            return
        width, height = max(width, 0), max(height, 0)  # (0: a size the container does not tell, the least)
        work = frames_work(frames, width, height) + frames_work(sampled, width, height) * CONVERT_WEIGHT
        with self._lock:
            used = self.used
        if used + work > self.max_pixels:
            others = f" (the request's other videos: {_amount(used)})" if used else ""
            shape = f"{width}x{height}" if width * height else "unknown size"
            raise ParamError(param, f"{param}: decoding this video takes {_amount(work)} of work{others}: "
                             f"{frames:,} frames of {shape}, {sampled} of them sampled. {self._advice()}")  # fmt: skip

    def charge(self, width: int, height: int, param: str, *, sampled: bool) -> None:
        """Count one decoded frame (and its conversion when `sampled`); DecodeCancelled once stopped,
        ParamError(param) once the request's videos have taken more than the limit."""
        work = frames_work(1, width, height) * (1 + CONVERT_WEIGHT if sampled else 1)
        self._add(work, param, f"of decoding, counted frame by frame (the last {width}x{height})")

    def charge_conversion(self, width: int, height: int, param: str) -> None:
        """Count the RGB conversion of a frame already charged as decoded (a video reference's kept frames,
        known only once the clip has been read); as `charge` past the limit or once stopped."""
        work = frames_work(1, width, height) * CONVERT_WEIGHT
        self._add(work, param, f"of decoding and conversion (frames of {width}x{height})")

    def _add(self, work: int, param: str, what: str) -> None:
        """Count `work` done; DecodeCancelled once stopped, ParamError(param) past the limit (`what`: the work
        so far, for the message)."""
        self.check_stop()
        with self._lock:
            self.used += work
            used = self.used
        if self.max_pixels is not None and used > self.max_pixels:
            raise ParamError(
                param, f"{param}: the request's videos took {_amount(used)} {what}. {self._advice()}"
            )

    def _advice(self) -> str:
        return (f"This server's limit is {_amount(self.max_pixels)} a request (--max-video-decode-gpixels: every "
                f"decoded frame counts its pixels, a sampled one {1 + CONVERT_WEIGHT} times); send a shorter or "
                "lower-resolution video, or sample fewer frames.")  # fmt: skip


def frames_work(frames: int, width: int, height: int) -> int:
    """The decode work of `frames` frames of `width` x `height`, each at least MIN_FRAME_PIXELS."""
    return frames * max(width * height, MIN_FRAME_PIXELS)


def _amount(pixels: int | None) -> str:
    """1.23 G pixels; below a G, the exact count (a small test limit)."""
    pixels = pixels or 0
    return f"{pixels / 1e9:.3g} G pixels" if pixels >= 10**9 else f"{pixels:,} pixels"

"""A chat request's `media_io_kwargs` (vLLM's per-modality media loader options), checked as it is read.

`image_background(media_io_kwargs)`: what an image's transparent pixels show (`image.rgba_background_color`,
white by default); `video_sampling(media_io_kwargs, mm_video)`: how its videos' frames are sampled
(`video.fps` / `video.num_frames`, or the same keys from `mm_processor_kwargs`, over Qwen3-VL's 2 fps; with
`mm_processor_kwargs.do_sample_frames=false` and no `video` sampling, every frame: `EveryFrame`) and their
pixel budget. Both run before any media is fetched (api/chat.py `request_options`); the decoding itself is
api/chat_media.py's. Errors are ParamErrors naming the field the value came in.
"""

from __future__ import annotations

from dataclasses import dataclass

from worldserve.api.chat_options import pixel_budget
from worldserve.chat_params import MAX_VIDEO_FPS, VideoSampling
from worldserve.params import ParamError

RGBA_BACKGROUND = (255, 255, 255)
"""What a chat image's transparent pixels show (vLLM's ImageMediaIO default `rgba_background_color`)."""

MEDIA_IO_KINDS = ("image", "video")
"""The `media_io_kwargs` keys this server reads (vLLM's are per modality; there is no audio here)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EveryFrame(VideoSampling):
    """`mm_processor_kwargs.do_sample_frames=false` where no `media_io_kwargs.video` sampling is set: the
    clip's frames as decoded, every one (transformers' Qwen3-VL video processor skips `sample_frames` then,
    with no min / max frame count), resized as a clip of that many frames is, timestamped by their index."""

    fps: float | None = None

    def indices(self, total_frames: int, source_fps: float) -> list[int]:
        return list(range(total_frames))


def image_background(media_io_kwargs: dict | None) -> tuple[int, int, int]:
    """`media_io_kwargs.image.rgba_background_color` (vLLM's ImageMediaIO option: what a transparent pixel
    shows, [R, G, B] of 0-255), white by default; ParamError naming the field for another value, another
    `image` key, or a `media_io_kwargs` key that is no modality here (each had been ignored)."""
    for key in media_io_kwargs or {}:
        if key not in MEDIA_IO_KINDS:
            raise ParamError(f"media_io_kwargs.{key}", f"media_io_kwargs takes {' and '.join(MEDIA_IO_KINDS)} "
                             f"options, not {key!r}")  # fmt: skip
    image = (media_io_kwargs or {}).get("image")
    image = {} if image is None else image
    if not isinstance(image, dict) or set(image) - {"rgba_background_color"}:
        raise ParamError(
            "media_io_kwargs.image", 'media_io_kwargs.image takes {"rgba_background_color": [R, G, B]}'
        )
    color = image.get("rgba_background_color", RGBA_BACKGROUND)
    if (not isinstance(color, list | tuple) or len(color) != 3
            or not all(type(c) is int and 0 <= c <= 255 for c in color)):  # fmt: skip
        raise ParamError("media_io_kwargs.image.rgba_background_color",
                         "rgba_background_color must be [R, G, B], three integers from 0 to 255")  # fmt: skip
    return tuple(color)


def video_sampling(media_io_kwargs: dict | None, mm_video: dict | None = None) -> VideoSampling:
    """`media_io_kwargs.video` ({"fps": F}, {"num_frames": N} or both) or fps / num_frames from `mm_processor_kwargs`, and
    its pixel budget, over Qwen3-VL's defaults (2 fps); do_sample_frames=false there: the `video` sampling
    alone (the loader's frames, not sampled again), or with none every frame (`EveryFrame`). ParamError naming
    the field the values came from when fps is not a number > 0 (above MAX_VIDEO_FPS it is taken as that),
    num_frames not an integer in [1, max_frames] (or -1), or do_sample_frames=false comes with fps /
    num_frames in `mm_processor_kwargs`."""
    video = (media_io_kwargs or {}).get("video")
    video = {} if video is None else video
    if not isinstance(video, dict) or set(video) - {"fps", "num_frames", "max_duration"}:
        raise ParamError("media_io_kwargs", 'media_io_kwargs.video takes {"fps": F}, {"num_frames": N} or '
                         'both (and "max_duration", which vLLM\'s default loader takes and does not use)')  # fmt: skip
    if "max_duration" in video:  # (accepted for clients written against vLLM; nothing to limit here)
        limit = video["max_duration"]
        if type(limit) not in (int, float) or not limit > 0:
            raise ParamError(
                "media_io_kwargs.video.max_duration", "max_duration must be a number of seconds > 0"
            )
        video = {k: v for k, v in video.items() if k != "max_duration"}
    if video.get("num_frames") == -1:  # vLLM's "decode every frame, let the processor sample": the default
        video = {k: v for k, v in video.items() if k != "num_frames"}
    mm_video = mm_video or {}
    asked = {k: mm_video[k] for k in ("fps", "num_frames") if k in mm_video}
    every_frame = mm_video.get("do_sample_frames") is False
    if asked and every_frame:
        raise ParamError("mm_processor_kwargs", "mm_processor_kwargs do_sample_frames=false takes the clip's "
                         "frames as decoded, unsampled, so it takes no fps / num_frames: give one or the other "
                         "(media_io_kwargs.video samples them before the processor, as vLLM's loader does)")  # fmt: skip
    if asked and video:
        raise ParamError("mm_processor_kwargs", "video sampling is set in media_io_kwargs.video: give fps / "
                         "num_frames there or in mm_processor_kwargs, not both")  # fmt: skip
    # Qwen3-VL's processor refuses both; vLLM's loader (media_io_kwargs.video) takes both
    if "fps" in asked and "num_frames" in asked:
        raise ParamError("mm_processor_kwargs", "mm_processor_kwargs fps and num_frames are mutually exclusive "
                         "(media_io_kwargs.video takes both: the fewer frames)")  # fmt: skip
    video = video or asked
    lo, hi = pixel_budget(mm_video, "videos")
    pixels = {k: v for k, v in (("min_pixels", lo), ("max_pixels", hi)) if v is not None}
    if every_frame and not video:  # (with the loader's sampling, the processor takes the frames it decoded)
        return EveryFrame(**pixels)
    param = "mm_processor_kwargs" if asked else "media_io_kwargs"
    fps, num = video.get("fps"), video.get("num_frames")
    if num == -1:
        num = None
    if (fps is not None and type(fps) not in (int, float)) or (num is not None and type(num) is not int):
        raise ParamError(param, f"{param} video fps must be a number, num_frames an integer")
    if fps is not None and fps > MAX_VIDEO_FPS:  # (compared before float(): an int past 1e308 overflows it)
        fps = MAX_VIDEO_FPS  # a rate at or above the clip's own takes every frame anyway, as vLLM samples
    try:
        # checked before float(): an integer fps past 1e308 overflows it
        VideoSampling(fps=fps, num_frames=num).validate()
        if num is not None:
            return VideoSampling(fps=None if fps is None else float(fps), num_frames=num, **pixels).validate()
        return VideoSampling(fps=2.0 if fps is None else float(fps), **pixels).validate()
    except ParamError as exc:
        raise ParamError(param, f"{param}: {exc.message}") from None

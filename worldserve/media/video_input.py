"""Conditioning videos (video-to-video): decode an uploaded clip with PyAV, resize it as diffusers does.

- `decode_video(data, max_frames, keep)`: any container/codec FFmpeg reads -> uint8 RGB (F, H, W, 3), the
  first or the last `max_frames` frames (serving-api.md §4.3: the V2V decode budget is
  `max(condition_frame_indexes_vision)*4 + 1` frames, from the `first` or `last` end). Anything that
  yields no video frame raises ParamError with the OpenAI-shaped `input_reference` message. Frames come out
  as a player shows them: a display matrix's quarter turn (a phone's portrait clip) and mirror (a front
  camera's) are applied, as FFmpeg's autorotate does (media/display_matrix.py; chat videos' too).
- `decode_reference(data, ...)`: an `input_reference` upload sniffed image first (Pillow), then video (an image
  file Pillow refuses is not read as a one-frame clip: `is_still_image` names FFmpeg's image demuxers).
- `condition_budget(indexes)`: the pixel frames a V2V request needs from its clip.
- `resize_video(frames, width, height)`: what diffusers 0.42.1's Cosmos3 pipeline does to a V2V clip
  (`VideoProcessor.preprocess_video` with `resample="bilinear"`, resize_mode "default"): each frame is
  a PIL image resized to exactly width x height with PIL's bilinear filter, no aspect-preserving crop
  (unlike the I2V image path). The result is uint8, so `x/255*2-1` of it equals the pipeline's tensor.
- `decode_chat_video(data, sampling)`: a Reasoner video -> `ChatVideo`: the frames Qwen3-VL's video processor
  samples (`VideoSampling.indices`, 2 fps by default), each resized to the processor's `smart_resize` size
  as it is decoded (a long clip never sits in memory at full size) with torchvision's antialiased bicubic,
  as transformers' video processor resizes (media/frame_resize.py `bicubic_antialiased`: Pillow's float
  mode, within 1 level on under 0.1 % of values); the sampling, sizes and timestamps are the same. The whole
  clip is decoded (the last frame is always sampled), so its decode work is counted against the request's
  `DecodeBudget` (media/decode_budget.py): from the container's frame count and size before decoding (a
  count the container lacks is its packets', demuxed, not decoded), then frame by frame, each check also
  where an abandoned request's decode stops. An image file FFmpeg cannot read as a one-frame clip (a PNG
  past its size limit) is decoded as an image part is, with that image's own errors.
- `decode_chat_frames(images, sampling)`: vLLM's video of separate image frames, sampled and resized as a
  video's.
Pillow and PyAV only: the API process can validate uploads without torch.
"""

from __future__ import annotations

import collections
import contextlib
import io
import warnings
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from worldserve.chat_params import ChatVideo, VideoSampling
from worldserve.media.decode_budget import DecodeBudget
from worldserve.media.display_matrix import display_orientation
from worldserve.media.frame_resize import bicubic_antialiased
from worldserve.media.image import (
    ImageTooLarge,
    decode_image,
    image_size,
    invalid_reference,
    max_pixels,
    too_large,
)
from worldserve.params import ParamError

if TYPE_CHECKING:
    import av
    from av.container import InputContainer
    from av.video.stream import VideoStream

KEEP_CHOICES = ("first", "last")
MAX_DECODED_BYTES = 4 * 2**30
"""A conditioning clip's decoded frames may take this much host memory (4 GiB: 189 frames at 4K)."""


STILL_IMAGE_DEMUXERS = ("image2", "image2pipe", "gif", "apng")
"""FFmpeg's demuxers of still-image files besides its `*_pipe` ones (jpeg_pipe, png_pipe, webp_pipe, ...)."""


def is_still_image(format_name: str) -> bool:
    """Whether FFmpeg read the bytes as an image file (a demuxer of PyAV's `container.format.name`)."""
    return any(name.endswith("_pipe") or name in STILL_IMAGE_DEMUXERS for name in format_name.split(","))


def decode_video(
    data: bytes, max_frames: int, keep: str = "first", *, param: str = "input_reference",
    budget: DecodeBudget | None = None, still_images: bool = True,
) -> np.ndarray:  # fmt: skip
    """Video bytes -> uint8 RGB (F, H, W, 3) with 1 <= F <= max_frames, from the `keep` end of the clip
    (`still_images=False`: an image file FFmpeg reads, e.g. a JPEG Pillow refused as truncated, is not a
    one-frame video but ParamError(param), as an upload's image-then-video sniffing wants it). Only
    the kept frames are converted to RGB ("last" decodes the whole clip, holding the last `max_frames` as
    decoded); the work is counted against `budget` (no budget: no limit, a local caller's own file): from the
    container's frame count and size before decoding, then frame by frame (ParamError(param) past it;
    DecodeCancelled once the request is abandoned)."""
    import av  # lazy: PyAV loads FFmpeg

    bad = _invalid(param)
    if keep not in KEEP_CHOICES:
        raise ParamError(
            "extra_params.condition_video_keep", "condition_video_keep must be 'first' or 'last'"
        )
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    budget = budget if budget is not None else DecodeBudget(None)
    frames: collections.deque = collections.deque(maxlen=max_frames if keep == "last" else None)  # av frames
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = _conditioning_stream(container, bad, still_images)
            _decode_kept(container, stream, data, frames, max_frames, keep, budget, param)
    except ParamError:
        raise
    except (av.FFmpegError, ValueError, OSError, EOFError, IndexError) as exc:
        if not frames:
            raise bad from exc
        # A clip truncated after some good frames: keep what decoded, as FFmpeg players do.
    if not frames or frames[0].width == 0 or frames[0].height == 0:
        raise bad
    return _shown_rgb(frames, budget, param, bad)


def _conditioning_stream(container: InputContainer, bad: ParamError, still_images: bool) -> VideoStream:
    """The container's first video stream; `bad` when it has none FFmpeg can decode, or when it is an image
    file and `still_images` is off."""
    # (a stream FFmpeg can demux but has no decoder for, e.g. an SVG, has no codec context)
    if not container.streams.video or container.streams.video[0].codec_context is None:
        raise bad
    if not still_images and is_still_image(container.format.name):
        raise bad
    return container.streams.video[0]


def _decode_kept(
    container: InputContainer, stream: VideoStream, data: bytes, frames: collections.deque, max_frames: int,
    keep: str, budget: DecodeBudget, param: str,
) -> None:  # fmt: skip
    """Decode `stream` into `frames` (av frames, as decoded; a deque bounded to `max_frames` for "last"),
    planned against `budget` from the container's stated count and charged frame by frame; a frame too large
    or of another size than the first is a ParamError(param). `frames` keeps what decoded when this raises."""
    width, height = stream.codec_context.width, stream.codec_context.height
    _check_frame_size(width, height, 1, param)
    if (stated := stated_frames(stream, data)) > 0:  # (its whole decoding planned before a frame)
        kept = min(stated, max_frames)
        budget.plan(stated if keep == "last" else kept, kept, width, height, param)
    for frame in container.decode(stream):
        budget.charge(frame.width, frame.height, param, sampled=False)
        _check_frame_size(frame.width, frame.height, min(len(frames) + 1, max_frames), param)
        if frames and (frames[0].height, frames[0].width) != (frame.height, frame.width):
            first = frames[0]
            raise ParamError(param, f"{param}: the video changes size mid-stream ({first.width}x{first.height} "
                             f"-> {frame.width}x{frame.height}); send a clip of one frame size")  # fmt: skip
        frames.append(frame)
        if keep == "first" and len(frames) >= max_frames:
            break


def _shown_rgb(frames: collections.deque, budget: DecodeBudget, param: str, bad: ParamError) -> np.ndarray:
    """The kept av `frames` (emptied) -> uint8 RGB (F, H, W, 3) as a player shows them, each conversion
    charged to `budget`; `bad` for a pixel format FFmpeg cannot convert."""
    import av

    # (a stream's display matrix: one for all its frames)
    orientation = display_orientation(frames[0])
    height, width = orientation.shown_size(frames[0].height, frames[0].width)
    out = np.empty((len(frames), height, width, 3), np.uint8)  # [F, H, W, 3], as shown
    for i in range(len(out)):  # frame by frame, each freed once converted: the peak stays ~1x the clip
        frame = frames.popleft()
        budget.charge_conversion(frame.width, frame.height, param)
        try:
            out[i] = orientation.apply(frame.to_ndarray(format="rgb24"))
        except (av.FFmpegError, ValueError) as exc:  # (a pixel format FFmpeg cannot convert)
            raise bad from exc
    return out


def stated_frames(stream: VideoStream, data: bytes) -> int:
    """The frame count a container states (0: none), at most one a byte of the file: a header can claim 1e9
    frames in 19 KB, and the budget's plan would refuse that clip for a size it does not have."""
    return min(max(stream.frames, 0), len(data))


def _check_frame_size(width: int, height: int, kept: int, param: str) -> None:
    """ParamError before decoding a frame above the image pixel limit, or one that would make the `kept`
    frames held at once take more than MAX_DECODED_BYTES (a small file can decode to a huge clip)."""
    _check_frame_pixels(width, height, param)
    if kept * width * height * 3 > MAX_DECODED_BYTES:
        fit = max(1, MAX_DECODED_BYTES // max(1, width * height * 3))
        raise ParamError(param, f"{param}: the conditioning frames of {width}x{height} need more than "
                         f"{MAX_DECODED_BYTES >> 30} GiB decoded; at this size at most {fit} frames fit: "
                         "send a smaller video or fewer condition frames")  # fmt: skip


DEFAULT_SOURCE_FPS = 24.0
"""Frame rate assumed when a container states none (transformers' fallback too)."""


def decode_chat_video(
    data: bytes, sampling: VideoSampling, *, param: str = "messages", budget: DecodeBudget | None = None
) -> ChatVideo:
    """Video bytes -> the sampled, resized frames of a chat video part (ParamError when nothing decodes, or
    when the decode would take the request past its `budget`; DecodeCancelled once the budget's request is
    abandoned; no budget: no limit, a local caller's own file)."""
    budget = budget if budget is not None else DecodeBudget(None)
    bad = ParamError(param, f"Invalid {param}: provided content is not a valid video.")
    try:
        return _decode_chat_clip(data, sampling, param, budget, bad)
    except ParamError as exc:
        if exc is not bad or not _pillow_recognises(data):
            raise
    # An image file FFmpeg would not read as a one-frame clip (a PNG past FFmpeg's own size limit, whose
    # stream then has no size): decoded as an image part is, so its errors are the image's (too large, corrupt).
    return decode_chat_frames([data], sampling, param=param, budget=budget)


def _pillow_recognises(data: bytes) -> bool:
    """Whether Pillow reads the bytes' header as an image's (one too large to decode included)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)):
                return True
    except Image.DecompressionBombError:
        return True
    except Exception:  # (any failure of Pillow's header parsers on untrusted bytes: not an image it reads)
        return False


def _decode_chat_clip(
    data: bytes, sampling: VideoSampling, param: str, budget: DecodeBudget, bad: ParamError
) -> ChatVideo:
    """decode_chat_video through FFmpeg: `bad` itself where nothing decodes."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:  # (no stream at all: a damaged container, e.g. an MP4's moov)
                if container.streams.audio:
                    raise ParamError(param, f"Invalid {param}: the file has no video stream (audio only).")
                raise bad
            stream = container.streams.video[0]
            size = (0, 0)
            if stream.codec_context is not None:
                size = (stream.codec_context.width, stream.codec_context.height)
                _check_frame_pixels(
                    *size, param, "the image" if is_still_image(container.format.name) else None
                )
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else DEFAULT_SOURCE_FPS
            # the container does not say (WebM, MKV): its packets, a frame each, counted undecoded
            total = (
                stated_frames(stream, data)
                if stream.frames > 0
                else _count_packets(container, stream, size, budget, param)
            )
        video, seen = _sample(data, sampling, total, fps, size, budget, param)
        if video is None:  # fewer frames than the container said: sample the frames there are
            video, _ = _sample(data, sampling, seen, fps, size, budget, param)
    except ParamError:
        raise
    except (av.FFmpegError, ValueError, OSError, EOFError, IndexError) as exc:
        raise bad from exc
    if video is None or not len(video.frames):
        raise bad
    return video


def decode_chat_frames(
    images: Sequence[bytes], sampling: VideoSampling, *, param: str, budget: DecodeBudget | None = None
) -> ChatVideo:
    """vLLM's video of separate frames (`data:video/jpeg;base64,<frame>,<frame>,...`: api/data_urls.py), each
    frame an image: the clip taken at DEFAULT_SOURCE_FPS (nothing states a rate; transformers' fallback too),
    its sampled frames decoded and resized as a video's, counted against `budget` (from their headers before
    any is decoded). ParamError(param) for a frame that is no image, or of another size than the first."""
    if not images:
        raise ParamError(param, f"Invalid {param}: the video/jpeg data URL holds no frame.")
    budget = budget if budget is not None else DecodeBudget(None)
    wanted = sampling.indices(len(images), DEFAULT_SOURCE_FPS)
    want = collections.Counter(wanted)
    sizes = {image_size(images[i]) for i in want}
    for h, w in (shape for shape in sizes if shape is not None):  # (decode_image's error before the budget's)
        _check_frame_pixels(w, h, param, "the image")
    if (
        len(sizes) == 1 and (size := sizes.pop()) is not None
    ):  # (frames of several sizes: refused as they decode)
        budget.plan(len(want), len(want), size[1], size[0], param)
    kept: list[np.ndarray] = []
    first: tuple[int, ...] = ()
    for i in sorted(want):
        budget.check_stop()
        frame = decode_image(images[i], param=param)  # [H, W, 3]
        if first and frame.shape[:2] != first:
            raise ParamError(param, f"{param}: the frames differ in size ({first[1]}x{first[0]} and "
                             f"{frame.shape[1]}x{frame.shape[0]}); send frames of one size")  # fmt: skip
        first = frame.shape[:2]
        budget.charge(frame.shape[1], frame.shape[0], param, sampled=True)
        kept.extend([_resized(frame, sampling, len(wanted), param)] * want[i])
    return ChatVideo(frames=np.stack(kept), indices=tuple(wanted), source_fps=DEFAULT_SOURCE_FPS)


def _count_packets(
    container: InputContainer, stream: VideoStream, size: tuple[int, int], budget: DecodeBudget, param: str
) -> int:
    """The stream's frames as its packets, demuxed, not decoded (~10 us each); a count whose decoding alone
    would take the request past its budget is refused before it is all read."""
    count = 0
    for packet in container.demux(stream):
        if packet.size:
            count += 1
            if count % 1024 == 0:  # (a file may hold millions of tiny frames)
                budget.plan(count, 0, *size, param)
    return count


def _frames(data: bytes, param: str) -> Generator[av.VideoFrame, None, None]:
    """The clip's frames, each checked against the image pixel limit before it is converted. A clip whose
    tail does not decode (truncated, corrupt) ends at its last good frame, as FFmpeg players and
    `decode_video` take it; one with no good frame raises."""
    import av

    yielded = False
    with av.open(io.BytesIO(data), mode="r") as container:
        try:
            for frame in container.decode(container.streams.video[0]):
                _check_frame_pixels(frame.width, frame.height, param)
                yielded = True
                yield frame
        except (av.FFmpegError, EOFError):
            if not yielded:
                raise


def _check_frame_pixels(width: int, height: int, param: str, what: str | None = None) -> None:
    """A video frame above the image pixel limit is refused as an image that size is (a chat video's sampled
    frames are converted at full size before they are resized); `what` names it (an image file's frame:
    "the image", as decode_image says)."""
    if width * height > max_pixels():
        raise too_large(param, width * height, what or f"a video frame of {width}x{height}")


def _sample(
    data: bytes, sampling: VideoSampling, total: int, fps: float, size: tuple[int, int], budget: DecodeBudget,
    param: str,
) -> tuple[ChatVideo | None, int]:  # fmt: skip
    """Decode once, up to the last sampled frame (`size`: the container's, for the budget's plan), keeping and
    resizing the sampled frames, each frame counted against `budget` as it decodes: (the video, frames
    decoded), or (None, the clip's frame count) when it has fewer than `total`."""
    if total <= 0:
        return None, 0
    wanted = sampling.indices(total, fps)
    want = collections.Counter(wanted)  # an index repeats when num_frames exceeds the clip's length
    budget.plan(wanted[-1] + 1, len(want), *size, param)
    kept: list[np.ndarray] = []
    seen = 0
    with contextlib.closing(_frames(data, param)) as frames:
        for i, frame in enumerate(frames):
            seen = i + 1
            budget.charge(frame.width, frame.height, param, sampled=i in want)
            if i in want:
                shown = display_orientation(frame).apply(frame.to_ndarray(format="rgb24"))
                resized = _resized(shown, sampling, len(wanted), param)
                if kept and kept[0].shape != resized.shape:
                    raise ParamError(param, f"{param}: the video changes size mid-stream ({kept[0].shape[1]}x"
                                     f"{kept[0].shape[0]} -> {resized.shape[1]}x{resized.shape[0]} once resized); "
                                     "send a clip of one frame size")  # fmt: skip
                kept.extend([resized] * want[i])
            if i == wanted[-1]:
                break
    if len(kept) != len(wanted):
        return None, seen
    return ChatVideo(frames=np.stack(kept), indices=tuple(wanted), source_fps=fps), seen


def _resized(frame: np.ndarray, sampling: VideoSampling, num_frames: int, param: str) -> np.ndarray:
    """A sampled RGB frame (uint8 [H, W, 3]) resized to the size Qwen3-VL's processor gives a clip of
    `num_frames` frames, as its (torchvision) resize does: uint8 [h, w, 3] (`bicubic_antialiased`); a
    ParamError naming `param` for a frame the processor refuses (an aspect ratio past 200)."""
    try:
        h, w = sampling.frame_size(num_frames, frame.shape[0], frame.shape[1])
    except ParamError as exc:
        raise ParamError(param, f"Invalid {param}: {exc.message}") from None
    return bicubic_antialiased(frame, w, h)


def _invalid(param: str) -> ParamError:
    if param == "input_reference":
        return ParamError(param, invalid_reference(param))
    return ParamError(param, f"Invalid {param}: provided content is not a valid video.")


def decode_reference(
    data: bytes, *, max_frames: int, keep: str = "first", param: str = "input_reference",
    budget: DecodeBudget | None = None, still_images: bool = False,
) -> tuple[np.ndarray | None, np.ndarray | None]:  # fmt: skip
    """(image, None) when Pillow decodes `data`, else (None, video) when PyAV decodes it as a video (its work
    counted against `budget`), else ParamError. An image Pillow recognises but refuses (too many pixels), or
    one it cannot read (a truncated JPEG, which FFmpeg would read as a one-frame clip), is a ParamError, not a
    one-frame video (`still_images=True`: it is, as before that rule)."""
    try:
        return decode_image(data, param=param), None
    except ImageTooLarge:
        raise
    except ParamError:
        pass
    return None, decode_video(data, max_frames, keep, param=param, budget=budget, still_images=still_images)


def condition_budget(
    condition_frame_indexes: tuple[int, ...] | list[int], temporal_compression: int = 4
) -> int:
    """Pixel frames a V2V request needs from its clip: max(index) * 4 + 1 (5 for the default (0, 1))."""
    return max(condition_frame_indexes) * temporal_compression + 1


def resize_video(frames: np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 (F, h, w, 3) -> uint8 (F, height, width, 3): PIL bilinear resize per frame (diffusers' V2V)."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"resize_video expects uint8 (F, H, W, 3), got {frames.dtype} {frames.shape}")
    if width <= 0 or height <= 0:
        raise ValueError(f"target size must be positive, got {width}x{height}")
    if frames.shape[1:3] == (height, width):
        return np.ascontiguousarray(frames)
    out = np.empty((frames.shape[0], height, width, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        img = Image.fromarray(np.ascontiguousarray(frame), mode="RGB")
        out[i] = np.asarray(
            img.resize((width, height), resample=Image.Resampling.BILINEAR, reducing_gap=None)
        )
    return out

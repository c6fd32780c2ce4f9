"""Conditioning videos (video-to-video): decode an uploaded clip with PyAV, resize it as diffusers does.

- `decode_video(data, max_frames, keep)`: any container/codec FFmpeg reads -> uint8 RGB (F, H, W, 3), the
  first or the last `max_frames` frames (serving-api.md §4.3: the V2V decode budget is
  `max(condition_frame_indexes_vision)*4 + 1` frames, from the `first` or `last` end). Anything that
  yields no video frame raises ParamError with the OpenAI-shaped `input_reference` message.
- `decode_reference(data, ...)`: an `input_reference` upload sniffed image first (Pillow), then video.
- `resize_video(frames, width, height)`: what diffusers 0.42.1's Cosmos3 pipeline does to a V2V clip
  (`VideoProcessor.preprocess_video` with `resample="bilinear"`, resize_mode "default"): each frame is
  a PIL image resized to exactly width x height with PIL's bilinear filter, no aspect-preserving crop
  (unlike the I2V image path). The result is uint8, so `x/255*2-1` of it equals the pipeline's tensor.
- `decode_chat_video(data, sampling)`: a Reasoner video -> `ChatVideo`: the frames Qwen3-VL's video processor
  samples (`VideoSampling.indices`, 2 fps by default), each resized with PIL bicubic to the processor's
  `smart_resize` size as it is decoded (a long clip never sits in memory at full size). transformers resizes
  with torchvision's antialiased bicubic, so pixels can differ by rounding; the sampling, sizes and
  timestamps are the same.
Pillow and PyAV only: the API process can validate uploads without torch.
"""

from __future__ import annotations

import collections
import io
from collections.abc import Sequence

import numpy as np
from PIL import Image

from worldserve.chat_params import ChatVideo, VideoSampling
from worldserve.media.image import ImageTooLarge, decode_image, invalid_reference, max_pixels, too_large
from worldserve.params import ParamError

KEEP_CHOICES = ("first", "last")
MAX_DECODED_BYTES = 4 * 2**30
"""A conditioning clip's decoded frames may take this much host memory (4 GiB: 189 frames at 4K)."""


def decode_video(
    data: bytes, max_frames: int, keep: str = "first", *, param: str = "input_reference"
) -> np.ndarray:
    """Video bytes -> uint8 RGB (F, H, W, 3) with 1 <= F <= max_frames, from the `keep` end of the clip."""
    import av  # lazy: PyAV loads FFmpeg

    bad = _invalid(param)
    if keep not in KEEP_CHOICES:
        raise ParamError(
            "extra_params.condition_video_keep", "condition_video_keep must be 'first' or 'last'"
        )
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    frames: collections.deque[np.ndarray] = collections.deque(maxlen=max_frames if keep == "last" else None)
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            # (a stream FFmpeg can demux but has no decoder for, e.g. an SVG, has no codec context)
            if not container.streams.video or container.streams.video[0].codec_context is None:
                raise bad
            stream = container.streams.video[0]
            _check_frame_size(stream.codec_context.width, stream.codec_context.height, 1, param)
            for frame in container.decode(stream):
                _check_frame_size(frame.width, frame.height, min(len(frames) + 1, max_frames), param)
                if frames and frames[0].shape[:2] != (frame.height, frame.width):
                    first = frames[0].shape
                    raise ParamError(param, f"{param}: the video changes size mid-stream ({first[1]}x{first[0]} "
                                     f"-> {frame.width}x{frame.height}); send a clip of one frame size")  # fmt: skip
                frames.append(frame.to_ndarray(format="rgb24"))
                if keep == "first" and len(frames) >= max_frames:
                    break
    except ParamError:
        raise
    except (av.FFmpegError, ValueError, OSError, EOFError, IndexError) as exc:
        if not frames:
            raise bad from exc
        # A clip truncated after some good frames: keep what decoded, as FFmpeg players do.
    if not frames:
        raise bad
    out = np.empty((len(frames), *frames[0].shape), np.uint8)  # [F, H, W, 3]
    for i in range(len(out)):  # frame by frame, each freed once copied: the peak stays ~1x the clip
        out[i] = frames.popleft()
    if out.shape[1] == 0 or out.shape[2] == 0 or out.shape[3] != 3:
        raise bad
    return out


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


def decode_chat_video(data: bytes, sampling: VideoSampling, *, param: str = "messages") -> ChatVideo:
    """Video bytes -> the sampled, resized frames of a chat video part (ParamError when nothing decodes)."""
    import av

    bad = ParamError(param, f"Invalid {param}: provided content is not a valid video.")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ParamError(param, f"Invalid {param}: the file has no video stream (audio only?).")
            stream = container.streams.video[0]
            if stream.codec_context is not None:
                _check_frame_pixels(stream.codec_context.width, stream.codec_context.height, param)
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else DEFAULT_SOURCE_FPS
            total = stream.frames
        if total <= 0:  # the container does not say: count by decoding once
            total = sum(1 for _ in _frames(data, param))
        video = _sample(data, sampling, total, fps, param)
        if video is None:  # fewer frames than the header said: sample the frames that exist
            video = _sample(data, sampling, sum(1 for _ in _frames(data, param)), fps, param)
    except ParamError:
        raise
    except (av.FFmpegError, ValueError, OSError, EOFError, IndexError) as exc:
        raise bad from exc
    if video is None or not len(video.frames):
        raise bad
    return video


def decode_chat_frames(images: Sequence[bytes], sampling: VideoSampling, *, param: str) -> ChatVideo:
    """vLLM's video of separate frames (`data:video/jpeg;base64,<frame>,<frame>,...`: api/data_urls.py), each
    frame an image: the clip taken at DEFAULT_SOURCE_FPS (nothing states a rate; transformers' fallback too),
    its sampled frames decoded and resized as a video's. ParamError(param) for a frame that is no image, or
    of another size than the first."""
    if not images:
        raise ParamError(param, f"Invalid {param}: the video/jpeg data URL holds no frame.")
    wanted = sampling.indices(len(images), DEFAULT_SOURCE_FPS)
    want = collections.Counter(wanted)
    kept: list[np.ndarray] = []
    first: tuple[int, ...] = ()
    for i in sorted(want):
        frame = decode_image(images[i], param=param)  # [H, W, 3]
        if first and frame.shape[:2] != first:
            raise ParamError(param, f"{param}: the frames differ in size ({first[1]}x{first[0]} and "
                             f"{frame.shape[1]}x{frame.shape[0]}); send frames of one size")  # fmt: skip
        first = frame.shape[:2]
        kept.extend([_resized(Image.fromarray(frame), sampling, len(wanted))] * want[i])
    return ChatVideo(frames=np.stack(kept), indices=tuple(wanted), source_fps=DEFAULT_SOURCE_FPS)


def _frames(data: bytes, param: str):
    """The clip's frames, each checked against the image pixel limit before it is converted."""
    import av

    with av.open(io.BytesIO(data), mode="r") as container:
        for frame in container.decode(container.streams.video[0]):
            _check_frame_pixels(frame.width, frame.height, param)
            yield frame


def _check_frame_pixels(width: int, height: int, param: str) -> None:
    """A video frame above the image pixel limit is refused as an image that size is (a chat video's sampled
    frames are converted at full size before they are resized)."""
    if width * height > max_pixels():
        raise too_large(param, width * height, f"a video frame of {width}x{height}")


def _sample(data: bytes, sampling: VideoSampling, total: int, fps: float, param: str) -> ChatVideo | None:
    """Decode once, keeping and resizing the sampled frames; None when the clip has fewer than `total`."""
    if total <= 0:
        return None
    wanted = sampling.indices(total, fps)
    want = collections.Counter(wanted)  # an index repeats when num_frames exceeds the clip's length
    kept: list[np.ndarray] = []
    for i, frame in enumerate(_frames(data, param)):
        if i > wanted[-1]:
            break
        if i not in want:
            continue
        kept.extend([_resized(frame.to_image(), sampling, len(wanted))] * want[i])
    if len(kept) != len(wanted):
        return None
    return ChatVideo(frames=np.stack(kept), indices=tuple(wanted), source_fps=fps)


def _resized(img: Image.Image, sampling: VideoSampling, num_frames: int) -> np.ndarray:
    """A sampled RGB frame resized (PIL bicubic) to the size Qwen3-VL's processor gives a clip of `num_frames`
    frames: uint8 [h, w, 3]."""
    h, w = sampling.frame_size(num_frames, img.height, img.width)
    return np.asarray(img.resize((w, h), resample=Image.Resampling.BICUBIC), dtype=np.uint8)


def _invalid(param: str) -> ParamError:
    if param == "input_reference":
        return ParamError(param, invalid_reference(param))
    return ParamError(param, f"Invalid {param}: provided content is not a valid video.")


def decode_reference(
    data: bytes, *, max_frames: int, keep: str = "first", param: str = "input_reference"
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(image, None) when Pillow decodes `data`, else (None, video) when PyAV does, else ParamError. An image
    Pillow recognises but refuses (too many pixels) is a ParamError, not retried as a one-frame video."""
    try:
        return decode_image(data, param=param), None
    except ImageTooLarge:
        raise
    except ParamError:
        pass
    return None, decode_video(data, max_frames, keep, param=param)


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

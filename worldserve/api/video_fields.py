"""vLLM-Omni's resolution of a video request's fields into VideoParams (serving-api.md §4.1), after the body is
read and the references decoded (api/video_inputs.py): top-level fields, a JSON `video_params` object filling
the gaps, `extra_params` keys over them, `size` over width / height, fps 24, and `num_frames` from `seconds` x
fps only when still unset, rounded to the nearest 4k+1; an I2V or V2V request without a size takes the image's
(the clip's first frame's) aspect ratio at the 720p area (§4.3, vLLM-Omni's pre_process_func). Beyond it:
guidance_scale 0 means the default, and numbers are bounded
before any arithmetic on them (a size's digits, seconds x fps), and the server's defaults
(--default-sampling-params) fill what a request leaves unset. Errors name the field the value came in.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from worldserve.api.protocol import ExtraParams, VideoCreateRequest, VideoParamsObject
from worldserve.param_errors import ParamError, shown
from worldserve.params import MAX_FPS, LoraRequest, VideoParams
from worldserve.resolution_tiers import MAX_SECONDS, MAX_SIDE, aspect_size, check_side


def resolve_video_params(
    req: VideoCreateRequest,
    vp: VideoParamsObject,
    extra: ExtraParams,
    image: np.ndarray | None,
    video: np.ndarray | None,
    source: str,
    defaults: Mapping[str, Any] = MappingProxyType({}),
    lora: LoraRequest | None = None,
) -> VideoParams:
    """vLLM-Omni's resolution (serving-api.md §4.1): top-level fields, `video_params` filling the gaps,
    `size` over width / height, fps 24, num_frames from `seconds` only if still unset; `extra_params`
    keys win over the top level; an I2V or V2V request without a size takes the image's (the clip's) aspect
    ratio (§4.3). Beyond it: guidance_scale 0 means the default (the pipeline tests truthiness). An error names
    the field the value came in (`extra_params.<key>`, `video_params`, `seconds`, the reference's `source`).
    `defaults` (the server's, VideoParams field names: --default-sampling-params, --flow-shift) fill what the
    request leaves unset, before the model defaults: a default size before an I2V image's aspect ratio, a
    default fps before `seconds` becomes frames. `lora` is the adapter the request runs with (its own or the
    server's: api/lora_field.py)."""
    kw: dict[str, Any] = {"prompt": req.prompt, "lora": lora}
    # (VideoParams names its own fields: the conditioning `image` / `video` came in the reference's field)
    origin = {"image": source or "input_reference", "video": source or "input_reference"}
    _take_request_fields(req, vp, extra, kw, origin)
    _take_server_defaults(defaults, kw)
    if "guidance_interval" in kw:
        kw["guidance_interval"] = tuple(float(v) for v in kw["guidance_interval"])
    _take_size(req, vp, image, video, defaults, kw, origin)
    _take_frames(req, defaults, kw, origin)
    _take_conditioning(extra, kw, origin)
    return VideoParams(**kw, image=image, video=video).validate_as(origin)


def _take_request_fields(
    req: VideoCreateRequest,
    vp: VideoParamsObject,
    extra: ExtraParams,
    kw: dict[str, Any],
    origin: dict[str, str],
) -> None:
    """Into `kw` (VideoParams fields) the request's values but the size's, and into `origin` the field each
    came in when not its own: the top level, then `video_params`' fps / num_frames where still unset, then
    `extra_params` keys over both; then the sound's duration (the first given of three fields)."""
    top = ("negative_prompt", "num_inference_steps", "guidance_scale", "flow_shift", "seed", "max_sequence_length",
           "generate_sound", "fps", "num_frames")  # fmt: skip
    for name in top:
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    for name in ("fps", "num_frames"):
        if name not in kw and getattr(vp, name) is not None:
            kw[name], origin[name] = getattr(vp, name), "video_params"
    for key, name in (("negative_prompt", "negative_prompt"), ("num_inference_steps", "num_inference_steps"),
                      ("guidance_scale", "guidance_scale"), ("flow_shift", "flow_shift"), ("seed", "seed"),
                      ("max_sequence_length", "max_sequence_length"), ("generate_sound", "generate_sound"),
                      ("guidance_interval", "guidance_interval"), ("use_duration_template", "add_duration_template"),
                      ("use_resolution_template", "add_resolution_template"),
                      ("negative_metadata_mode", "negative_metadata"),
                      ("use_system_prompt", "use_system_prompt"), ("system_prompt", "system_prompt"),
                      ("upsample_prompt", "upsample_prompt")):  # fmt: skip
        if getattr(extra, key) is not None:
            kw[name], origin[name] = getattr(extra, key), f"extra_params.{key}"
    if kw.get("guidance_scale") == 0:
        del kw["guidance_scale"]  # Cosmos3 takes a scale of 0 as "not given": 6.0
    if extra.sound_gen is not None and extra.generate_sound is None:
        kw["generate_sound"] = extra.sound_gen
    for name, value in (("sound_duration", req.sound_duration), ("extra_params.sound_duration",
                        extra.sound_duration), ("extra_params.audio_duration", extra.audio_duration)):  # fmt: skip
        if value is not None:  # (the top level first, as vLLM-Omni reads them)
            kw["sound_duration"], origin["sound_duration"] = value, name
            break


def _take_server_defaults(defaults: Mapping[str, Any], kw: dict[str, Any]) -> None:
    """Into `kw` the server's `defaults` for the fields the request left unset (but the size, fps, frames
    and sound: see their steps)."""
    for name, value in defaults.items():
        if name in ("width", "height", "fps", "num_frames", "generate_sound") or name in kw:
            continue  # the size, fps and frames in their own steps, with the request's; the sound in build_inputs
        kw[name] = value
        if name == "negative_prompt":  # the server's text: not capped by the request's max_sequence_length
            kw["server_negative_prompt"] = True


def _take_size(
    req: VideoCreateRequest, vp: VideoParamsObject, image: np.ndarray | None, video: np.ndarray | None,
    defaults: Mapping[str, Any], kw: dict[str, Any], origin: dict[str, str],
) -> None:  # fmt: skip
    """Into `kw` the width and height `_frame_size` resolves (none: the model default), and into `origin` the
    field they came in."""
    default_size = (defaults["width"], defaults["height"]) if "width" in defaults else None
    # (V2V: the clip's first frame sets the aspect ratio, as an I2V image does: vLLM-Omni's pre_process_func)
    size = _frame_size(req, vp, image if image is not None or video is None else video[0], default_size)
    if size is not None:
        kw["width"], kw["height"] = size
    # (VideoParams names a bad side, or the area of both, `width` / `height`: the field they came in here)
    if req.size is not None:
        origin["width"] = origin["height"] = "size"
    elif req.width is None and vp.width is not None:
        origin["width"] = origin["height"] = "video_params"


def _take_frames(
    req: VideoCreateRequest, defaults: Mapping[str, Any], kw: dict[str, Any], origin: dict[str, str]
) -> None:
    """Into `kw` the fps (the request's, else the server's, else the model's: bounded here) and, when still
    unset, num_frames from `seconds` at that fps, else the server's default frames."""
    fps = kw.setdefault("fps", defaults.get("fps", VideoParams.__dataclass_fields__["fps"].default))
    if fps > MAX_FPS:  # (bounded before seconds x fps: 1e308 would overflow)
        raise ParamError(origin.get("fps", "fps"), f"fps={shown(fps)} must be a number in [1, {MAX_FPS}]")
    if "num_frames" not in kw and req.seconds is not None:
        kw["num_frames"], origin["num_frames"] = frames_from_seconds(req.seconds, fps), "seconds"
    if "num_frames" in defaults:
        kw.setdefault("num_frames", defaults["num_frames"])


def _take_conditioning(extra: ExtraParams, kw: dict[str, Any], origin: dict[str, str]) -> None:
    """Into `kw` `extra_params`' conditioning frames and kept-video switch, named by their `extra_params` keys
    in `origin` (whether given or not)."""
    origin["condition_frame_indexes"] = "extra_params.condition_frame_indexes_vision"
    origin["condition_video_keep"] = "extra_params.condition_video_keep"
    if extra.condition_frame_indexes_vision is not None:
        kw["condition_frame_indexes"] = tuple(extra.condition_frame_indexes_vision)
    if extra.condition_video_keep is not None:
        kw["condition_video_keep"] = extra.condition_video_keep


def _frame_size(
    req: VideoCreateRequest, vp: VideoParamsObject, image: np.ndarray | None,
    default: tuple[int, int] | None = None,
) -> tuple[int, int] | None:  # fmt: skip
    """(width, height): `size`, else width / height (the top level's, then video_params'; a side out of range
    names its field), else the server's `default`, else an I2V image's (or a V2V clip's first frame's) aspect
    ratio at the 720p area; None: the model default."""
    if req.size is not None:
        return _parse_size(req.size)
    width = req.width if req.width is not None else vp.width
    height = req.height if req.height is not None else vp.height
    if (width is None) != (height is None):
        missing = "height" if height is None else "width"
        from_top = (req.width if height is None else req.height) is not None  # the side that was given
        raise ParamError(missing if from_top else "video_params",
                         f"width and height must be given together ({missing} is missing)")  # fmt: skip
    if width is not None and height is not None:  # (one without the other was refused above)
        for name, value, given in (("width", width, req.width), ("height", height, req.height)):
            check_side(name, value, param=name if given is not None else "video_params")
        return width, height
    if default is not None:
        return default
    return None if image is None else aspect_size(image.shape[1], image.shape[0])


def _parse_size(size: str) -> tuple[int, int]:
    """WIDTHxHEIGHT (digits: the request model checked) as ints; a side longer than MAX_SIDE's digits is a
    400 before int() (which refuses past 4300 digits)."""
    sides = [text.lstrip("0") or "0" for text in size.split("x")]
    for name, text in zip(("width", "height"), sides, strict=True):
        if len(text) > len(str(MAX_SIDE)):
            raise ParamError("size", f"{name}={shown(text)} must be at most {MAX_SIDE}")
    return int(sides[0]), int(sides[1])


def frames_from_seconds(seconds: str, fps: float) -> int:
    """num_frames for `seconds` (digits, no leading zero: the request model checked) at `fps` (at most
    MAX_FPS), rounded to the nearest 4k+1; past MAX_SECONDS a 400 before any conversion, and a 400 when it
    rounds to one frame (a still image without sound, which a duration does not ask for)."""
    if len(seconds) > len(str(MAX_SECONDS)) or int(seconds) > MAX_SECONDS:
        raise ParamError("seconds", f"seconds={shown(seconds)} is above {MAX_SECONDS}: no resolution allows "
                         "a longer video, even at 1 fps")  # fmt: skip
    frames = 4 * max(0, round((int(seconds) * fps - 1) / 4)) + 1
    if frames == 1:
        raise ParamError("seconds", f"seconds={seconds} at fps={fps:g} is {int(seconds) * fps:g} frames, fewer than "
                         "the shortest video's 5: ask for more seconds or a higher fps (num_frames 1 for an image)")  # fmt: skip
    return frames

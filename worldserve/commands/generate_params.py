"""`worldserve generate`'s flags -> a validated VideoParams, checked before the model loads; and the flag to
name when a request field is refused (VideoParams reports the API's field names: `--steps` for
num_inference_steps, `--condition-frames` for extra_params.condition_frame_indexes_vision).

Separate from commands/generate.py, which defines the flags and runs the generation: this is the input side
alone. A flag left out takes a video's defaults (VideoParams'), or with `--num-frames 1` the text-to-image
ones of /v1/images/generations (IMAGE_DEFAULTS). The conditioning inputs (`--image`, `--video`,
`--prompt-file`) are read and decoded here, and every output is checked writable and distinct from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from worldserve.commands.cli_inputs import (
    MAX_MEDIA_FILE_BYTES,
    check_writable,
    lora_arg,
    read_input,
)
from worldserve.params import IMAGE_DEFAULTS, ParamError, VideoParams

OUTPUT_SUFFIXES = (".mp4", ".png", ".npz")
MAX_TEXT_FILE_BYTES = 16 << 20
"""--prompt-file's size at most (a prompt is at most --max-sequence-length tokens, or the upsampling
Reasoner's context with --upsample-prompt)."""


def parse_size(size: str) -> tuple[int, int]:
    parts = size.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ParamError("size", f"size {size!r} must look like 1280x720")
    return int(parts[0]), int(parts[1])


def _defaults(num_frames: int) -> dict[str, Any]:
    """The values of the flags left out: a video's (VideoParams' defaults), or a still's (--num-frames 1) the
    text-to-image ones /v1/images/generations takes (1024x1024, 50 steps, guidance 7 in [400, 1000], shift 3)."""
    if num_frames == 1:
        d = IMAGE_DEFAULTS
        return {"size": f"{d.width}x{d.height}", "steps": d.num_inference_steps, "guidance": d.guidance_scale,
                "flow_shift": d.flow_shift, "guidance_interval": d.guidance_interval}  # fmt: skip
    v = VideoParams(prompt="-")
    return {"size": f"{v.width}x{v.height}", "steps": v.num_inference_steps, "guidance": v.guidance_scale,
            "flow_shift": None, "guidance_interval": None}  # fmt: skip


def build_params(args: argparse.Namespace) -> VideoParams:
    """The validated VideoParams of `generate`'s parsed flags, every input read and every output checked
    before the model loads; ParamError naming the request field (flag_for: the flag) of what is refused."""
    prompt = args.prompt if args.prompt is not None else _read_text(args.prompt_file, "prompt_file")
    left_out = _defaults(args.num_frames)
    given = lambda flag: left_out[flag] if getattr(args, flag) is None else getattr(args, flag)  # noqa: E731
    width, height = parse_size(given("size"))
    steps, guidance, flow_shift = given("steps"), given("guidance"), given("flow_shift")
    interval = _parse_interval(args.guidance_interval) or left_out["guidance_interval"]
    lora = lora_arg(args.lora, args.lora_scale)
    image, video, indexes, keep = _conditioning_inputs(args)
    _check_guidance_and_layout(args, guidance)
    _check_output_paths(args)
    return VideoParams(
        prompt=prompt,
        negative_prompt=args.negative_prompt,
        width=width,
        height=height,
        num_frames=args.num_frames,
        fps=args.fps,
        num_inference_steps=steps,
        guidance_scale=guidance,
        flow_shift=flow_shift,
        seed=args.seed,
        generate_sound=False if args.no_sound else None,
        max_sequence_length=args.max_sequence_length,
        image=image,
        video=video,
        condition_frame_indexes=indexes,
        condition_video_keep=keep,
        guidance_interval=interval,
        add_duration_template=not args.no_duration_template,
        add_resolution_template=not args.no_resolution_template,
        negative_metadata=args.negative_metadata,
        use_system_prompt=args.use_system_prompt,
        system_prompt=args.system_prompt,
        upsample_prompt=args.upsample_prompt,
        lora=lora,
    ).validate()


def _conditioning_inputs(args: argparse.Namespace) -> tuple[Any, Any, tuple[int, ...], str]:
    """(image, video clip, condition frame indexes, which frames of the clip to keep) of --image / --video /
    --condition-frames / --condition-video-keep, the files read and decoded (the clip only to the frames the
    indexes and --num-frames can use); ParamError for an unreadable input, the two inputs together, or a
    clip's flag without --video."""
    image = None
    if args.image is not None:
        from worldserve.media.image import decode_image

        image = decode_image(read_input(args.image, "image", MAX_MEDIA_FILE_BYTES), param="image")
    if args.video is None:  # (they were dropped in silence)
        for flag in ("condition_frames", "condition_video_keep"):
            if getattr(args, flag) is not None:
                raise ParamError(flag, f"--{flag.replace('_', '-')} conditions a --video clip: give --video, or "
                                 "leave it out")  # fmt: skip
    indexes = _parse_indexes("0,1" if args.condition_frames is None else args.condition_frames)
    keep = args.condition_video_keep or "first"
    video = None
    if args.video is not None:
        from worldserve.media.video_input import condition_budget, decode_video

        if image is not None:
            raise ParamError("video", "--image and --video are exclusive")
        budget = min(condition_budget(indexes), args.num_frames) if args.num_frames >= 1 else 1
        video = decode_video(
            read_input(args.video, "video", MAX_MEDIA_FILE_BYTES), budget, keep, param="video"
        )
    return image, video, indexes, keep


def _check_guidance_and_layout(args: argparse.Namespace, guidance: float) -> None:
    """ParamError for --upsample-prompt under tensor parallel, and for a guidance scale that would drop the
    prompt (0) or leave --cfg-parallel-size 2's uncond rank idle (1)."""
    if args.upsample_prompt and args.tensor_parallel_size > 1:  # the Reasoner needs its und tower whole here
        raise ParamError("upsample_prompt", "--upsample-prompt needs the whole und tower in this process "
                         "(not with --tensor-parallel-size > 1)")  # fmt: skip
    if guidance == 0:  # (the API takes 0 as "not given", its default 6.0; here it would drop the prompt)
        raise ParamError("guidance", "--guidance 0 would generate without the prompt; use 1 for the prompt's "
                         "branch alone (no CFG), or a scale above 1")  # fmt: skip
    if guidance == 1 and args.cfg_parallel_size == 2:  # (its second rank would load the model and wait)
        raise ParamError("guidance", "--guidance 1 runs no uncond CFG branch, so --cfg-parallel-size 2 would "
                         "leave its uncond rank idle: drop --cfg-parallel-size, or give a scale above 1")  # fmt: skip


def _check_output_paths(args: argparse.Namespace) -> None:
    """-o and --save-latents: each writable, of a suffix this run writes, and not one of the input files
    (--image, --video, --prompt-file); ParamError naming the output."""
    _check_output(args.output, args.num_frames)
    inputs = [(flag, path) for flag, path in (("--image", args.image), ("--video", args.video),
              ("--prompt-file", args.prompt_file)) if path is not None and str(path) != "-"]  # fmt: skip
    for name, output in (("output", args.output), ("save_latents", args.save_latents)):
        for flag, path in inputs:  # (-o in_v.mp4 with --video in_v.mp4 replaced the clip it was made from)
            if output is not None and os.path.realpath(output) == os.path.realpath(path):
                raise ParamError(name, f"{FLAGS.get(name, '--save-latents')} {output} is the {flag} file: "
                                 "name another output")  # fmt: skip
    if args.save_latents is not None:
        if args.save_latents.suffix.lower() != ".safetensors":  # (a .npz or .pt name got safetensors bytes)
            raise ParamError(
                "save_latents", "--save-latents writes a safetensors file: name it *.safetensors"
            )
        check_writable(args.save_latents, "save_latents", "--save-latents")


FLAGS = {
    "num_inference_steps": "--steps", "guidance_scale": "--guidance", "output": "-o",
    "extra_params.condition_frame_indexes_vision": "--condition-frames", "condition_frames": "--condition-frames",
    "extra_params.condition_video_keep": "--condition-video-keep", "generate_sound": "--no-sound",
    "condition_frame_indexes_vision": "--condition-frames", "width": "--size", "height": "--size",
    "condition_frame_indexes": "--condition-frames",
}  # fmt: skip
"""A request field's flag where its name is not the flag's (the API's names are what VideoParams reports)."""


def flag_for(param: str | None, args: argparse.Namespace) -> str:
    """The flag the user gave for request field `param` (VideoParams names the API's fields)."""
    if param == "messages":  # (the upsampling chat's: its one message is the prompt)
        param = "prompt"
    if param == "prompt" and args.prompt is None:
        return "--prompt-file"
    if param is None:
        return "error"
    return FLAGS.get(param, "--" + param.removeprefix("extra_params.").replace("_", "-"))


def flags_said(message: str, args: argparse.Namespace) -> str:
    """`message` with the request fields it names (snake_case: `max_sequence_length`,
    `condition_frame_indexes_vision`) written as the flags the user gave (the model's checks word them as
    the API's fields)."""

    def said(m: re.Match[str]) -> str:
        word = m.group(0)
        return flag_for(word, args) if word.removeprefix("extra_params.") in _SNAKE_FIELDS else word

    return _FIELD_WORD.sub(said, message)


_SNAKE_FIELDS = frozenset(
    {f.name for f in dataclasses.fields(VideoParams) if "_" in f.name}
    | {"condition_frame_indexes_vision", "condition_video_keep"}
)
"""The request fields whose names can be told from prose (a plain word like `prompt` or `seed` cannot)."""
_FIELD_WORD = re.compile(r"(?<![\w.-])(?:extra_params\.)?[a-z]+(?:_[a-z]+)+\b")


def _check_output(path: Path, num_frames: int) -> None:
    """An output this run can write, checked before the model loads (not after minutes of generation)."""
    if path.suffix.lower() not in OUTPUT_SUFFIXES:
        raise ParamError("output", f"-o must end in one of {', '.join(OUTPUT_SUFFIXES)}")
    if path.suffix.lower() == ".png" and num_frames != 1:
        raise ParamError("output", "a .png output needs --num-frames 1")
    check_writable(path, "output", "-o")


def _parse_interval(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise ParamError(
            "guidance_interval", f"--guidance-interval must be LO,HI (e.g. 400,1000), got {text!r}"
        ) from None
    return lo, hi


def _parse_indexes(text: str) -> tuple[int, ...]:
    try:
        indexes = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ParamError("condition_frames", f"--condition-frames {text!r} must be ints like 0,1") from None
    if not indexes or min(indexes) < 0:
        raise ParamError("condition_frames", "--condition-frames must be non-negative ints like 0,1")
    return indexes


def _read_text(path: Path, param: str) -> str:
    """A UTF-8 text file (a leading byte-order mark dropped: an editor's BOM hid a JSON prompt's `{`), or
    standard input for `-`, at most MAX_TEXT_FILE_BYTES."""
    try:
        return read_input(path, param, MAX_TEXT_FILE_BYTES, stdin_for_dash=True).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ParamError(param, f"{path} is not UTF-8 text (byte {e.start})") from None

"""The chat request's media and template options, checked as the request is read (api/chat.py
`request_options`), before any media work: `mm_processor_kwargs` routed to images and videos as transformers'
processor routes them (`processor_kwargs`), a modality's pixel budget (`pixel_budget`), and
`chat_template_kwargs` without apply_chat_template's own arguments (`template_kwargs`). A bad value is a
ParamError naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worldserve.params import ParamError

MAX_PIXELS = 16777216
"""Largest pixel budget a request may ask for (Qwen3-VL's image `size.longest_edge`): 16384 vision tokens."""
TEMPLATE_ARGUMENTS = frozenset(
    ("conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")
)  # fmt: skip
"""apply_chat_template's own arguments (and the template's `messages`): this server sets them."""
IMAGE_KEYS, VIDEO_KEYS = ("size", "min_pixels", "max_pixels"), ("size", "fps", "num_frames")
MM_HELP = (
    "this server's Qwen3-VL preprocessing takes size, min_pixels, max_pixels (images), size, fps, num_frames "
    "(videos), and images_kwargs / videos_kwargs holding those"
)


def processor_kwargs(mm: Mapping[str, Any] | None) -> tuple[dict, dict]:
    """`mm_processor_kwargs` -> (image options, video options), routed as transformers' processor routes
    them: a flat key to every modality that takes it, `images_kwargs` / `videos_kwargs` to one."""
    images: dict = {}
    videos: dict = {}
    for key, value in (mm or {}).items():
        name = f"mm_processor_kwargs.{key}"
        if key in ("images_kwargs", "videos_kwargs"):
            keys, target = (IMAGE_KEYS, images) if key == "images_kwargs" else (VIDEO_KEYS, videos)
            if not isinstance(value, dict):
                raise ParamError(name, f"{name} must be an object")
            for sub, v in value.items():
                if sub not in keys:
                    raise ParamError(f"{name}.{sub}", f"{name}.{sub} is not supported: {MM_HELP}")
                _set(target, sub, v, name)
        elif key in IMAGE_KEYS or key in VIDEO_KEYS:
            for keys, target in ((IMAGE_KEYS, images), (VIDEO_KEYS, videos)):
                if key in keys:
                    _set(target, key, value, name)
        else:
            raise ParamError(name, f"{name} is not supported: {MM_HELP}")
    return images, videos


def _set(target: dict, key: str, value: Any, name: str) -> None:
    """One routed processor option; a key given both flat and per modality is a 400 (transformers: "passed
    two times"), and no option takes a boolean."""
    if isinstance(value, bool):
        raise ParamError(name, f"{name}: {key} takes a number or an object, not a boolean")
    if key in target:
        raise ParamError(name, f"mm_processor_kwargs sets {key} twice (flat and per modality): give it once")
    target[key] = value


def pixel_budget(opts: dict, modality: str) -> tuple[int | None, int | None]:
    """(min_pixels, max_pixels) that `opts` ask for (None: the default), each in [1, MAX_PIXELS]."""
    where = f"mm_processor_kwargs ({modality})"
    size = opts.get("size")
    if size is not None and (
        not isinstance(size, dict) or not size or set(size) - {"shortest_edge", "longest_edge"}
    ):
        raise ParamError(
            "mm_processor_kwargs.size", 'size takes {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS} '
            "(pixel counts, as Qwen3-VL's processor)",
        )  # fmt: skip
    size = size or {}
    lo, hi = (
        opts.get("min_pixels", size.get("shortest_edge")),
        opts.get("max_pixels", size.get("longest_edge")),
    )
    for value in (lo, hi):
        if value is not None and (type(value) is not int or not 1 <= value <= MAX_PIXELS):
            raise ParamError("mm_processor_kwargs", f"{where}: pixel counts must be integers in [1, {MAX_PIXELS}], "
                             f"got {value!r}")  # fmt: skip
    if lo is not None and hi is not None and lo > hi:
        raise ParamError("mm_processor_kwargs", f"{where}: min pixels {lo} > max pixels {hi}")
    return lo, hi


def template_kwargs(kwargs: Mapping[str, Any] | None) -> dict:
    """`chat_template_kwargs` checked: the template's variables, none of apply_chat_template's own arguments."""
    for key in kwargs or {}:
        if key in TEMPLATE_ARGUMENTS:
            raise ParamError(f"chat_template_kwargs.{key}", f"chat_template_kwargs.{key} is not supported: "
                             "this server sets it (chat_template_kwargs carry the template's own variables)")  # fmt: skip
    return dict(kwargs or {})

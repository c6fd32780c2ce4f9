"""The chat request's media and template options, checked as the request is read (api/chat.py
`request_options`), before any media work: `mm_processor_kwargs` routed to images and videos as transformers'
processor routes them (`processor_kwargs`), a modality's pixel budget (`pixel_budget`), and
`chat_template_kwargs` without the apply_chat_template arguments this server sets (`template_kwargs`; the four
vLLM passes the template from the request may be laid over the request's own there). A bad value is a
ParamError naming the field. The server's `--media-io-kwargs` / `--mm-processor-kwargs` are the defaults a
request's own lay over (`MediaDefaults`): option by option once routed to a modality, a server default that
would contradict the request's own (another video sampling, a pixel bound on the wrong side of the request's)
stepping aside, so a request valid on its own is never refused for the server's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from worldserve.params import ParamError

MAX_PIXELS = 16777216
"""Largest pixel budget a request may ask for (Qwen3-VL's image `size.longest_edge`): 16384 vision tokens."""
TEMPLATE_ARGUMENTS = frozenset(
    ("conversation", "conversations", "messages", "chat_template", "tokenize", "sanitize_control_tokens",
     "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
     "tokenizer_kwargs")
)  # fmt: skip
"""apply_chat_template's own arguments (and the template's `messages`) that this server sets. The four that
vLLM passes the template from the request (`add_generation_prompt`, `continue_final_message`, `tools`,
`documents`) may be given here too, and win for the template's text, as vLLM lays chat_template_kwargs over
them (the answer's role and the tool parser still follow the request's own fields, as in vLLM)."""
TEMPLATE_SWITCHES = ("add_generation_prompt", "continue_final_message")
IMAGE_KEYS = ("size", "min_pixels", "max_pixels")
VIDEO_KEYS = ("size", "fps", "num_frames", "do_sample_frames")
MM_HELP = (
    "this server's Qwen3-VL preprocessing takes size, min_pixels, max_pixels (images), size, fps, num_frames, "
    "do_sample_frames (videos), and images_kwargs / videos_kwargs holding those"
)
PIXEL_KEYS = ("size", "min_pixels", "max_pixels")
"""The options that set a modality's pixel budget (`size` holds the other two under other names)."""
SWITCH_KEYS = ("do_sample_frames",)
"""The options that take true or false (transformers' VideosKwargs `do_sample_frames`); the others, numbers."""


SAMPLING_KEYS = ("fps", "num_frames")
"""The video sampling options, given in media_io_kwargs.video or in mm_processor_kwargs (not both)."""


@dataclass(frozen=True, slots=True)
class MediaDefaults:
    """The server's `--media-io-kwargs` and `--mm-processor-kwargs`: what chat requests' own lay over."""

    media_io: Mapping[str, Any] = field(default_factory=dict)
    mm_processor: Mapping[str, Any] = field(default_factory=dict)

    def under(self, media_io: Any, mm: Any) -> tuple[Any, Any]:
        """A request's (media_io_kwargs, mm_processor_kwargs) laid over these, as vLLM merges them: media_io
        per modality (a value that is no object stays the request's, for its 400); mm_processor routed to
        each modality first (`processor_kwargs`: the request's own mistakes are its 400s here), then option
        by option, in images_kwargs / videos_kwargs (a request's per-modality key replaces the server's flat
        one). Defaults that would contradict the request's own step aside: video sampling (fps / num_frames,
        or do_sample_frames=false) set by the request, in either dict, is set there alone; a pixel bound the
        request set replaces the server's of the same kind, and the server's other bound applies only where
        it stays on its side (a request's min_pixels above the server's max_pixels gets the model's max)."""
        if mm is not None and not isinstance(mm, Mapping):
            raise ParamError("mm_processor_kwargs", "mm_processor_kwargs must be an object")
        images, videos = processor_kwargs(mm)
        server_images, server_videos = processor_kwargs(self.mm_processor)
        io_server = dict(self.media_io)
        video = media_io.get("video") if isinstance(media_io, Mapping) else None
        if any(k in videos for k in SAMPLING_KEYS):  # (the request's rate: the server's do_sample_frames too)
            server_videos = _without(server_videos, (*SAMPLING_KEYS, *SWITCH_KEYS))
            if isinstance(io_server.get("video"), Mapping):
                io_server["video"] = _without(io_server["video"], SAMPLING_KEYS)
        elif videos.get("do_sample_frames") is False or (
            isinstance(video, Mapping) and any(k in video for k in SAMPLING_KEYS)
        ):
            server_videos = _without(server_videos, SAMPLING_KEYS)
        routed = {
            name: opts
            for name, opts in (
                ("images_kwargs", _option_over(images, server_images, "images")),
                ("videos_kwargs", _option_over(videos, server_videos, "videos")),
            )
            if opts
        }
        return _laid_over(media_io, io_server), routed or mm


def _laid_over(request: Any, server: dict) -> Any:
    """media_io_kwargs: the request's modalities over the server's, each object merged key by key."""
    if request is not None and not isinstance(request, Mapping):
        return request
    out = dict(server)
    for key, value in (request or {}).items():
        base = out.get(key)
        out[key] = {**base, **value} if isinstance(base, Mapping) and isinstance(value, Mapping) else value
    return out or request


def _option_over(own: dict, server: dict, modality: str) -> dict:
    """One modality's routed options: the request's `own` over the `server`'s, the pixel budget as `size`
    (which both modalities take; each source's bounds read as pixel_budget reads them, checked there). A
    bound the request set replaces the server's of that kind; the server's other bound is kept unless it is
    on the wrong side of the request's (then it steps aside: the request asked for more, or fewer, pixels
    than that default allows, and a default is no limit)."""
    lo, hi = pixel_budget(own, modality)
    server_lo, server_hi = pixel_budget(server, modality)
    if lo is None and server_lo is not None and (hi is None or server_lo <= hi):
        lo = server_lo
    if hi is None and server_hi is not None and (lo is None or lo <= server_hi):
        hi = server_hi
    out = {k: v for k, v in {**server, **own}.items() if k not in PIXEL_KEYS}
    bounds = {k: v for k, v in (("shortest_edge", lo), ("longest_edge", hi)) if v is not None}
    return out | ({"size": bounds} if bounds else {})


def _without(options: Mapping[str, Any], keys: tuple[str, ...]) -> dict:
    return {k: v for k, v in options.items() if k not in keys}


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
    two times"); do_sample_frames takes true or false, and no other option a boolean."""
    if key in SWITCH_KEYS and not isinstance(value, bool):
        raise ParamError(name, f"{name}: {key} takes true or false, got {value!r}")
    if key not in SWITCH_KEYS and isinstance(value, bool):
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
    """`chat_template_kwargs` checked: the template's variables, none of the apply_chat_template arguments this
    server sets (TEMPLATE_ARGUMENTS); its two switches, when given, true or false."""
    for key, value in (kwargs or {}).items():
        if key in TEMPLATE_ARGUMENTS:
            raise ParamError(f"chat_template_kwargs.{key}", f"chat_template_kwargs.{key} is not supported: "
                             "this server sets it (chat_template_kwargs carry the template's own variables)")  # fmt: skip
        if key in TEMPLATE_SWITCHES and not isinstance(value, bool):
            raise ParamError(f"chat_template_kwargs.{key}", f"chat_template_kwargs.{key} must be true or false, "
                             f"got {value!r}")  # fmt: skip
    return dict(kwargs or {})

"""What the offline Engine's calls return: `VideoOutput` (the MP4 a video request made, as the server writes it,
with its seed and stage timings), `ImageOutput` (one text-to-image frame as a PIL image, `save` encoding it as
the image route does) and `ChatOutput` (a Reasoner answer's samples, `ChatChoice`s: text, finish
reason, token ids; and their token usage, as vLLM's `RequestOutput` / an OpenAI chat completion's choices and
usage carry them). Plain frozen dataclasses: no torch, nothing to release.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worldserve.param_errors import ParamError
from worldserve.params import VideoParams

if TYPE_CHECKING:
    from PIL import Image

VIDEO_EXTENSIONS = (".mp4", ".m4v")
"""The names `VideoOutput.save` writes its MP4 to."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GeneratedOutput:
    """What a video and an image output share: the request as it ran, its times and memory."""

    params: VideoParams
    """The request as it ran (the defaults filled in; its prompt the upsampled one, if asked)."""
    seconds: float
    """Wall time from submission to the output (queueing included; an item of a list from when it was queued,
    the list's checks before that not counted; a call's `n` images are made together: the same for each)."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Per stage: prepare, diffuse (its steps together), decode (vae.decode, audio.decode), encode (a video's
    mux, overlapping the decode)."""
    peak_memory_mb: float = 0.0
    """Peak accelerator memory during the request (0 on the CPU)."""

    @property
    def seed(self) -> int:
        """The initial-noise seed: the same seed and params give the same output (image i of a call seeded
        s: s + i, as the image route's n images)."""
        return self.params.seed

    @property
    def prompt(self) -> str:
        return self.params.prompt


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoOutput(GeneratedOutput):
    """One video of `Engine.generate_video`."""

    video: bytes
    """The MP4: H.264 video, with AAC 48 kHz stereo audio when the request made sound (the server's bytes for
    the same request: the same encoder and options)."""

    def __repr__(self) -> str:
        # (the MP4 by its size: a 720p video's bytes literal had been ~100 M characters, print() froze a notebook)
        return (f"VideoOutput(video=<MP4, {len(self.video):,} bytes>, params={self.params!r}, "
                f"seconds={self.seconds!r}, stage_seconds={self.stage_seconds!r}, "
                f"peak_memory_mb={self.peak_memory_mb!r})")  # fmt: skip

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the MP4 to `path` (ending in .mp4 or .m4v: ParamError naming `path` for another extension, since
        these bytes are an MP4 whatever the name says)."""
        if os.path.splitext(os.fspath(path))[1].lower() not in VIDEO_EXTENSIONS:
            raise ParamError("path", f"{os.fspath(path)!r}: a VideoOutput is an MP4, so its name ends in "
                             f"{' or '.join(VIDEO_EXTENSIONS)} (frames as PNG / NPZ: `worldserve generate -o`, "
                             "or VideoPipeline.generate's arrays)")  # fmt: skip
        from worldserve.media.atomic_write import write_atomically

        write_atomically(path, self.video)  # (whole or not at all: an older file there survives a failure)


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageOutput(GeneratedOutput):
    """One image of `Engine.generate_image` (the frame POST /v1/images/generations encodes for the same
    request)."""

    image: Image.Image
    """The frame, a PIL image in RGB, params.width x params.height."""

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the image to `path` as its extension says (.png, .jpg / .jpeg, .webp), encoded as the image
        route encodes that output_format (JPEG quality 95, lossless WebP); ParamError naming `path` for another
        extension."""
        from worldserve.api.images import FORMATS, encode_image

        ext = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
        if ext not in FORMATS:
            raise ParamError("path", f"cannot tell the image format of {os.fspath(path)!r}: end it in "
                             f"{', '.join('.' + f for f in FORMATS)}")  # fmt: skip
        import numpy as np

        from worldserve.media.atomic_write import write_atomically

        write_atomically(path, encode_image(np.asarray(self.image.convert("RGB")), ext))


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatUsage:
    """Token counts, as an OpenAI chat completion's `usage`."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose K/V came from the prefix cache."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatChoice:
    """One sample of a chat (vLLM's `CompletionOutput`, an OpenAI chat completion's choice)."""

    index: int
    """Its place among the call's `n` samples (0 first); with a seed, sample i draws with seed + i, as the HTTP
    route's choice i does."""
    text: str
    """The answer as the model wrote it (thoughts and tool-call tags included: no parser runs here, as in
    vLLM's `LLM.chat`)."""
    finish_reason: str
    """"stop" (an end token or a stop string) or "length" (max_tokens or the context)."""
    stop_reason: str | int | None = None
    """With finish_reason "stop": the stop string or stop token id that ended it; None for an end token."""
    token_ids: tuple[int, ...] = ()
    """The completion's token ids."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatOutput:
    """A chat's answer: every sample (`outputs`, `n` of them) and the usage of them all, as vLLM's
    `RequestOutput` holds its `CompletionOutput`s. `text`, `finish_reason`, `stop_reason` and `token_ids` are
    the first sample's (all there is with n=1)."""

    outputs: tuple[ChatChoice, ...]
    """The samples in index order (one unless `n` was given)."""
    usage: ChatUsage
    """The prompt counted once, the completion tokens of every sample summed (OpenAI's usage for n > 1)."""

    def __post_init__(self) -> None:
        if not self.outputs:
            raise ValueError("a ChatOutput holds at least one sample")

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

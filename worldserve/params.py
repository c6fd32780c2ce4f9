"""Per-request immutable parameters: VideoParams (generation) with validation that runs before any GPU work.

The API layer and the `generate` CLI build a VideoParams; `validate(limits)` raises `ParamError` naming the
offending field (the API turns it into a 400 with `param` set). Defaults are the Cosmos3 model defaults
(1280x720, 189 frames, 24 fps, 35 steps, CFG 6, seed 42), never generic ones.

Resolution policy: width and height must be multiples of 16; the pixel area picks the model's tier
(256p / 480p / 720p, the largest being 1280x720-sized) and each tier caps num_frames as cosmos-framework
does (400 / 300 / 200). Any multiple-of-16 size inside the 720p area is accepted (diffusers accepts any);
an image (num_frames 1) may go up to the 1024x1024 area (vLLM-Omni's text-to-image default), with the
720p tier's default flow shift (the images route passes 3.0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

# (tier name, max pixel area, max frames, default flow shift). Areas: 320x256, 640x640, 1280x720.
RESOLUTION_TIERS: tuple[tuple[str, int, int, float], ...] = (
    ("256", 320 * 256, 400, 3.0),
    ("480", 640 * 640, 300, 5.0),
    ("720", 1280 * 720, 200, 10.0),
)
MAX_SIDE = 1280
SIZE_MULTIPLE = 16
IMAGE_MAX_AREA = 1024 * 1024
"""Images (num_frames 1) may go up to 1024x1024, vLLM-Omni's Cosmos3 text-to-image default (above the 720p area)."""


class ParamError(ValueError):
    """A request parameter is invalid. `param` names the field, as in the OpenAI error JSON."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


def resolution_tier(width: int, height: int) -> tuple[str, int, int, float]:
    area = width * height
    for tier in RESOLUTION_TIERS:
        if area <= tier[1]:
            return tier
    raise ParamError(
        "size",
        f"size {width}x{height} is above the model's largest resolution tier (720p: at most "
        f"{RESOLUTION_TIERS[-1][1]} pixels, e.g. 1280x720, 960x960, 720x1280)",
    )


def aspect_size(src_width: int, src_height: int) -> tuple[int, int]:
    """(width, height) for an I2V request that gives no size (serving-api.md §4.3): the image's aspect
    ratio at the 720p pixel area, each side rounded down to a multiple of 16; for an image wider (taller)
    than 16:9 (9:16) the long side is capped at MAX_SIDE and the short one follows the ratio."""
    ratio = src_width / src_height
    area = RESOLUTION_TIERS[-1][1]
    width, height = math.sqrt(area * ratio), math.sqrt(area / ratio)
    shrink = min(1.0, MAX_SIDE / width, MAX_SIDE / height)
    return tuple(
        max(SIZE_MULTIPLE, int(v * shrink) // SIZE_MULTIPLE * SIZE_MULTIPLE) for v in (width, height)
    )


def default_flow_shift(width: int, height: int) -> float:
    """10 at 720p, 5 at 480p, 3 at 256p (the training shift table); 10 for the images above the 720p area."""
    area = width * height
    return next((tier[3] for tier in RESOLUTION_TIERS if area <= tier[1]), RESOLUTION_TIERS[-1][3])


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoParams:
    prompt: str
    """Plain text or a JSON document (the model's native structured prompt)."""
    negative_prompt: str | None = None
    """None: the default negative prompt shipped with worldserve."""
    width: int = 1280
    """Output width in pixels (multiple of 16)."""
    height: int = 720
    """Output height in pixels (multiple of 16)."""
    num_frames: int = 189
    """1 (an image) or 4k+1."""
    fps: float = 24.0
    """Output frame rate; also drives the temporal positions and prompt metadata."""
    num_inference_steps: int = 35
    """Denoising steps (1..200)."""
    guidance_scale: float = 6.0
    """CFG scale (0..20); 1 runs only the conditional branch."""
    flow_shift: float | None = None
    """None: 10 / 5 / 3 by resolution tier."""
    seed: int = 42
    """Initial-noise seed; the same seed gives the same output whatever else is batched."""
    generate_sound: bool | None = None
    """None: on when the checkpoint has a sound tokenizer."""
    max_sequence_length: int = 4096
    """Cap on prompt tokens (after templating); longer prompts are an error."""
    image: np.ndarray | None = None
    """Image-to-video conditioning frame, uint8 (H, W, 3), any size (resized and centre-cropped)."""
    video: np.ndarray | None = None
    """Video-to-video conditioning clip, uint8 (F, H, W, 3), any size (resized to width x height)."""
    condition_frame_indexes: tuple[int, ...] = (0, 1)
    """V2V: latent frames held clean (each < latent_frames); the clip's first max*4+1 frames are encoded."""
    condition_video_keep: str = "first"
    """V2V: take the conditioning frames from the "first" or the "last" end of `video`."""
    guidance_interval: tuple[float, float] | None = None
    """CFG only at the steps whose timestep (0..1000) lies in [lo, hi] (vLLM-Omni's `guidance_interval`; its
    T2I default is [400, 1000]); the other steps run the cond branch alone. None: every step."""
    add_duration_template: bool = True
    """Video: state the duration and fps in the prompt and the negative prompt (plain text: a sentence; JSON
    prompt: its `duration` / `fps` keys). Off for prompts that already say it (vLLM-Omni `use_duration_template`)."""
    add_resolution_template: bool = True
    """State the resolution (plain text: a sentence; JSON prompt: `resolution` / `aspect_ratio`)."""
    use_system_prompt: bool = False
    """Prepend the reference's system message (`system_prompt` replaces its text) to both branches."""
    system_prompt: str | None = None
    """A system message of your own (implies `use_system_prompt`)."""

    @property
    def latent_frames(self) -> int:
        return (self.num_frames - 1) // 4 + 1

    def resolved_flow_shift(self) -> float:
        return self.flow_shift if self.flow_shift is not None else default_flow_shift(self.width, self.height)

    def validate(self) -> VideoParams:
        """Raise ParamError naming the first bad field; return self for chaining."""
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ParamError("prompt", "prompt must be a non-empty string")
        for name in ("width", "height"):
            v = getattr(self, name)
            if v < SIZE_MULTIPLE or v % SIZE_MULTIPLE or v > MAX_SIDE:
                raise ParamError(
                    "size", f"{name}={v} must be a multiple of {SIZE_MULTIPLE} in [16, {MAX_SIDE}]"
                )
        if self.num_frames == 1 and self.width * self.height <= IMAGE_MAX_AREA:
            tier, max_frames = "image", 1
        else:
            tier, _, max_frames, _ = resolution_tier(self.width, self.height)
        if self.num_frames < 1 or (self.num_frames - 1) % 4:
            raise ParamError(
                "num_frames", f"num_frames={self.num_frames} must be 1 or 4k+1 (e.g. 93, 121, 189)"
            )
        if self.num_frames > max_frames:
            raise ParamError(
                "num_frames", f"num_frames={self.num_frames} exceeds the {tier}p limit of {max_frames} frames"
            )
        if not (math.isfinite(self.fps) and 1 <= self.fps <= 120):
            raise ParamError("fps", f"fps={self.fps} must be a number in [1, 120]")
        if not 1 <= self.num_inference_steps <= 200:
            raise ParamError(
                "num_inference_steps", f"num_inference_steps={self.num_inference_steps} must be in [1, 200]"
            )
        if not (math.isfinite(self.guidance_scale) and 0 <= self.guidance_scale <= 20):
            raise ParamError("guidance_scale", f"guidance_scale={self.guidance_scale} must be in [0, 20]")
        if self.flow_shift is not None and not (
            math.isfinite(self.flow_shift) and 0 < self.flow_shift <= 100
        ):
            raise ParamError("flow_shift", f"flow_shift={self.flow_shift} must be in (0, 100]")
        if not -(2**63) <= self.seed < 2**63:
            raise ParamError("seed", f"seed={self.seed} must be in [-2**63, 2**63) (int64)")
        if self.guidance_interval is not None:
            lo, hi = self.guidance_interval
            if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo <= hi <= 1000):
                raise ParamError(
                    "guidance_interval", "guidance_interval must be [lo, hi] with 0 <= lo <= hi <= 1000"
                )
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ParamError("system_prompt", "system_prompt must be a string")
        if not 1 <= self.max_sequence_length <= 131072:
            raise ParamError("max_sequence_length", "max_sequence_length must be in [1, 131072]")
        if self.image is not None:
            img = self.image
            if not (
                isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
            ):
                raise ParamError(
                    "input_reference", "the conditioning image must be decoded to uint8 (H, W, 3)"
                )
            if self.num_frames == 1:
                raise ParamError("input_reference", "image-to-video needs num_frames > 1")
        if self.video is not None:
            self._validate_video()
        return self

    def _validate_video(self) -> None:
        if self.image is not None:
            raise ParamError(
                "input_reference",
                "Cosmos3 non-action generation accepts either image or video input, not both.",
            )
        vid = self.video
        if not (
            isinstance(vid, np.ndarray) and vid.dtype == np.uint8 and vid.ndim == 4 and vid.shape[0] >= 1
            and vid.shape[1] >= 1 and vid.shape[2] >= 1 and vid.shape[3] == 3
        ):  # fmt: skip
            raise ParamError(
                "input_reference", "the conditioning video must be decoded to uint8 (F, H, W, 3)"
            )
        if self.num_frames == 1:
            raise ParamError("input_reference", "video-to-video needs num_frames > 1")
        idx = self.condition_frame_indexes
        name = "extra_params.condition_frame_indexes_vision"
        if not isinstance(idx, tuple) or not idx:
            raise ParamError(name, "condition_frame_indexes_vision must contain at least one index")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in idx):
            raise ParamError(
                name,
                f"condition_frame_indexes_vision must be non-negative ints, e.g. [0, 1]; got {list(idx)}",
            )
        if max(idx) >= self.latent_frames:
            raise ParamError(name, f"condition_frame_indexes_vision {list(idx)} contains an index outside "
                             f"the latent timeline (latent_frames={self.latent_frames} for num_frames="
                             f"{self.num_frames})")  # fmt: skip
        if self.condition_video_keep not in ("first", "last"):
            raise ParamError(
                "extra_params.condition_video_keep", "condition_video_keep must be 'first' or 'last'"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoSampling:
    """Which frames of a chat video the Reasoner sees (Qwen3-VL's video processor defaults; per request:
    `media_io_kwargs.video.fps` / `.num_frames`, mutually exclusive)."""

    fps: float | None = 2.0
    """Frames sampled per second of video (None when num_frames is given)."""
    num_frames: int | None = None
    """Exactly this many frames, evenly spread (a shorter clip repeats frames, as transformers does)."""
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 32 * 32
    """Lower bound of sampled frames x height x width after resizing (Qwen3-VL `size.shortest_edge`)."""
    max_pixels: int = 768 * 32 * 32
    """Upper bound of the same product (`size.longest_edge`): more frames, smaller frames."""
    factor: int = 32
    """Frame sides become multiples of patch 16 x merge 2."""
    temporal_patch: int = 2
    """Frames per ViT temporal patch (the frame count is padded to a multiple of it)."""

    def validate(self) -> VideoSampling:
        if self.fps is not None and self.num_frames is not None:
            raise ParamError("media_io_kwargs", "video fps and num_frames are mutually exclusive")
        if self.fps is not None and not (math.isfinite(self.fps) and self.fps > 0):
            raise ParamError("media_io_kwargs", f"video fps must be > 0, got {self.fps}")
        if self.num_frames is not None and not 1 <= self.num_frames <= self.max_frames:
            raise ParamError(
                "media_io_kwargs",
                f"video num_frames must be in [1, {self.max_frames}], got {self.num_frames}",
            )
        return self

    def indices(self, total_frames: int, source_fps: float) -> list[int]:
        """Qwen3-VL `sample_frames`: n = total / source_fps * fps, clamped to [min_frames, max_frames] and the
        clip length (or exactly num_frames, repeating frames of a shorter clip), at round(linspace(0, total - 1, n))."""
        if self.num_frames is not None:
            n = self.num_frames
        else:
            n = int(total_frames / source_fps * (self.fps or 2.0))
            n = min(max(n, self.min_frames), self.max_frames, total_frames)
        return np.linspace(0, total_frames - 1, n).round().astype(int).tolist()

    def frame_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """Qwen3-VL video `smart_resize`: (height, width) as multiples of `factor`, near the aspect ratio,
        with round(num_frames / 2) * 2 * height * width within [min_pixels, max_pixels]."""
        f, tf = self.factor, self.temporal_patch
        if height < f or width < f:
            scale = max(f / height, f / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > 200:
            raise ParamError("messages", "video aspect ratio must be smaller than 200")
        h_bar, w_bar = round(height / f) * f, round(width / f) * f
        t_bar = round(num_frames / tf) * tf
        if t_bar * h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(num_frames * height * width / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif t_bar * h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (num_frames * height * width))
            h_bar, w_bar = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h_bar, w_bar


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatVideo:
    """A decoded chat video: the sampled frames and where they sit in the clip."""

    frames: np.ndarray
    """uint8 RGB (N, H, W, 3): the sampled frames in order, already resized to the ViT's input size."""
    indices: tuple[int, ...]
    """Their frame numbers in the source clip (timestamps = index / source_fps)."""
    source_fps: float
    """The clip's average frame rate."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatPart:
    """One content part of a chat message: text, a decoded image or a decoded video."""

    type: str
    """"text", "image" or "video"."""
    text: str = ""
    """The text of a text part."""
    image: np.ndarray | None = None
    """uint8 RGB (H, W, 3) of an image part."""
    video: ChatVideo | None = None
    """The sampled frames of a video part."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatMessage:
    role: str
    """"system", "user", "assistant" or "tool"."""
    content: str | tuple[ChatPart, ...]
    """A plain string or a sequence of parts."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatParams:
    """One Reasoner chat completion (OpenAI /v1/chat/completions, n = 1), or a raw text completion
    (/v1/completions: `prompt_ids`, no messages, no chat template), validated at the boundary."""

    messages: tuple[ChatMessage, ...] = ()
    """The conversation; the reply is the next assistant turn. Empty with `prompt_ids`."""
    prompt_ids: tuple[int, ...] | None = None
    """A raw prompt's token ids, continued as they are (positions (k, k, k)); None: render `messages`."""
    max_tokens: int | None = None
    """Completion token budget; None: up to the context length."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """0 or -1: no top-k."""
    seed: int | None = None
    """Sampling seed (None: random)."""
    stop: tuple[str, ...] = ()
    """Strings that end the completion (not included in the output)."""
    presence_penalty: float = 0.0
    """OpenAI presence penalty in [-2, 2] over the output tokens."""
    frequency_penalty: float = 0.0
    """OpenAI frequency penalty in [-2, 2] over the output tokens."""
    repetition_penalty: float = 1.0
    """vLLM repetition penalty (> 0; 1 = off) over the prompt and output tokens."""
    logprobs: bool = False
    """Return each output token's log-probability."""
    top_logprobs: int = 0
    """With logprobs: also the this-many most likely tokens at each position (0-20)."""
    ignore_eos: bool = False
    """vLLM's: keep generating past the end-of-sequence tokens (up to max_tokens)."""
    min_tokens: int = 0
    """vLLM's: no end of sequence (and no stop string or stop token id) before this many tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """vLLM's: more token ids that end the completion (its stop_reason is then the id)."""
    include_stop_str_in_output: bool = False
    """vLLM's: a matched stop string stays at the end of the text."""
    prebuilt: Any = field(default=None, compare=False, repr=False)
    """The prompt built from these params (runner/chat_prompt.py's ChatPrompt: template, tokens, media),
    when the API built it in its own worker thread; None: the Reasoner builds it (on the chat worker's
    thread, where a megabytes-long prompt would hold up every running chat while it tokenizes)."""
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra chat template variables (`chat_template_kwargs`, e.g. enable_thinking)."""
    image_min_pixels: int | None = None
    """Qwen3-VL image processor `size.shortest_edge` (pixel budget floor) for this request (None: the server's)."""
    image_max_pixels: int | None = None
    """`size.longest_edge` (pixel budget ceiling; None: the server's)."""

    @property
    def prompt_key(self) -> int:
        """What the choices of one request share, and no other live request does: the identity of their
        messages, or of their raw prompt ids (the empty messages tuple of a raw prompt is one shared object).
        The Reasoner prefills chats with one key once; the chat worker counts that prompt once."""
        return id(self.messages if self.prompt_ids is None else self.prompt_ids)

    def choices(self, n: int) -> list[ChatParams]:
        """These params as the n choices of one request: choice i samples with seed + i (different
        samples, the same ones on every run)."""
        return [self] + [
            replace(self, seed=None if self.seed is None else self.seed + i) for i in range(1, n)
        ]

    def validate(self) -> ChatParams:
        if self.prompt_ids is not None:
            if not self.prompt_ids:
                raise ParamError("prompt", "the prompt must contain at least one token")
            if self.messages:
                raise ParamError("messages", "a raw prompt (prompt_ids) takes no messages")
        elif not self.messages:
            raise ParamError("messages", "messages must contain at least one message")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ParamError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ParamError("top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ParamError("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ParamError("stop", "stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise ParamError(name, f"{name} must be in [-2, 2], got {value}")
        if not 0 <= self.top_logprobs <= 20:
            raise ParamError("top_logprobs", f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2):
            raise ParamError(
                "repetition_penalty", f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        return self

"""Per-request immutable parameters: VideoParams (generation) with validation that runs before any GPU work.

The API layer and the `generate` CLI build a VideoParams; `validate()` raises `ParamError` (param_errors.py)
naming the offending field (the API turns it into a 400 with `param` set). Defaults are the Cosmos3 model
defaults (1280x720, 189 frames, 24 fps, 35 steps, CFG 6, seed 42), never generic ones. The sizes, frame
counts and flow shifts it takes are the resolution policy of resolution_tiers.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from worldserve.param_errors import ParamError, shown
from worldserve.param_types import (
    check_bool,
    check_int,
    check_real,
    check_real_pair,
    check_str,
    is_int,
    is_real,
)
from worldserve.resolution_tiers import (
    FLOW_SHIFT_RANGE,
    IMAGE_MAX_AREA,
    MAX_SECONDS,
    RESOLUTION_TIERS,
    SIZE_MULTIPLE,
    V2V_FLOW_SHIFT,
    check_side,
    default_flow_shift,
    flow_shift_ok,
    resolution_tier,
)

INT64 = 2**63
"""Seeds are int64: [-INT64, INT64) (torch.Generator.manual_seed; vLLM's range)."""


def choice_seed(seed: int, i: int) -> int:
    """The seed of choice i of a request seeded `seed` (n images, n chat choices): seed + i, wrapped to stay
    an int64."""
    return (seed + i + INT64) % (2 * INT64) - INT64


MAX_FPS = 120
NEGATIVE_METADATA_MODES = ("same", "inverse", "none")
"""VideoParams.negative_metadata's values (vLLM-Omni's extra_params.negative_metadata_mode)."""
DEFAULT_MAX_SEQUENCE_LENGTH = 4096
"""A prompt's tokens after templating, at most, by default (vLLM-Omni's)."""


@dataclass(frozen=True)
class ImageDefaults:
    """vLLM-Omni's Cosmos3 text-to-image defaults (serving-api.md §4.4): what /v1/images/generations and
    `generate --num-frames 1` take for the fields a request leaves out (cosmos-framework's own text2image
    differs only in its guidance, 4.0)."""

    width: int = 1024
    height: int = 1024
    num_inference_steps: int = 50
    guidance_scale: float = 7.0
    flow_shift: float = 3.0
    guidance_interval: tuple[float, float] = (400.0, 1000.0)


IMAGE_DEFAULTS = ImageDefaults()


URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/")
"""A text that starts as a URL does (https://, hf://, s3://, file://; `scheme:/` too, as pathlib.Path leaves
`https://host` when a flag's text is read as a path): LoRA adapters are read from the server's disk only."""


def missing_adapter(path: str) -> str:
    """Why nothing is at a LoRA adapter `path` a flag gave (--lora, --lora-path): a URL, or nothing there."""
    return (
        "a URL: give the adapter's local file or folder"
        if URL_SCHEME.match(path)
        else "no such file or folder"
    )


@dataclass(frozen=True, slots=True)
class LoraRequest:
    """A LoRA adapter a generation runs with (vLLM-Omni's `lora` object, `--lora-path` / `--lora-scale`): a
    PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) or diffusers' LoRA file
    (`pytorch_lora_weights.safetensors`, or the folder holding it) on the server (weights/lora_adapter.py),
    the name the request gave it, and the scale its deltas are multiplied by (on top of the adapter's own
    lora_alpha / r). A scale of 0 runs the base model, as vLLM-Omni does."""

    name: str
    path: str
    scale: float = 1.0

    def __post_init__(self) -> None:
        if is_real(self.scale) and type(self.scale) not in (int, float):  # a numpy scalar: a Python float
            object.__setattr__(self, "scale", float(self.scale))

    def validate(self) -> LoraRequest:
        """ParamError naming `lora` unless the name and path are non-empty strings and the scale a finite
        number."""
        if not all(isinstance(v, str) and v for v in (self.name, self.path)):
            raise ParamError("lora", "Invalid lora object: both name and path are required.")
        check_real("lora", "lora scale", self.scale)
        if not math.isfinite(self.scale):
            raise ParamError("lora", f"lora scale must be a finite number, got {shown(self.scale)}")
        return self

    @property
    def active(self) -> bool:
        """Whether the adapter changes anything (a scale of 0 is the base model)."""
        return self.scale != 0


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoParams:
    prompt: str
    """Plain text or a JSON document (the model's native structured prompt)."""
    negative_prompt: str | None = None
    """None: the default negative prompt shipped with worldserve."""
    server_negative_prompt: bool = False
    """`negative_prompt` is the server's default (--default-sampling-params), not the request's: like the
    built-in one it is not capped by max_sequence_length (a cap set for the prompt refuses no text the request
    never sent)."""
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
    """Initial-noise seed: the same seed gives the same noise whatever else is batched, and the same output up
    to a batched forward's rounding (another batch size picks other GEMM kernels: ~1e-5 in float32 latents, a
    level or so in a few pixels)."""
    generate_sound: bool | None = None
    """None: on for a video when the checkpoint has a sound tokenizer, off for an image (num_frames == 1, where
    True is a ParamError: a single frame has no sound)."""
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH
    """Cap on the prompt's tokens after templating (and a given negative prompt's; not the default one); longer
    ones are an error."""
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
    negative_metadata: str = "same"
    """The metadata sentences on the negative prompt: "same" as the prompt's (NVIDIA's reference), "inverse"
    ("The video is not ...": diffusers' and vLLM-Omni's), "none" (the negative text alone)."""
    upsample_prompt: bool = False
    """Have the Reasoner rewrite `prompt` into Cosmos3's JSON prompt first (engine/prompt_upsampling.py)."""
    use_system_prompt: bool = False
    """Prepend the reference's system message (`system_prompt` replaces its text) to both branches."""
    system_prompt: str | None = None
    """A system message of your own (implies `use_system_prompt`)."""
    sound_duration: float | None = None
    """Seconds of audio in the MP4 (vLLM-Omni's `sound_duration`): the sound is generated jointly with the
    video, as long as the clip, then its waveform trimmed or zero-padded to this; None: the clip's length."""

    lora: LoraRequest | None = None
    """The LoRA adapter the transformer runs with; None: the base model (or the server's `--lora-path`, which
    the API fills in for requests that name none)."""

    field_names: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    """(field, the request field its value came in) where they differ (`extra_params.seed`, `video_params`,
    the reference's field), set by `validate_as`: a later check (the model's, the upsampled prompt's) names
    the field the client sent too."""

    @property
    def latent_frames(self) -> int:
        return (self.num_frames - 1) // 4 + 1

    def resolved_flow_shift(self) -> float:
        """The request's shift, else Cosmos3's: V2V_FLOW_SHIFT for video-to-video (vLLM-Omni's constant), the
        resolution's training shift otherwise."""
        if self.flow_shift is not None:
            return self.flow_shift
        return V2V_FLOW_SHIFT if self.video is not None else default_flow_shift(self.width, self.height)

    def validate(self) -> VideoParams:
        """Raise ParamError naming the first bad field; return self for chaining."""
        self._validate_types()
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ParamError("prompt", "prompt must be a non-empty string")
        self._validate_size_and_frames()
        self._validate_sampling()
        self._validate_text_and_sound()
        if self.image is not None:
            self._validate_image()
        if self.lora is not None:
            self._validate_lora()
        if self.video is not None:
            self._validate_video()
        if self.num_frames > 1:  # (an image has no latent timeline to condition)
            self._validate_condition()
        return self

    def validate_as(self, names: Mapping[str, str]) -> VideoParams:
        """`validate()`, a ParamError's field renamed through `names` (VideoParams field -> the request field
        its value came in; a field not in it keeps its name)."""
        named = dataclasses.replace(self, field_names=tuple(names.items()))
        try:
            return named.validate()
        except ParamError as exc:
            raise named.named(exc) from None

    def field_name(self, name: str) -> str:
        """The request field the value of field `name` came in (`field_names`; else `name` itself)."""
        return dict(self.field_names).get(name, name)

    def named(self, exc: ParamError) -> ParamError:
        """`exc` naming the request field its field's value came in."""
        return ParamError(self.field_name(exc.param), exc.message)

    def _validate_types(self) -> None:
        """Each field's type before any comparison (param_types.py): a wrong one had been a raw TypeError, or
        accepted (`num_frames=5.0`, `seed=1.5`) to fail after the prompt's prefill."""
        check_str("prompt", "prompt", self.prompt)
        check_str("negative_prompt", "negative_prompt", self.negative_prompt, optional=True)
        for name in ("width", "height", "num_frames", "num_inference_steps", "seed", "max_sequence_length"):
            check_int(name, name, getattr(self, name))
        for name in ("fps", "guidance_scale"):
            check_real(name, name, getattr(self, name))
        for name in ("flow_shift", "sound_duration"):
            check_real(name, name, getattr(self, name), optional=True)
        check_bool("generate_sound", "generate_sound", self.generate_sound, optional=True)
        for name in ("server_negative_prompt", "add_duration_template", "add_resolution_template",
                     "upsample_prompt", "use_system_prompt"):  # fmt: skip
            check_bool(name, name, getattr(self, name))
        if self.guidance_interval is not None:
            check_real_pair("guidance_interval", "guidance_interval", self.guidance_interval)

    def _validate_size_and_frames(self) -> None:
        """width and height, then num_frames: its form (1 or 4k+1) and the limit of the size's tier (an image
        when a single frame fits IMAGE_MAX_AREA). An image past the largest area is told so before a side past
        MAX_SIDE (OpenAI's 1536x1024 preset: its area is what no side change fixes)."""
        area = self.width * self.height
        sides_fit = (
            min(self.width, self.height) >= SIZE_MULTIPLE
            and self.width % SIZE_MULTIPLE == self.height % SIZE_MULTIPLE == 0
        )
        if self.num_frames == 1 and area > max(IMAGE_MAX_AREA, RESOLUTION_TIERS[-1][1]) and sides_fit:
            raise ParamError("width", f"size {self.width}x{self.height} is above the largest image "
                             f"({IMAGE_MAX_AREA} pixels, e.g. 1024x1024, 1280x816)")  # fmt: skip
        check_side("width", self.width)
        check_side("height", self.height)
        if self.num_frames == 1 and area <= IMAGE_MAX_AREA:
            tier, max_frames = "image", 1
        else:
            tier, _, max_frames, _ = resolution_tier(self.width, self.height)
        if self.num_frames < 1 or (self.num_frames - 1) % 4:
            raise ParamError(
                "num_frames", f"num_frames={shown(self.num_frames)} must be 1 or 4k+1 (e.g. 93, 121, 189)"
            )
        if self.num_frames > max_frames:
            source = self.field_name("num_frames")  # ("seconds": the frames of seconds x fps)
            came = "" if source == "num_frames" else f" (from {source} x fps {self.fps:g})"
            raise ParamError("num_frames", f"num_frames={shown(self.num_frames)}{came} exceeds the {tier}p limit "
                             f"of {max_frames} frames")  # fmt: skip

    def _validate_sampling(self) -> None:
        """fps, steps, guidance scale, flow shift, seed and guidance interval, in that order."""
        if not (math.isfinite(self.fps) and 1 <= self.fps <= MAX_FPS):
            raise ParamError("fps", f"fps={self.fps} must be a number in [1, {MAX_FPS}]")
        if not 1 <= self.num_inference_steps <= 200:
            raise ParamError(
                "num_inference_steps", f"num_inference_steps={self.num_inference_steps} must be in [1, 200]"
            )
        if not (math.isfinite(self.guidance_scale) and 0 <= self.guidance_scale <= 20):
            raise ParamError("guidance_scale", f"guidance_scale={self.guidance_scale} must be in [0, 20]")
        if self.flow_shift is not None and not flow_shift_ok(self.flow_shift):
            raise ParamError("flow_shift", f"flow_shift={self.flow_shift} must be in {FLOW_SHIFT_RANGE}")
        if not -INT64 <= self.seed < INT64:
            raise ParamError("seed", f"seed={self.seed} must be in [-2**63, 2**63) (int64)")
        if self.guidance_interval is not None:
            lo, hi = self.guidance_interval
            if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo <= hi <= 1000):
                raise ParamError(
                    "guidance_interval", "guidance_interval must be [lo, hi] with 0 <= lo <= hi <= 1000"
                )

    def _validate_text_and_sound(self) -> None:
        """The prompt templating's fields (negative metadata, system prompt, max_sequence_length), then the
        sound's duration (its range depends on fps, checked before)."""
        if self.negative_metadata not in NEGATIVE_METADATA_MODES:
            raise ParamError("negative_metadata",
                             f"negative_metadata_mode must be one of {list(NEGATIVE_METADATA_MODES)}")  # fmt: skip
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ParamError("system_prompt", "system_prompt must be a string")
        if not 1 <= self.max_sequence_length <= 131072:
            raise ParamError("max_sequence_length", "max_sequence_length must be in [1, 131072]")
        if self.sound_duration is not None and not (
            math.isfinite(self.sound_duration) and 1 / self.fps <= self.sound_duration <= MAX_SECONDS
        ):
            raise ParamError("sound_duration", f"sound_duration={shown(self.sound_duration)} must be in "
                             f"[1 / fps, {MAX_SECONDS}] seconds ({1 / self.fps:.4g} at fps {self.fps:g})")  # fmt: skip

    def _validate_image(self) -> None:
        """The image-to-video frame: decoded to uint8 (H, W, 3), for a video (num_frames > 1), and large enough
        to cover width x height (media/image.py `check_cover_size`)."""
        img = self.image
        if not (
            isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
        ):
            raise ParamError("image", "the conditioning image must be decoded to uint8 (H, W, 3)")
        if self.num_frames == 1:
            raise ParamError("image", "image-to-video needs num_frames > 1")
        from worldserve.media.image import check_cover_size  # (lazy: media/ imports this module)

        check_cover_size(img.shape[1], img.shape[0], self.width, self.height, "image")

    def _validate_lora(self) -> None:
        """A LoraRequest (an object of another type is refused by name), itself valid."""
        if not isinstance(self.lora, LoraRequest):
            raise ParamError("lora", f"lora must be a LoraRequest (worldserve.params), got "
                             f"{type(self.lora).__name__}")  # fmt: skip
        self.lora.validate()

    def _validate_video(self) -> None:
        if self.image is not None:
            raise ParamError(
                "video", "Cosmos3 non-action generation accepts either image or video input, not both."
            )
        vid = self.video
        if not (
            isinstance(vid, np.ndarray) and vid.dtype == np.uint8 and vid.ndim == 4 and vid.shape[0] >= 1
            and vid.shape[1] >= 1 and vid.shape[2] >= 1 and vid.shape[3] == 3
        ):  # fmt: skip
            raise ParamError("video", "the conditioning video must be decoded to uint8 (F, H, W, 3)")
        if self.num_frames == 1:
            raise ParamError("video", "video-to-video needs num_frames > 1")

    def _validate_condition(self) -> None:
        """The V2V condition indexes and end, checked with or without a reference video: their range
        depends only on num_frames."""
        idx = self.condition_frame_indexes
        name = "condition_frame_indexes"
        if not isinstance(idx, tuple) or not idx:
            raise ParamError(name, "condition_frame_indexes_vision must contain at least one index")
        bad = [i for i in idx if not is_int(i) or i < 0]
        if bad:
            raise ParamError(
                name,
                f"condition_frame_indexes_vision must be non-negative ints, e.g. [0, 1]; got {shown(bad[0])}",
            )
        if max(idx) >= self.latent_frames:
            raise ParamError(name, f"condition_frame_indexes_vision index {shown(max(idx))} is outside the "
                             f"latent timeline (latent_frames={self.latent_frames} for num_frames="
                             f"{self.num_frames})")  # fmt: skip
        if self.condition_video_keep not in ("first", "last"):
            raise ParamError("condition_video_keep", "condition_video_keep must be 'first' or 'last'")

"""Wire shapes of the video API (pydantic v2): the create request, the OpenAI/vLLM-Omni job object, list,
delete, model list (vLLM's `ModelList`, `owned_by` "vllm") and error envelope (serving-api.md §3.2, §4.1,
§6, §7.2).

`VideoCreateRequest` validates field types, ranges and regexes the same way for multipart, urlencoded and
JSON bodies (form strings are coerced: "24" -> 24, "yes" -> True); cross-field rules and model limits are
applied later by `video_inputs.py` / `video_fields.py` and `VideoParams.validate`. Undeclared fields are ignored, as in
vLLM-Omni. `VideoObject.from_job` is the one place a stored `Job` becomes the job JSON.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from worldserve.engine.client import Job
from worldserve.params import INT64


def _is_number(annotation: Any) -> bool:
    """Whether a field's type is int / float (or optional): `int | None` yes, `bool`, `str`, `tuple` no."""
    kinds = set(typing.get_args(annotation)) or {annotation}
    return bool(kinds & {int, float})


def _holds_numbers(annotation: Any) -> bool:
    """Whether a field's type is a list / tuple of ints / floats (or optional): `list[int] | None` yes."""
    kinds = set(typing.get_args(annotation)) or {annotation}
    return any(
        typing.get_origin(k) in (list, tuple) and any(_is_number(item) for item in typing.get_args(k))
        for k in kinds
    )


class NumbersNotBooleans(BaseModel):
    """A base for request models: a JSON true / false in any int / float field, or in a list of them, is
    refused (pydantic's lax mode would take it as 1 / 0), with the field named."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None  # (a field validator's: pydantic names the field)
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and _is_number(annotation):
            raise ValueError("expected a number, got a boolean")
        if (
            isinstance(value, list | tuple)
            and any(isinstance(v, bool) for v in value)
            and _holds_numbers(annotation)
        ):
            raise ValueError("expected numbers, got a boolean")
        return value


class VideoCreateRequest(NumbersNotBooleans):
    """Fields of POST /v1/videos and /v1/videos/sync (same names in every body type)."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(description="Text, or a JSON document as a string (Cosmos3's structured prompt).")
    model: str | None = Field(None, description="Must equal the served model name when given.")
    negative_prompt: str | None = None
    seconds: str | None = Field(
        None, pattern=r"^[1-9][0-9]*$", description="Without num_frames: seconds x fps."
    )
    size: str | None = Field(
        None, pattern=r"^[0-9]+x[0-9]+$", description="WIDTHxHEIGHT; overrides width/height."
    )
    user: str | None = None
    quality: str | None = Field(None, description="high | lossless (x264 crf 10 / 0); omitted: crf 18.")
    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    num_frames: int | None = Field(None, ge=1, description="1 or 4k+1; default 189 (or the server's).")
    fps: float | None = Field(None, ge=1, allow_inf_nan=False, description="Default 24 (or the server's).")
    num_inference_steps: int | None = Field(None, ge=1, le=200, description="Default 35 (or the server's).")
    guidance_scale: float | None = Field(
        None, ge=0, le=20, allow_inf_nan=False, description="Default 6.0 (or the server's)."
    )
    flow_shift: float | None = Field(None, gt=0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-INT64, lt=INT64, description="Default 42 (or the server's).")
    max_sequence_length: int | None = Field(
        None, ge=1, description="Prompt-token cap; default 4096 (or the server's)."
    )
    generate_sound: bool | None = Field(
        None, description="Default: on when the checkpoint has a sound tokenizer."
    )
    sound_duration: float | None = Field(None, gt=0, allow_inf_nan=False)
    num_outputs_per_prompt: int = Field(1, ge=1, le=10)
    image_reference: Any = Field(
        None, description='{"image_url": "data:image/...;base64,..."} (or a list of one)'
    )
    video_reference: Any = Field(None, description='{"video_url": "data:video/...;base64,..."}')
    audio_reference: Any = Field(
        None, description='{"audio_url": ...}: unused by Cosmos3 (a 400 when it is not a JSON object).'
    )
    video_params: Any = Field(
        None, description="{width, height, fps, num_frames}: fills the top-level fields not given."
    )
    # (typed Any: a JSON body's list or number gets vLLM-Omni's "expected dict" 400, not pydantic's)
    extra_params: Any = Field(None, description="JSON object (Cosmos3 keys, §4.2).")
    lora: Any = Field(
        None, description='{"name", "path", "scale"}: a LoRA adapter on the server (with --enable-lora).'
    )
    control_type: str | None = Field(None, description="Cosmos3 transfer controls: not supported yet.")
    control_reference: Any = Field(None, description="Cosmos3 transfer control upload: not supported yet.")
    enable_frame_interpolation: bool | None = Field(
        None, description="RIFE interpolation: not supported yet."
    )
    frame_interpolation_exp: int | None = Field(None, ge=1)
    frame_interpolation_scale: float | None = Field(None, gt=0, allow_inf_nan=False)
    frame_interpolation_model_path: str | None = None
    # vLLM-Omni's Wan2.2 fields and image-endpoint switch: typed as its request model types them (a bad value
    # is a 400 naming the field), then unused by Cosmos3 (NVIDIA's README: no true_cfg_scale for Cosmos3)
    guidance_scale_2: float | None = Field(
        None, allow_inf_nan=False, description="Wan2.2's; unused by Cosmos3."
    )
    boundary_ratio: float | None = Field(
        None, allow_inf_nan=False, description="Wan2.2's; unused by Cosmos3."
    )
    true_cfg_scale: float | None = Field(
        None, allow_inf_nan=False, description="Unused: Cosmos3 uses guidance_scale."
    )
    return_stage_metrics: bool | None = Field(
        None, description="Accepted; the sync headers carry the stages."
    )

    @field_validator("seconds", "size", mode="before")
    @classmethod
    def _number_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class VideoParamsObject(NumbersNotBooleans):
    """vLLM-Omni's `video_params` object (JSON API): fills the top-level size / fps / frames not given."""

    model_config = ConfigDict(extra="ignore")

    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    fps: float | None = Field(None, ge=1, allow_inf_nan=False)
    num_frames: int | None = Field(None, ge=1)


class ExtraParams(NumbersNotBooleans):
    """The `extra_params` keys worldserve honours; other keys are accepted and ignored (as vLLM-Omni)."""

    model_config = ConfigDict(extra="allow")

    max_sequence_length: int | None = Field(None, ge=1)
    flow_shift: float | None = Field(None, gt=0, allow_inf_nan=False)
    generate_sound: bool | None = None
    sound_gen: bool | None = None
    sound_duration: float | None = Field(None, gt=0, allow_inf_nan=False)
    audio_duration: float | None = Field(None, gt=0, allow_inf_nan=False)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=200)
    guidance_scale: float | None = Field(None, ge=0, le=20, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    video_codec_options: dict[str, StrictStr | StrictInt | StrictFloat] | None = None
    """(strict: a boolean is refused, not taken as 1 or 0)"""
    condition_frame_indexes_vision: list[int] | None = Field(
        None, description="V2V: latent frames kept clean (default [0, 1])."
    )
    condition_video_keep: Literal["first", "last"] | None = Field(
        None, description="V2V: which end of the reference video conditions (default first)."
    )
    guardrails: bool | None = Field(None, description="Accepted; this server loads no guardrail models.")
    negative_metadata_mode: Literal["same", "inverse", "none"] | None = Field(
        None,
        description="The metadata sentences on the negative prompt: same as the prompt's (default, NVIDIA's "
        "reference), inverse (\"The video is not ...\", diffusers' and vLLM-Omni's T2V/I2V), none.",
    )
    guidance_interval: tuple[float, float] | None = Field(
        None,
        description="CFG only at timesteps (0..1000) in [lo, hi]; the other steps run the cond branch alone.",
    )
    use_duration_template: bool | None = Field(
        None, description="State duration and fps in the prompts (default true, as NVIDIA's reference)."
    )
    use_resolution_template: bool | None = Field(
        None, description="State the resolution in the prompts (default true, as NVIDIA's reference)."
    )
    use_system_prompt: bool | None = Field(
        None, description="Prepend the reference system message (default false)."
    )
    system_prompt: str | None = Field(None, description="A system message of your own.")
    upsample_prompt: bool | None = Field(
        None,
        description="Have the Reasoner rewrite the prompt into Cosmos3's JSON prompt first (default false).",
    )


class VideoError(BaseModel):
    code: int | str
    message: str


class VideoObject(BaseModel):
    """The job object (OpenAI Videos `Video` + vLLM-Omni extensions)."""

    id: str
    object: Literal["video"] = "video"
    model: str
    prompt: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int
    size: str | None
    seconds: str
    quality: str
    fps: float | None
    num_frames: int | None
    duration_s: float | None
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    remixed_from_video_id: str | None = None
    error: VideoError | None = None
    media_type: str = "video/mp4"
    file_name: str | None = None
    inference_time_s: float | None = None
    stage_durations: dict[str, float] = Field(default_factory=dict)
    peak_memory_mb: float | None = None
    action: dict[str, Any] | None = None
    upsampled_prompt: str | None = Field(
        None,
        description="The prompt the Reasoner wrote for the video (extra_params.upsample_prompt), once written.",
    )

    @classmethod
    def from_job(cls, job: Job) -> VideoObject:
        spec = job.spec
        error = None
        if job.error_message is not None:
            error = VideoError(code=job.error_code or 500, message=job.error_message)
        return cls(
            id=job.id, model=spec.model, prompt=spec.prompt, status=job.status.value, progress=job.progress,
            size=spec.size, seconds=spec.seconds, quality=spec.quality, fps=spec.fps, num_frames=spec.num_frames,
            duration_s=round(spec.num_frames / spec.fps, 4), created_at=int(job.created_at),
            completed_at=_int_or_none(job.completed_at), expires_at=_int_or_none(job.expires_at), error=error,
            file_name=job.file_name, inference_time_s=job.inference_time_s, stage_durations=job.stage_durations,
            peak_memory_mb=job.peak_memory_mb, upsampled_prompt=spec.upsampled_prompt,
        )  # fmt: skip


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    deleted: bool = True
    object: Literal["video.deleted"] = "video.deleted"


class ModelPermission(BaseModel):
    id: str
    object: Literal["model_permission"] = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


def _int_or_none(value: float | None) -> int | None:
    """Seconds as the API's integer timestamps (None, also for a non-finite value an old store may hold)."""
    return None if value is None or not math.isfinite(value) else int(value)

"""The /v1/images/generations body (`ImageGenerationRequest`: vLLM-Omni's fields and OpenAI's Images API
fields) and its resolution into the `n` one-frame VideoParams the engine runs (`build_params`).

Checks first, each a 400 naming its field, in this order: what the answer cannot be (a URL, a streamed file, a
transparent background, a compressed PNG), the `lora` adapter, then `extra_params` (sound and the video-only
keys refused); then `extra_params` over the top-level fields over vLLM-Omni's T2I defaults
(image_params.py), validated with the field each value came in. The route itself is api/images.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from worldserve.api.errors import APIError
from worldserve.api.lora_field import LoraSettings
from worldserve.api.protocol import ExtraParams, NumbersNotBooleans
from worldserve.api.video_inputs import parse_extra_params
from worldserve.image_params import text_to_image_params
from worldserve.params import IMAGE_DEFAULTS, INT64, LoraRequest, VideoParams

DEFAULT_SIZE = f"{IMAGE_DEFAULTS.width}x{IMAGE_DEFAULTS.height}"
VIDEO_ONLY_EXTRA = (
    "sound_duration", "audio_duration", "video_codec_options", "condition_frame_indexes_vision",
    "condition_video_keep", "use_duration_template",
)  # fmt: skip
"""`extra_params` keys of the video routes that mean nothing for one image: a 400 naming the key."""


class ImageGenerationRequest(NumbersNotBooleans):
    """vLLM-Omni's image generation fields; undeclared fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: str
    model: str | None = None
    n: int | None = Field(1, ge=1, le=10, description="null: 1")
    size: str | None = Field(
        None,
        pattern=r"^([0-9]{1,5}x[0-9]{1,5}|auto)$",
        description="WIDTHxHEIGHT; auto or absent: 1024x1024.",
    )
    response_format: Literal["b64_json", "url", "file"] | None = None
    output_format: Literal["png", "jpeg", "jpg", "webp"] | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(None, ge=1, le=200)
    guidance_scale: float | None = Field(None, ge=0, le=20, allow_inf_nan=False)
    true_cfg_scale: float | None = Field(
        None, ge=0, le=20, allow_inf_nan=False, description="Accepted; Cosmos3 uses guidance_scale."
    )
    flow_shift: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_sequence_length: int | None = Field(
        None, ge=1, description="Cap on prompt tokens (as on the video routes)."
    )
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    generator_device: str | None = Field(
        None,
        pattern=r"^(cpu|cuda(:[0-9]+)?)$",
        description="Accepted; noise is drawn on the CPU, as diffusers does.",
    )
    lora: Any = None  # (an object, or its JSON text: api/lora_field.py)
    extra_params: Any = None  # (an object, or its JSON text; any other value: parse_extra_params names it)
    return_stage_metrics: bool | None = None
    # OpenAI's Images API fields
    output_compression: int | None = Field(None, ge=0, le=100, description="JPEG / WebP quality (100: best).")
    background: Literal["auto", "opaque", "transparent"] | None = None
    quality: Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"] | None = None
    style: Literal["vivid", "natural"] | None = None
    moderation: Literal["auto", "low"] | None = None
    user: str | None = None
    stream: bool | None = None
    partial_images: int | None = Field(None, ge=0, le=3, description="Accepted; no partial image is sent.")


def _floats(lo: float, hi: float) -> tuple[float, float]:
    """A guidance_interval (a pair: its field's type) as floats."""
    return float(lo), float(hi)


def build_params(
    req: ImageGenerationRequest, default_flow_shift: float | None = None, lora: LoraSettings = LoraSettings()
) -> list[VideoParams]:
    """The `n` one-frame requests (seed, seed + 1, ...), validated (an error names `extra_params.<key>` for a
    value from there); `default_flow_shift` (--flow-shift) replaces T2I's 3.0 for requests that send no
    flow_shift; `lora` (--enable-lora, --lora-path) picks the adapter they run with (api/lora_field.py)."""
    _check_answer_fields(req)
    adapter = lora.for_request(req.lora)
    extra = _image_extra_params(req.extra_params)
    size = DEFAULT_SIZE if req.size in (None, "auto") else req.size
    width, height = (int(v) for v in size.split("x"))
    origin = {
        "width": "size",
        "height": "size",
        "upsample_prompt": "extra_params.upsample_prompt",
        "system_prompt": "extra_params.system_prompt",
        "negative_metadata": "extra_params.negative_metadata_mode",
    }
    given = _given_fields(req, extra, width, height, adapter, origin)
    # (validated with its field_names: a later check names the request's fields too)
    return text_to_image_params(
        req.prompt, req.n or 1, given, default_flow_shift=default_flow_shift, names=origin
    )


def _check_answer_fields(req: ImageGenerationRequest) -> None:
    """400s for what the answer cannot be: a URL, a streamed file, a transparent background, a compressed
    PNG."""
    if req.response_format == "url":
        raise APIError(400, "response_format 'url' is not supported: use 'b64_json' or 'file'",
                       param="response_format")  # fmt: skip
    if req.stream and req.response_format == "file":
        raise APIError(
            400, "response_format 'file' cannot be streamed: use 'b64_json'", param="response_format"
        )
    if req.background == "transparent":
        raise APIError(400, "background 'transparent' is not supported: Cosmos3 draws opaque images",
                       param="background")  # fmt: skip
    # (OpenAI's default is 100, which SDK wrappers send with PNG too: only a lower one is refused, as OpenAI's
    # "Compression less than 100 is not supported for PNG output format")
    if (
        req.output_compression is not None
        and req.output_compression < 100
        and req.output_format in (None, "png")
    ):
        raise APIError(400, "output_compression less than 100 is not supported for the png output format (it "
                       "applies to jpeg and webp)", param="output_compression")  # fmt: skip


def _image_extra_params(value: Any) -> ExtraParams:
    """`extra_params` parsed as the video routes parse it, with a 400 naming the key for sound and for the
    keys that apply to videos only."""
    extra = parse_extra_params(value)
    for key in ("generate_sound", "sound_gen"):  # (false or absent: the image route makes none anyway)
        if getattr(extra, key):
            raise APIError(400, "sound cannot be generated for an image", param=f"extra_params.{key}")
    for key in VIDEO_ONLY_EXTRA:
        if getattr(extra, key) is not None:
            raise APIError(
                400, f"extra_params.{key} applies to videos, not images", param=f"extra_params.{key}"
            )
    return extra


def _given_fields(
    req: ImageGenerationRequest, extra: ExtraParams, width: int, height: int, adapter: LoraRequest | None,
    origin: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    """The values the request gives text_to_image_params (None: its default), `extra_params` over the
    top-level field; `origin` gets `extra_params.<key>` for each value taken from there."""

    def pick(name: str, default: Any) -> Any:
        """`extra_params` over the top-level field over the default, as the video routes resolve them."""
        if getattr(extra, name, None) is not None:
            origin[name] = f"extra_params.{name}"
            return getattr(extra, name)
        return default if getattr(req, name, None) is None else getattr(req, name)

    interval = pick("guidance_interval", None)
    return {
        "negative_prompt": pick("negative_prompt", None), "width": width, "height": height,
        "num_inference_steps": pick("num_inference_steps", None),
        "guidance_scale": pick("guidance_scale", None) or None,  # (0: the default)
        "flow_shift": pick("flow_shift", None), "seed": pick("seed", None),
        "max_sequence_length": pick("max_sequence_length", None),
        "guidance_interval": None if interval is None else _floats(*interval),
        "add_resolution_template": extra.use_resolution_template is not False,
        "negative_metadata": extra.negative_metadata_mode or "same",
        "use_system_prompt": bool(extra.use_system_prompt), "system_prompt": extra.system_prompt,
        "upsample_prompt": bool(extra.upsample_prompt), "lora": adapter,
    }  # fmt: skip

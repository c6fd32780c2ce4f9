"""POST /v1/images/generations: Cosmos3 text-to-image with vLLM-Omni's fields and defaults (serving-api.md §7.1).

JSON only. Validate (400s with `param`) -> `n` one-frame requests through the engine's scheduler (seeds
seed, seed + 1, ...; batched with whatever else runs, sharing the GPU step by step) with no job in the store
-> encode each frame (PNG, JPEG or WebP) -> `{"created", "data": [{"b64_json", "revised_prompt"}],
"output_format", "size", "usage"}` (+ `metrics` with `return_stage_metrics`), or with vLLM-Omni's `response_format:
"file"` the image itself as an attachment (n > 1: a ZIP of `image_<i>.<ext>`). `n: null` and OpenAI's
`size: "auto"` take the defaults. OpenAI's fields: `output_compression` (0-100) sets a JPEG's or lossy WebP's
quality (without it JPEG quality 95, WebP lossless; PNG takes only OpenAI's default 100); `background`
"transparent" is a 400 (the model draws opaque images); `quality`, `style`, `moderation`, `user` are checked
and have no effect; `stream: true` answers OpenAI's server-sent events, an `image_generation.completed`
event per image once all are made (`partial_images` accepted, none sent: OpenAI's final image may come before
its partials); a JSON object as the prompt (Cosmos3's structured prompt) is its compact text, as on the video
routes. /v1/images/edits
and /variations are 404s saying so (text-to-image only). Defaults as vLLM-Omni's Cosmos3 T2I:
1024x1024, 50 steps, guidance 7.0 inside the timestep window [400, 1000], flow shift 3.0, no audio, a random
seed; `extra_params` takes the video route's keys (guidance_interval, max_sequence_length, prompt switches,
upsample_prompt: the prompt the Reasoner writes comes back as each image's `revised_prompt`) and, as there, wins
over a top-level field; `lora` is the video routes' adapter object (api/lora_field.py). Prompt templates and
system message follow worldserve's defaults
(NVIDIA's reference), not vLLM-Omni's (use `extra_params` to switch them).
`usage` is OpenAI's gpt-image shape (`image_usage`): input tokens the prompt's text tokens as the transformer
saw them (template included, counted once for the n images, as vLLM counts a prompt its n choices share; no
image tokens: there is no image input), output tokens the gen tokens denoised for the images.
Past the sync timeout the requests are aborted and the answer is 504; a client that disconnects aborts them too.
The metrics count the HTTP request once whatever its `n` (succeeded, failed or cancelled: engine/observer.py
RequestGroup), as vLLM-Omni counts one request of num_outputs_per_prompt n; an engine failure's body carries
vLLM-Omni's `error.request_id` (api/errors.py).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import time
import uuid
import zipfile
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ConfigDict, Field

from worldserve.api.bodies import read_model
from worldserve.api.disconnect import ClientGone, unless_disconnected
from worldserve.api.errors import APIError
from worldserve.api.lora_field import LoraSettings
from worldserve.api.protocol import NumbersNotBooleans
from worldserve.api.state import AppState, State
from worldserve.api.video_inputs import parse_extra_params, structured_texts
from worldserve.engine.client import QueueFullError, ShuttingDownError, UpsamplingFailed, error_for
from worldserve.image_params import text_to_image_params
from worldserve.params import IMAGE_DEFAULTS, INT64, VideoParams

if TYPE_CHECKING:
    import numpy as np

    from worldserve.engine.client import VideoResult

router = APIRouter(tags=["images"])

DEFAULT_SIZE = f"{IMAGE_DEFAULTS.width}x{IMAGE_DEFAULTS.height}"
FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
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
    adapter = lora.for_request(req.lora)
    extra = parse_extra_params(req.extra_params)
    for key in ("generate_sound", "sound_gen"):  # (false or absent: the image route makes none anyway)
        if getattr(extra, key):
            raise APIError(400, "sound cannot be generated for an image", param=f"extra_params.{key}")
    for key in VIDEO_ONLY_EXTRA:
        if getattr(extra, key) is not None:
            raise APIError(
                400, f"extra_params.{key} applies to videos, not images", param=f"extra_params.{key}"
            )
    size = DEFAULT_SIZE if req.size in (None, "auto") else req.size
    width, height = (int(v) for v in size.split("x"))
    origin = {
        "width": "size",
        "height": "size",
        "upsample_prompt": "extra_params.upsample_prompt",
        "system_prompt": "extra_params.system_prompt",
        "negative_metadata": "extra_params.negative_metadata_mode",
    }

    def pick(name: str, default: Any) -> Any:
        """`extra_params` over the top-level field over the default, as the video routes resolve them."""
        if getattr(extra, name, None) is not None:
            origin[name] = f"extra_params.{name}"
            return getattr(extra, name)
        return default if getattr(req, name, None) is None else getattr(req, name)

    interval = pick("guidance_interval", None)
    given = {
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
    # (validated with its field_names: a later check names the request's fields too)
    return text_to_image_params(
        req.prompt, req.n or 1, given, default_flow_shift=default_flow_shift, names=origin
    )


async def _generated(
    st: AppState,
    params: list[VideoParams],
    request_id: str,
    headers: dict,
    on_admitted: Callable[[], None] | None,
) -> tuple[str | None, list[VideoResult]]:
    """(the prompt the Reasoner wrote or None, the results): with `extra_params.upsample_prompt` the prompt is
    written first (engine/prompt_upsampling.py; checked as a client's prompt is, answered as
    `revised_prompt`; the requests hold their queue slots meanwhile), one for the n images (the first one's
    seed), `on_admitted` called once they are admitted. One sync timeout for the whole request. A failed upsampling answers the chat's status (500 when
    the answer does not parse) with the reason; past the timeout a 504, the chat stopped."""
    deadline = time.monotonic() + st.settings.sync_timeout_s
    revised = None
    if params[0].upsample_prompt:
        try:
            revised = await st.client.jobless.admitted_upsampling(
                params[0], request_id, st.settings.sync_timeout_s, len(params), on_admitted
            )
            on_admitted = None  # (admitted: the requests hold their slots)
        except TimeoutError:
            raise APIError(504, f"Image generation timed out after {st.settings.sync_timeout_s:g}s (while its prompt "
                           "was being written).", headers=headers) from None  # fmt: skip
        except UpsamplingFailed as exc:
            raise APIError(
                exc.status, f"Prompt upsampling failed: {exc}", param=exc.param, headers=headers
            ) from None
        params = [dataclasses.replace(p, prompt=revised, upsample_prompt=False) for p in params]
    left = max(deadline - time.monotonic(), 0.001)  # (no await before the queue: the held slots pass to it)
    return revised, await st.client.jobless.generate(
        params, prefix=request_id, timeout_s=left, on_admitted=on_admitted
    )


def encode_image(frame: np.ndarray, fmt: str, quality: int | None = None) -> bytes:
    """uint8 (H, W, 3) -> PNG / JPEG (`quality`, else 95) / WebP (lossy at `quality`, else lossless) bytes."""
    from PIL import Image

    buf = io.BytesIO()
    kind = FORMATS[fmt]
    options: dict[str, Any] = {}
    if kind == "JPEG":
        options = {"quality": 95 if quality is None else quality}
    elif kind == "WEBP":
        options = {"lossless": True} if quality is None else {"quality": quality}
    Image.fromarray(frame).save(buf, format=kind, **options)
    return buf.getvalue()


def image_file(images: list[bytes], fmt: str, request_id: str, headers: dict[str, str]) -> Response:
    """`response_format: "file"`: one image as itself, several as a ZIP (stored: the images are compressed
    already) of image_<i>.<ext>, each an attachment named after the request."""
    ext = "jpg" if fmt in ("jpeg", "jpg") else fmt
    name = request_id.removeprefix("img_gen-")[:16]
    if len(images) == 1:
        media_type = "image/jpeg" if ext == "jpg" else f"image/{ext}"
        data, filename = images[0], f"image_{name}.{ext}"
    else:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:
            for i, image in enumerate(images):
                archive.writestr(f"image_{i}.{ext}", image)
        data, media_type, filename = buf.getvalue(), "application/zip", f"images_{name}.zip"
    disposition = {"Content-Disposition": f'attachment; filename="{filename}"'}
    return Response(data, media_type=media_type, headers=headers | disposition)


@router.post("/v1/images/generations")
async def create_images(request: Request, st: State) -> Response:
    """Text-to-image (JSON body): `n` images as base64 in `data` (or as a file: `image_file`), generated
    with the video model."""
    request_id = f"img_gen-{uuid.uuid4().hex}"
    # (a structured prompt, a JSON object, becomes its text as on the video routes)
    with st.counting_too_large():
        req = await read_model(
            request, ImageGenerationRequest, st.settings.max_upload_bytes, structured_texts
        )
    if not st.serves(req.model):
        raise APIError(400, f"Model mismatch: request specifies '{req.model}' but server is running "
                       f"'{st.served_model_name}'.", param="model")  # fmt: skip
    if (req.n or 1) > st.client.max_queued_requests:
        raise APIError(
            400, f"n={req.n} is above this server's queue ({st.client.max_queued_requests})", param="n"
        )
    # tokenising the prompts (model-aware validation) runs off the event loop: a long prompt must not
    # stall every other request
    params = await asyncio.to_thread(
        lambda: [
            st.client.validate(p) for p in build_params(req, st.settings.default_flow_shift, st.settings.lora)
        ]
    )
    headers = {"X-Request-Id": request_id}
    log = st.settings.request_log

    def received() -> None:  # (logged once admitted, as a video job once created; the n differ by seeds only)
        if log is not None:
            log.video(request_id, params[0])

    try:
        revised, results = await unless_disconnected(
            request, _generated(st, params, request_id, headers, received)
        )
    except (ClientGone, APIError):
        raise
    except TimeoutError:
        raise APIError(
            504, f"Image generation timed out after {st.settings.sync_timeout_s:g}s.", headers=headers
        ) from None
    except (QueueFullError, ShuttingDownError) as exc:
        raise st.refusal(exc, headers) from None
    # the model refused the request (a ParamError too): 400 with its field, as vLLM-Omni answers a ValueError
    except ValueError as exc:
        raise APIError(400, str(exc), param=getattr(exc, "param", None), headers=headers) from None
    except Exception as exc:  # a failed request: its status and message, as a failed video job reports them
        code, message, param = error_for(exc, "Image generation")  # (an engine failure: error.request_id)
        raise APIError(code, message, param=param, headers=headers, engine_request_id=request_id) from None
    fmt = req.output_format or "png"
    images = await asyncio.gather(
        *(asyncio.to_thread(encode_image, r.frames[0], fmt, req.output_compression) for r in results)
    )
    if req.response_format == "file":
        return image_file(images, fmt, request_id, headers)
    if req.stream:
        return StreamingResponse(
            completed_events(req, images, f"{params[0].width}x{params[0].height}", revised, results),
            media_type="text/event-stream", headers=headers,
        )  # fmt: skip
    body: dict[str, Any] = {
        "created": int(time.time()),
        "data": [
            {"b64_json": base64.b64encode(img).decode("ascii"), "revised_prompt": revised} for img in images
        ],
        "output_format": "jpeg" if fmt == "jpg" else fmt,
        "size": f"{params[0].width}x{params[0].height}",
        "usage": image_usage(results[0].prompt_tokens, [r.gen_tokens for r in results], details=True),
    }
    if req.return_stage_metrics:
        body["metrics"] = {
            "stage_durations": {k: round(v, 4) for k, v in results[0].stage_seconds.items()},
            "peak_memory_mb": round(max(r.peak_memory_mb for r in results), 3),
        }
    return JSONResponse(body, headers=headers)


def image_usage(prompt_tokens: int, gen_tokens: list[int], *, details: bool = False) -> dict[str, Any]:
    """OpenAI's image `usage`: the prompt's text tokens in, the images' gen tokens out (`details`: with
    ImagesResponse's `output_tokens_details`, which the completed event's usage does not have)."""
    output = sum(gen_tokens)
    usage: dict[str, Any] = {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"text_tokens": prompt_tokens, "image_tokens": 0},
        "output_tokens": output,
        "total_tokens": prompt_tokens + output,
    }
    if details:
        usage["output_tokens_details"] = {"image_tokens": output, "text_tokens": 0}
    return usage


EVENT_QUALITIES = ("low", "medium", "high", "xhigh", "max", "auto")
"""The `quality` values OpenAI's completed event takes (a request's "standard" / "hd" is reported "auto")."""


async def completed_events(
    req: ImageGenerationRequest,
    images: list[bytes],
    size: str,
    revised: str | None,
    results: list[VideoResult],
) -> AsyncIterator[str]:
    """OpenAI's streamed answer: an `image_generation.completed` server-sent event per image (no partials;
    `return_stage_metrics` has no place in it), each with its own image's `usage`."""
    fmt = req.output_format or "png"
    for image, result in zip(images, results, strict=True):
        event = {
            "type": "image_generation.completed", "b64_json": base64.b64encode(image).decode("ascii"),
            "background": "opaque", "created_at": int(time.time()), "output_format": "jpeg" if fmt == "jpg" else fmt,
            "quality": req.quality if req.quality in EVENT_QUALITIES else "auto", "size": size,
            "usage": image_usage(result.prompt_tokens, [result.gen_tokens]),
        }  # fmt: skip
        # (not in OpenAI's event: the prompt the Reasoner wrote, as b64_json's data carries it)
        if revised is not None:
            event["revised_prompt"] = revised
        yield f"event: image_generation.completed\ndata: {json.dumps(event)}\n\n"


async def not_served(request: Request) -> None:
    """A clear 404 for the OpenAI SDK's image calls this server does not serve (a bare "Not Found" before)."""
    call = request.scope["route"].path.rsplit("/", 1)[-1]
    raise APIError(404, f"POST /v1/images/{call} (the OpenAI SDK's images.{IMAGE_CALLS[call]}) is not served "
                   "here: Cosmos3 makes images from text (POST /v1/images/generations)")  # fmt: skip


IMAGE_CALLS = {"edits": "edit", "variations": "create_variation"}
"""OpenAI image routes not served -> the SDK's method."""

for _call in IMAGE_CALLS:
    router.add_api_route(f"/v1/images/{_call}", not_served, methods=["POST"], include_in_schema=False)

"""POST /v1/images/generations: Cosmos3 text-to-image with vLLM-Omni's fields and defaults (serving-api.md §7.1).

JSON only. Validate (400s with `param`: api/images_protocol.py) -> `n` one-frame requests through the engine's
scheduler (seeds seed, seed + 1, ...; batched with whatever else runs, sharing the GPU step by step) with no
job in the store -> encode each frame (PNG, JPEG or WebP) -> `{"created", "data": [{"b64_json", "revised_prompt"}],
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
from typing import TYPE_CHECKING, Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from worldserve.api.bodies import read_model
from worldserve.api.disconnect import ClientGone, unless_disconnected
from worldserve.api.errors import APIError, model_mismatch
from worldserve.api.images_protocol import ImageGenerationRequest, build_params
from worldserve.api.state import AppState, State
from worldserve.api.video_inputs import structured_texts
from worldserve.engine.client import QueueFullError, ShuttingDownError, UpsamplingFailed, error_for
from worldserve.params import VideoParams

if TYPE_CHECKING:
    import numpy as np

    from worldserve.engine.client import VideoResult

router = APIRouter(tags=["images"])

FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}


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
    req = await _read_request(request, st)
    # tokenising the prompts (model-aware validation) runs off the event loop: a long prompt must not
    # stall every other request
    params = await asyncio.to_thread(
        lambda: [
            st.client.validate(p) for p in build_params(req, st.settings.default_flow_shift, st.settings.lora)
        ]
    )
    headers = {"X-Request-Id": request_id}
    revised, results = await _generate_images(request, st, params, request_id, headers)
    fmt = req.output_format or "png"
    # (arrays: a jobless request without a frame callback is decoded whole, never as a FrameStream)
    images = await asyncio.gather(
        *(
            asyncio.to_thread(encode_image, cast("np.ndarray", r.frames)[0], fmt, req.output_compression)
            for r in results
        )
    )
    if req.response_format == "file":
        return image_file(images, fmt, request_id, headers)
    if req.stream:
        return StreamingResponse(
            completed_events(req, images, f"{params[0].width}x{params[0].height}", revised, results),
            media_type="text/event-stream", headers=headers,
        )  # fmt: skip
    return JSONResponse(_images_body(req, params[0], fmt, images, revised, results), headers=headers)


async def _read_request(request: Request, st: AppState) -> ImageGenerationRequest:
    """The JSON body, its model the served one (else a 400) and its `n` within the server's queue."""
    # (a structured prompt, a JSON object, becomes its text as on the video routes)
    with st.counting_too_large():
        req = await read_model(
            request, ImageGenerationRequest, st.settings.max_upload_bytes, structured_texts
        )
    if not st.serves(req.model):
        raise model_mismatch(req.model or "", st.served_model_name)
    if (req.n or 1) > st.client.max_queued_requests:
        raise APIError(
            400, f"n={req.n} is above this server's queue ({st.client.max_queued_requests})", param="n"
        )
    return req


async def _generate_images(
    request: Request, st: AppState, params: list[VideoParams], request_id: str, headers: dict[str, str]
) -> tuple[str | None, list[VideoResult]]:
    """`_generated`'s (revised prompt, results) unless the client goes away; the request logged once
    admitted; a failure answered as its HTTP error (with the X-Request-Id `headers`)."""
    log = st.settings.request_log

    def received() -> None:  # (logged once admitted, as a video job once created; the n differ by seeds only)
        if log is not None:
            log.video(request_id, params[0])

    try:
        return await unless_disconnected(request, _generated(st, params, request_id, headers, received))
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


def _images_body(
    req: ImageGenerationRequest, first: VideoParams, fmt: str, images: list[bytes], revised: str | None,
    results: list[VideoResult],
) -> dict[str, Any]:  # fmt: skip
    """The JSON answer: the images as base64 with the prompt the Reasoner wrote, their size (`first`'s: the n
    share it), usage, and the stage metrics with `return_stage_metrics`."""
    body: dict[str, Any] = {
        "created": int(time.time()),
        "data": [
            {"b64_json": base64.b64encode(img).decode("ascii"), "revised_prompt": revised} for img in images
        ],
        "output_format": "jpeg" if fmt == "jpg" else fmt,
        "size": f"{first.width}x{first.height}",
        "usage": image_usage(results[0].prompt_tokens, [r.gen_tokens for r in results], details=True),
    }
    if req.return_stage_metrics:
        body["metrics"] = {
            "stage_durations": {k: round(v, 4) for k, v in results[0].stage_seconds.items()},
            "peak_memory_mb": round(max(r.peak_memory_mb for r in results), 3),
        }
    return body


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

"""POST /v1/images/generations: the official `openai` client against a real uvicorn and the tiny checkpoint's
VideoPipeline (CPU), images decoded back and compared with the pipeline run directly; bad input as 400s
naming the field; a timeout as 504 with the work aborted; no job left behind in /v1/videos."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from serving_helpers import asgi_server, uvicorn_thread, wait_until

from worldserve.engine.fake_backend import FakeBackend
from worldserve.params import ParamError, VideoParams

pytestmark = pytest.mark.anyio
SMALL = {"num_inference_steps": 2}


@pytest.fixture(scope="module")
def pipeline(tiny_ckpt):
    from worldserve.runner.video_pipeline import VideoPipeline

    return VideoPipeline.from_pretrained(tiny_ckpt, device="cpu", dtype=torch.float32, progress=False)


def decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_openai_client_generates_images_equal_to_the_pipeline(tmp_path, pipeline):
    openai = pytest.importorskip("openai")
    with uvicorn_thread(tmp_path, backend=pipeline, max_batch_size=2) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        out = client.images.generate(model="test-model", prompt="a red fox", size="64x48", n=2,
                                     extra_body={**SMALL, "seed": 5})  # fmt: skip
        assert len(out.data) == 2 and out.data[0].revised_prompt is None
        images = [decode(d.b64_json) for d in out.data]
        assert all(im.format == "PNG" and im.size == (64, 48) for im in images)
        first, second = (np.asarray(im.convert("RGB")) for im in images)
        assert not np.array_equal(first, second), "n images: seeds 5 and 6"
        # the image is exactly what the pipeline makes with the endpoint's defaults (guidance 7 inside
        # [400, 1000], shift 3, empty negative prompt, no audio)
        params = VideoParams(prompt="a red fox", width=64, height=48, num_frames=1, num_inference_steps=2,
                             guidance_scale=7.0, guidance_interval=(400.0, 1000.0), flow_shift=3.0, seed=5,
                             generate_sound=False)  # fmt: skip
        direct, _ = pipeline.generate(params)
        np.testing.assert_array_equal(first, direct.frames[0])
        raw = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a red fox", "size": "64x48", "seed": 5,
                         "output_format": "webp", "return_stage_metrics": True, **SMALL}, timeout=60)  # fmt: skip
        assert raw.status_code == 200 and raw.headers["x-request-id"].startswith("img_gen-")
        body = raw.json()
        assert body["output_format"] == "webp" and body["size"] == "64x48"
        assert {"prepare", "diffuse", "decode", "vae.decode"} <= set(body["metrics"]["stage_durations"])
        lossless = decode(body["data"][0]["b64_json"])
        assert lossless.format == "WEBP"
        np.testing.assert_array_equal(np.asarray(lossless.convert("RGB")), first)  # same seed, lossless
        jpeg = client.images.generate(
            prompt="a red fox", size="64x48", extra_body={**SMALL, "output_format": "jpeg"}
        )
        assert decode(jpeg.data[0].b64_json).format == "JPEG"
        assert httpx.get(f"{url}/v1/videos").json()["data"] == [], "image requests leave no jobs"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "response_format": "url"}, "response_format"),
        ({"prompt": "x", "size": "65x64"}, "size"),
        ({"prompt": "x", "size": "big"}, "size"),
        ({"prompt": "x", "size": "1280x1280"}, "above the largest image (1048576 pixels"),
        ({"prompt": "x", "size": "1536x1024"}, "above the largest image (1048576 pixels"),
        ({"prompt": "x", "size": "9" * 5000 + "x64"}, "size"),
        ({"prompt": "x", "n": 11}, "n"),
        ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
        ({"prompt": "x", "model": "other"}, "model"),
        ({"prompt": "x", "lora": {"name": "a", "path": "/x"}}, "lora"),
        ({"prompt": "x", "extra_params": {"guidance_interval": [900, 100]}}, "guidance_interval"),
        ({"prompt": "x", "extra_params": {"seed": "abc"}}, "extra_params.seed"),
        (
            {"prompt": "x", "extra_params": 5},
            "extra_params",
        ),  # (pydantic's union errors had named a type tag)
        ({"prompt": "x", "extra_params": [1]}, "extra_params"),
        ({"prompt": "x", "extra_params": {"generate_sound": True}}, "extra_params.generate_sound"),
        ({"prompt": "x", "extra_params": {"sound_gen": True}}, "extra_params.sound_gen"),
        (
            {"prompt": "x", "extra_params": {"negative_metadata_mode": "opposite"}},
            "extra_params.negative_metadata_mode",
        ),
        (
            {"prompt": "x", "extra_params": {"video_codec_options": {"crf": 20}}},
            "extra_params.video_codec_options",
        ),
        (
            {"prompt": "x", "extra_params": {"use_duration_template": False}},
            "extra_params.use_duration_template",
        ),
        (
            {"prompt": "x", "extra_params": {"condition_video_keep": "last"}},
            "extra_params.condition_video_keep",
        ),
        ({"prompt": " "}, "prompt"),
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        # OpenAI's fields: checked (they had been ignored whatever their value)
        ({"prompt": "x", "background": "transparent"}, "background"),
        ({"prompt": "x", "background": "bogus"}, "background"),
        ({"prompt": "x", "quality": "bogus"}, "quality"),
        ({"prompt": "x", "style": "vivid-ish"}, "style"),
        ({"prompt": "x", "moderation": "high"}, "moderation"),
        ({"prompt": "x", "output_format": "jpeg", "output_compression": 150}, "output_compression"),
        ({"prompt": "x", "output_compression": 50}, "output_compression"),  # (png: no such setting)
        ({"prompt": "x", "partial_images": 4}, "partial_images"),
        ({"prompt": "x", "stream": True, "response_format": "file"}, "response_format"),
        ({"prompt": "x", "true_cfg_scale": 30}, "true_cfg_scale"),
        ({"prompt": "x", "generator_device": "bogus"}, "generator_device"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(tmp_path, body, param):
    async with asgi_server(tmp_path) as http:
        r = await http.post("/v1/images/generations", json=body)
        assert r.status_code == 400, r.text
        assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]


async def test_response_format_file_answers_the_image_or_a_zip_of_them(tmp_path):
    """vLLM-Omni's `response_format: "file"`: one image as itself (an attachment, its media type), several as
    a ZIP of image_<i>.<ext>; the same bytes as b64_json gives for the same seeds."""
    import zipfile

    body = {"prompt": "a cat", "size": "64x48", "seed": 3, **SMALL}
    async with asgi_server(tmp_path) as http:
        inline = (await http.post("/v1/images/generations", json={**body, "n": 2})).json()["data"]
        expected = [base64.b64decode(d["b64_json"]) for d in inline]
        one = await http.post("/v1/images/generations", json={**body, "response_format": "file"})
        assert one.status_code == 200 and one.headers["content-type"] == "image/png"
        assert one.headers["content-disposition"].startswith('attachment; filename="image_')
        assert one.content == expected[0] and one.headers["x-request-id"].startswith("img_gen-")
        many = await http.post("/v1/images/generations", json={**body, "n": 2, "response_format": "file"})
        assert many.headers["content-type"] == "application/zip"
        with zipfile.ZipFile(io.BytesIO(many.content)) as archive:
            assert archive.namelist() == ["image_0.png", "image_1.png"]
            assert [archive.read(n) for n in archive.namelist()] == expected
        jpeg = await http.post("/v1/images/generations",
                               json={**body, "response_format": "file", "output_format": "jpg"})  # fmt: skip
        assert jpeg.headers["content-type"] == "image/jpeg" and '.jpg"' in jpeg.headers["content-disposition"]
        assert decode(base64.b64encode(jpeg.content)).format == "JPEG"


async def test_openai_defaults_n_null_and_size_auto_are_the_route_defaults(tmp_path):
    """OpenAI's `n: null` is one image and `size: "auto"` the model's default size (1024x1024)."""
    from worldserve.api.images_protocol import ImageGenerationRequest, build_params

    [p] = build_params(ImageGenerationRequest(prompt="x", n=None, size="auto"))
    assert (p.width, p.height) == (1024, 1024)
    async with asgi_server(tmp_path) as http:
        r = await http.post(
            "/v1/images/generations", json={"prompt": "x", "n": None, "size": "64x48", **SMALL}
        )
        assert r.status_code == 200 and len(r.json()["data"]) == 1


async def test_json_only(tmp_path):
    async with asgi_server(tmp_path) as http:
        r = await http.post("/v1/images/generations", data={"prompt": "x"})
        assert r.status_code == 400 and "application/json" in r.json()["error"]["message"]


async def test_timeout_is_504_and_the_work_is_aborted(tmp_path):
    backend = FakeBackend(step_delay=0.2)
    async with asgi_server(tmp_path, backend=backend, sync_timeout_s=0.3) as http:
        r = await http.post("/v1/images/generations", json={"prompt": "x", "size": "64x64", "n": 2})
        assert r.status_code == 504 and "timed out after 0.3s" in r.json()["error"]["message"]
        engine = http.engine_client.engine
        wait_until(lambda: engine.num_running == 0 and engine.num_waiting == 0, timeout=10)
        failed = 'worldserve:request_failure_total{model_name="test-model",status="504"} 1.0'
        for _ in range(
            200
        ):  # (a waiting request leaves the queue count at once, and is counted when the loop
            metrics = (await http.get("/metrics")).text  # takes its abort: a loaded host shows that later)
            if failed in metrics:
                break
            await asyncio.sleep(0.05)
        assert failed in metrics  # one failed request (a 504; its 2 images: one request), not cancelled
        assert 'worldserve:request_cancelled_total{model_name="test-model"} 0.0' in metrics


@pytest.mark.parametrize("stage", ["prepare", "denoise", "decode"])
async def test_a_request_failing_in_the_engine_reaches_the_caller(tmp_path, stage):
    """Failures inside the engine (FakeBackend's injected ones) answer 500 with their message, and the engine
    serves the next request."""
    async with asgi_server(tmp_path) as http:
        r = await http.post(
            "/v1/images/generations", json={"prompt": f"__fail__:{stage}", "size": "64x48", **SMALL}
        )
        assert r.status_code == 500 and f"injected failure at {stage}" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["message"].startswith("Image generation failed")
        ok = await http.post("/v1/images/generations", json={"prompt": "a cat", "size": "64x48", **SMALL})
        assert ok.status_code == 200


async def test_n_above_the_queue_is_a_400_and_extra_params_win(tmp_path):
    async with asgi_server(tmp_path, max_queued_requests=2) as http:
        r = await http.post("/v1/images/generations", json={"prompt": "x", "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    from worldserve.api.images_protocol import ImageGenerationRequest, build_params

    req = ImageGenerationRequest(
        prompt="x", num_inference_steps=7, seed=1, extra_params={"num_inference_steps": 9}
    )
    [p] = build_params(req)
    assert p.num_inference_steps == 9 and p.seed == 1 and p.flow_shift == 3.0 and p.guidance_scale == 7.0
    assert (p.width, p.height, p.guidance_interval, p.generate_sound) == (1024, 1024, (400.0, 1000.0), False)


async def test_json_routes_refuse_bodies_past_the_upload_limit(tmp_path):
    async with asgi_server(tmp_path, max_upload_bytes=1024) as http:
        for path, body in (("/v1/images/generations", {"prompt": "x" * 2000}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2000}]})):  # fmt: skip
            r = await http.post(path, json=body)
            assert r.status_code == 413 and "--max-upload-mb" in r.json()["error"]["message"], r.text
        metrics = (
            await http.get("/metrics")
        ).text  # the image route's 413 is a rejection, as the video route's
        assert 'worldserve:request_rejected_total{model_name="test-model",reason="too_large"} 1.0' in metrics


def test_openai_s_streamed_images_compression_and_the_calls_not_served(tmp_path):
    """The SDK's `images.generate(stream=True)` gets an `image_generation.completed` event per image, the
    same bytes as the unstreamed answer (it had got a JSON body, which the SDK read as an empty stream);
    `output_compression` sets a JPEG's quality (PNG takes only OpenAI's default 100); a structured prompt (a JSON object) is its compact text, as
    on the video routes; images.edit and create_variation get a 404 saying they are not served."""
    openai = pytest.importorskip("openai")
    body = {"prompt": "a red fox", "size": "64x48", "n": 2, "extra_body": {**SMALL, "seed": 4}}
    with uvicorn_thread(tmp_path) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        whole = client.images.generate(**body)
        events = list(client.images.generate(**body, stream=True, partial_images=2))
        assert [e.type for e in events] == ["image_generation.completed"] * 2
        assert [e.b64_json for e in events] == [d.b64_json for d in whole.data]
        assert (events[0].size, events[0].output_format, events[0].background) == ("64x48", "png", "opaque")
        sizes = {}
        for compression in (10, 95):
            out = client.images.generate(**body, output_format="jpeg", output_compression=compression)
            sizes[compression] = len(base64.b64decode(out.data[0].b64_json))
        assert sizes[10] < sizes[95]
        # OpenAI's default compression (100) with PNG, as SDK wrappers send it, is taken: the same PNG
        best = client.images.generate(**body, output_format="png", output_compression=100)
        assert best.data[0].b64_json == whole.data[0].b64_json
        structured = {"subjects": [{"description": "a fox"}]}
        raw = {"prompt": structured, "size": "64x48", "n": 2, **SMALL, "seed": 4}
        as_object = httpx.post(f"{url}/v1/images/generations", json=raw, timeout=60)
        as_text = client.images.generate(**{**body, "prompt": '{"subjects":[{"description":"a fox"}]}'})
        assert (
            as_object.status_code == 200
            and as_object.json()["data"][0]["b64_json"] == as_text.data[0].b64_json
        )
        png = base64.b64decode(whole.data[0].b64_json)
        for call in (lambda: client.images.edit(image=("a.png", png, "image/png"), prompt="blue"),
                     lambda: client.images.create_variation(image=("a.png", png, "image/png"))):  # fmt: skip
            with pytest.raises(openai.NotFoundError, match="is not served here"):
                call()


def test_a_client_that_leaves_aborts_its_images(tmp_path):
    backend = FakeBackend(step_delay=0.05)
    with uvicorn_thread(tmp_path, backend=backend) as (url, client):
        with pytest.raises(httpx.TimeoutException):  # the client gives up and closes the connection
            httpx.post(f"{url}/v1/images/generations", json={"prompt": "x", "size": "64x64", "num_inference_steps": 200},
                       timeout=0.5)  # fmt: skip
        # 200 steps take 10 s: gone within 3 s means it was aborted
        wait_until(lambda: client.engine.num_running == 0 and client.engine.num_waiting == 0, timeout=3)
        assert not backend.live, "its state was released"


@pytest.mark.parametrize(
    "exc,param",
    [(ParamError("seed", "seed out of this model's range"), "seed"), (ValueError("refused"), None)],
)
async def test_a_request_the_model_refuses_in_the_engine_is_a_400(tmp_path, monkeypatch, exc, param):
    backend = FakeBackend()

    def refuse(request_id, params):
        raise exc

    monkeypatch.setattr(backend, "prepare", refuse)
    async with asgi_server(tmp_path, backend=backend) as http:
        r = await http.post("/v1/images/generations", json={"prompt": "x", "size": "64x48", **SMALL})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert str(exc) in r.json()["error"]["message"]


def test_the_413_shows_the_upload_limit_as_the_flag_gave_it():
    """--max-upload-mb 0.01 is 10,485 bytes: the message had said '0.00999928 MiB'."""
    from worldserve.api.bodies import too_large

    assert [too_large(int(m * 2**20)).message.split()[4] for m in (0.01, 0.5, 100, 1024)] == [
        "0.01", "0.5", "100", "1024"]  # fmt: skip

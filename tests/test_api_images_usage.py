"""OpenAI's image `usage` on POST /v1/images/generations, streamed and not: input tokens the text tokens of
the prompt as the checkpoint's tokenizer counts them (the rendered prompt the transformer prefilled), output
tokens the gen tokens it denoised (tiny checkpoint over a real uvicorn with the openai client), and the fake
backend reporting its modelled counts the same way (httpx.ASGITransport)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from serving_helpers import asgi_server, uvicorn_thread

from worldserve.engine.fake_backend import FakeBackend, gen_tokens
from worldserve.params import VideoParams

SMALL = {"num_inference_steps": 2}


@pytest.fixture(scope="module")
def pipeline(tiny_ckpt):
    from worldserve.runner.video_pipeline import VideoPipeline

    return VideoPipeline.from_pretrained(tiny_ckpt, device="cpu", dtype=torch.float32, progress=False)


def _route_params(prompt: str, width: int, height: int) -> VideoParams:
    """The request the route makes of a prompt at its T2I defaults (test_api_images.py checks they agree)."""
    return VideoParams(prompt=prompt, width=width, height=height, num_frames=1, num_inference_steps=2,
                       guidance_scale=7.0, guidance_interval=(400.0, 1000.0), flow_shift=3.0, seed=5,
                       generate_sound=False)  # fmt: skip


def _sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]


def test_usage_counts_the_prompt_tokens_and_the_denoised_gen_tokens(tmp_path, pipeline):
    openai = pytest.importorskip("openai")
    prompt = "a red fox jumps over the frozen river at dawn"
    cond_ids, _ = pipeline.encoder.encode_params(_route_params(prompt, 64, 48), with_uncond=True)
    _, frames, h, w = pipeline.vae.latent_shape(1, 48, 64)
    p = pipeline.config.latent_patch_size
    per_image = frames * -(-h // p) * -(-w // p)
    with uvicorn_thread(tmp_path, backend=pipeline, max_batch_size=2) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        out = client.images.generate(model="test-model", prompt=prompt, size="64x48", n=2,
                                     extra_body={**SMALL, "seed": 5})  # fmt: skip
        usage = out.usage
        assert usage is not None, "the unstreamed answer carries usage"
        # the prompt once for its n images (as vLLM counts a prompt its n choices share), 2 images' tokens out
        assert usage.input_tokens == usage.input_tokens_details.text_tokens == len(cond_ids)
        assert usage.input_tokens_details.image_tokens == 0
        assert usage.output_tokens == 2 * per_image and usage.output_tokens_details is not None
        assert usage.output_tokens_details.image_tokens == 2 * per_image
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        events = list(client.images.generate(model="test-model", prompt=prompt, size="64x48", n=2, stream=True,
                                             extra_body={**SMALL, "seed": 5}))  # fmt: skip
        assert [e.type for e in events] == ["image_generation.completed"] * 2
        for event in events:  # each image's own usage
            assert event.usage.input_tokens == event.usage.input_tokens_details.text_tokens == len(cond_ids)
            assert event.usage.output_tokens == per_image
            assert event.usage.total_tokens == len(cond_ids) + per_image


@pytest.mark.anyio
async def test_the_fake_backend_reports_its_modelled_counts(tmp_path):
    from worldserve.engine.fake_backend import gen_tokens

    prompt = "un renard roux sauté"  # (non-ASCII: the fake's byte tokenizer counts UTF-8 bytes)
    expected_in = len(prompt.encode("utf-8"))
    expected_out = gen_tokens(_route_params(prompt, 64, 48), sound=False)
    assert expected_out == 4  # one latent frame of 3x4 latents in 2x2 patches
    body = {"prompt": prompt, "size": "64x48", **SMALL}
    async with asgi_server(tmp_path, backend=FakeBackend()) as http:
        whole = await http.post("/v1/images/generations", json=body)
        streamed = await http.post("/v1/images/generations", json={**body, "stream": True})
    assert whole.status_code == 200 and streamed.status_code == 200
    usage = whole.json()["usage"]
    assert usage == {
        "input_tokens": expected_in, "input_tokens_details": {"text_tokens": expected_in, "image_tokens": 0},
        "output_tokens": expected_out, "total_tokens": expected_in + expected_out,
        "output_tokens_details": {"image_tokens": expected_out, "text_tokens": 0},
    }  # fmt: skip
    (event,) = _sse_events(streamed.text)
    assert event["type"] == "image_generation.completed"
    assert event["usage"] == {k: v for k, v in usage.items() if k != "output_tokens_details"}


def test_fake_gen_tokens_follow_the_real_geometry():
    """Frames, conditioning frames held clean and sound latents, as the real pipeline counts them."""
    video = VideoParams(prompt="x", width=64, height=32, num_frames=17, fps=24.0)
    # 5 latent frames of 2x4 latents -> 1x2 patches each; 17 / 24 s of 48 kHz in hops of 1920: 18 sound latents
    assert gen_tokens(video, sound=False) == 5 * 2
    assert gen_tokens(video, sound=True) == 5 * 2 + 18
    first = np.zeros((32, 64, 3), dtype=np.uint8)
    assert (
        gen_tokens(VideoParams(prompt="x", width=64, height=32, num_frames=17, image=first), sound=False) == 8
    )


def test_fake_one_frame_request_gets_no_sound_by_default():
    """VideoPipeline.sound_enabled: an unset generate_sound is on for a video only, so a one-frame request
    (an image) denoises and decodes no sound latents; the fake had counted 2 of them for 64x64 at 24 fps."""
    backend = FakeBackend(has_sound=True)
    image = VideoParams(prompt="x", width=64, height=64, num_frames=1, fps=24.0)
    state = backend.prepare("one-frame", image)
    assert state.gen_tokens == gen_tokens(image, sound=False) == 2 * 2
    assert backend.decode(state).audio is None
    video = VideoParams(prompt="x", width=64, height=64, num_frames=17, fps=24.0)
    assert backend.prepare("video", video).gen_tokens == gen_tokens(video, sound=True)

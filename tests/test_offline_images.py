"""worldserve.Engine.generate_image, text-to-image in-process, on the tiny random checkpoint (CPU, float32): the
images equal POST /v1/images/generations' PNGs for the same prompt, size, seed and n (the route served from a
pipeline loaded on its own, in-process over ASGI), the defaults and seeds are the route's (its build_params),
bad fields are named by their keyword, and ImageOutput.save writes readable PNG / JPEG files.
"""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from offline_engines import engine_fixture, served_fixture

SMALL = {"width": 64, "height": 64, "num_inference_steps": 2}
"""A tiny-checkpoint image that takes a fraction of a second on a CPU."""


engine = engine_fixture()


served = served_fixture()


def route_pngs(tmp_path, backend, body: dict) -> list[np.ndarray]:
    """The image route's answer to `body` (a server batching two requests, as the engine's options), each PNG
    decoded."""
    from PIL import Image
    from serving_helpers import asgi_server

    async def post() -> dict:
        async with asgi_server(tmp_path, backend=backend, max_batch_size=2) as http:
            r = await http.post("/v1/images/generations", json=body)
            assert r.status_code == 200, r.text
            return r.json()

    data = asyncio.run(post())["data"]
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in data]


def test_images_equal_the_image_routes_pngs(engine, served, tmp_path):
    """n=2 images of one prompt: the route's PNGs decoded, pixel for pixel, for the same prompt, size, steps,
    seed and n; two different images, seeded seed and choice_seed(seed, 1); PIL RGB images of the size asked."""
    from worldserve import ImageOutput
    from worldserve.params import choice_seed

    images = engine.generate_image("a red fox in the snow", n=2, seed=5, **SMALL)
    assert all(isinstance(out, ImageOutput) for out in images) and len(images) == 2
    assert [out.seed for out in images] == [5, choice_seed(5, 1)]
    assert all(out.image.mode == "RGB" and out.image.size == (64, 64) for out in images)
    assert all(out.params.num_frames == 1 and out.params.generate_sound is False for out in images)
    assert {"prepare", "diffuse", "vae.decode"} <= set(images[0].stage_seconds) and images[0].seconds > 0
    pixels = [np.asarray(out.image) for out in images]
    assert not np.array_equal(pixels[0], pixels[1])

    body = {"prompt": "a red fox in the snow", "n": 2, "size": "64x64", "num_inference_steps": 2, "seed": 5}
    expected = route_pngs(tmp_path, served[0], body)
    assert len(expected) == 2
    for got, want in zip(pixels, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_defaults_and_seeds_are_the_image_routes():
    """With only a prompt, n and a seed, the n requests are the route's build_params' for the same request
    (1024x1024, 50 steps, guidance 7.0 in [400, 1000], flow shift 3.0 or the engine's flow_shift, no sound,
    seeds wrapping at int64 as choice_seed does); without a seed, a random one, the others following it."""
    from worldserve.api.images_protocol import ImageGenerationRequest, build_params
    from worldserve.offline.image_requests import image_params
    from worldserve.params import IMAGE_DEFAULTS, INT64

    for seed, shift in ((7, None), (INT64 - 1, 5.0)):
        ours = image_params("a fox", 3, {"seed": seed}, default_flow_shift=shift)
        theirs = build_params(ImageGenerationRequest(prompt="a fox", n=3, seed=seed), shift)
        assert ours == theirs
    (one,) = image_params("a fox", 1, {})
    assert (one.width, one.height) == (IMAGE_DEFAULTS.width, IMAGE_DEFAULTS.height) == (1024, 1024)
    assert one.flow_shift == IMAGE_DEFAULTS.flow_shift and one.guidance_scale == IMAGE_DEFAULTS.guidance_scale
    assert [p.seed for p in image_params("a fox", 2, {"seed": INT64 - 1})] == [INT64 - 1, -INT64]
    unseeded = image_params("a fox", 2, {})
    assert unseeded[1].seed == unseeded[0].seed + 1 and 0 <= unseeded[0].seed < 2**32


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"num_frames": 5}, "num_frames"),
        ({"generate_sound": True}, "generate_sound"),
        ({"fps": 8}, "fps"),
        ({"image": np.zeros((64, 64, 3), np.uint8)}, "image"),
        ({"size": "64x64"}, "size"),
        ({"width": 1000}, "width"),
        ({"n": 0}, "n"),
        ({"n": 11}, "n"),
        ({"guidance_scale": -1.0}, "guidance_scale"),
    ],
)
def test_a_bad_field_names_its_keyword(engine, fields, param):
    """Refused before any model work, naming the keyword (num_frames other than 1 and sound as the route
    refuses them for an image)."""
    from worldserve import ParamError

    with pytest.raises(ParamError) as caught:
        engine.generate_image("a fox", **{**SMALL, **fields})
    assert caught.value.param == param
    assert engine.num_unfinished_requests == 0


def test_save_writes_a_readable_image(engine, tmp_path):
    """save(path) by extension: a PNG with the image's pixels exactly, a JPEG of its size; another extension
    is a ParamError naming `path`."""
    from PIL import Image

    from worldserve import ParamError

    (out,) = engine.generate_image("a fox", seed=3, n=np.int64(1), **SMALL)  # (a numpy n, as other fields)
    out.save(tmp_path / "fox.png")
    with Image.open(tmp_path / "fox.png") as png:
        assert png.format == "PNG"
        np.testing.assert_array_equal(np.asarray(png.convert("RGB")), np.asarray(out.image))
    out.save(str(tmp_path / "fox.JPG"))
    with Image.open(tmp_path / "fox.JPG") as jpeg:
        assert (jpeg.format, jpeg.size) == ("JPEG", (64, 64))
    with pytest.raises(ParamError) as caught:
        out.save(tmp_path / "fox.gif")
    assert caught.value.param == "path"

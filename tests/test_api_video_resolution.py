"""How a video request's size, frames, guidance and references resolve (serving-api.md §4.1, §4.3): the JSON
`video_params` object, I2V sizes from the image's aspect ratio, guidance_scale 0, a list image_reference,
oversized images and clips refused as 400s, and the model list's vLLM shape."""

from __future__ import annotations

import base64
import json

import pytest
from PIL import Image
from serving_helpers import asgi_server, mp4_bytes, png_bytes

from worldserve.api.errors import APIError
from worldserve.api.images_protocol import ImageGenerationRequest, build_params
from worldserve.api.video_inputs import build_inputs
from worldserve.media import video_input
from worldserve.media.image import ImageTooLarge
from worldserve.params import ParamError
from worldserve.resolution_tiers import aspect_size

pytestmark = pytest.mark.anyio


async def _params(fields: dict, **files):
    return (await build_inputs({**fields, **files}, served_model="m", has_sound=False)).params


async def test_video_params_fill_the_gaps_the_top_level_leaves():
    vp = {"width": 320, "height": 192, "num_frames": 17, "fps": 12}
    p = await _params({"prompt": "x", "video_params": vp})
    assert (p.width, p.height, p.num_frames, p.fps) == (320, 192, 17, 12.0)
    p = await _params({"prompt": "x", "width": 64, "height": 48, "num_frames": 9, "video_params": vp})
    assert (p.width, p.height, p.num_frames, p.fps) == (64, 48, 9, 12.0)  # top level first, gaps filled
    p = await _params({"prompt": "x", "size": "32x32", "video_params": json.dumps(vp)})  # size wins; a string
    assert (p.width, p.height, p.num_frames) == (32, 32, 17)
    p = await _params(
        {"prompt": "x", "seconds": "2", "video_params": {"fps": 10}}
    )  # frames from seconds x fps
    assert (p.num_frames, p.fps) == (21, 10.0)


@pytest.mark.parametrize(
    ("video_params", "param"),
    [([1], "video_params"), ("{nope", "video_params"), ({"width": -1, "height": 32}, "video_params"),
     ({"width": 320}, "video_params"), ({"fps": True}, "video_params")],
)  # fmt: skip
async def test_bad_video_params_name_the_field(video_params, param):
    with pytest.raises((APIError, ParamError)) as err:
        await _params({"prompt": "x", "video_params": video_params})
    assert getattr(err.value, "status", 400) == 400 and err.value.param == param


async def test_video_params_over_http_json(tmp_path):
    async with asgi_server(tmp_path) as http:
        body = {
            "prompt": "x",
            "num_inference_steps": 1,
            "video_params": {"width": 64, "height": 48, "num_frames": 5},
        }
        job = (await http.post("/v1/videos", json=body)).json()
        assert (job["size"], job["num_frames"]) == ("64x48", 5)
        models = (await http.get("/v1/models")).json()
        assert models["data"][0]["owned_by"] == "vllm"  # vLLM's ModelList (§7.2)


@pytest.mark.parametrize(
    ("src", "size"),
    [((64, 48), (1104, 816)), ((1920, 1080), (1280, 720)), ((1080, 1920), (720, 1280)), ((500, 500), (960, 960)),
     ((96, 48), (1280, 640)), ((2100, 900), (1280, 544)), ((1000, 10), (1280, 16))],
)  # fmt: skip
def test_aspect_size_keeps_the_ratio_inside_the_720p_area(src, size):
    assert aspect_size(*src) == size
    w, h = size
    assert w % 16 == 0 and h % 16 == 0 and w * h <= 1280 * 720 and max(w, h) <= 1280


async def test_i2v_without_a_size_takes_the_image_aspect_ratio():
    png = png_bytes(64, 48)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    p = await _params({"prompt": "x", "num_frames": 5, "image_reference": {"image_url": url}})
    assert (p.width, p.height) == (1104, 816) and p.image.shape == (48, 64, 3)
    p = await _params(
        {"prompt": "x", "num_frames": 5, "size": "320x192", "image_reference": {"image_url": url}}
    )
    assert (p.width, p.height) == (320, 192)  # a size given wins
    p = await _params({"prompt": "x", "num_frames": 5})
    assert (p.width, p.height) == (1280, 720)  # T2V keeps the model default


async def test_v2v_without_a_size_takes_the_clips_aspect_ratio():
    """vLLM-Omni's pre_process_func sets a V2V request's size from the clip's first frame as an I2V image's
    (the 720p area): a portrait clip ran at 1280x720 here; its default flow shift is 10.0 at any size."""
    url = "data:video/mp4;base64," + base64.b64encode(mp4_bytes(frames=6, width=16, height=32)).decode()
    p = await _params({"prompt": "x", "num_frames": 5, "video_reference": {"video_url": url}})
    assert (p.width, p.height) == aspect_size(16, 32) and p.width < p.height
    assert p.video is not None and p.resolved_flow_shift() == 10.0
    p = await _params(
        {"prompt": "x", "num_frames": 5, "size": "320x192", "video_reference": {"video_url": url}}
    )
    assert (p.width, p.height) == (320, 192)  # a size given wins


async def test_image_reference_may_be_a_list_of_one():
    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    p = await _params(
        {"prompt": "x", "num_frames": 5, "size": "64x48", "image_reference": [{"image_url": url}]}
    )
    assert p.image is not None
    with pytest.raises(ParamError) as err:
        await _params({"prompt": "x", "image_reference": json.dumps([{"image_url": url}] * 2)})
    assert err.value.param == "image_reference" and "one image_reference" in err.value.message


async def test_guidance_scale_zero_means_the_default():
    for fields in ({"guidance_scale": 0}, {"extra_params": {"guidance_scale": 0}}, {}):
        assert (await _params({"prompt": "x", **fields})).guidance_scale == 6.0
    assert (await _params({"prompt": "x", "guidance_scale": 1})).guidance_scale == 1.0  # 1: cond only
    [image] = build_params(ImageGenerationRequest(prompt="x", guidance_scale=0))
    assert image.guidance_scale == 7.0  # the text-to-image default


def test_an_image_above_the_pixel_limit_is_refused_not_decoded_as_video(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # the 64x48 PNG below has 3,072
    with pytest.raises(ImageTooLarge) as err:
        video_input.decode_reference(png_bytes(64, 48), max_frames=5)
    assert err.value.param == "input_reference" and "3,072 pixels" in err.value.message
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # Pillow itself refuses above twice its limit
    with pytest.raises(ImageTooLarge):
        video_input.decode_reference(png_bytes(64, 48), max_frames=5)


def test_video_frames_above_the_limits_are_refused_before_decoding(monkeypatch):
    clip = mp4_bytes(frames=6, width=32, height=16)
    assert video_input.decode_video(clip, 5).shape == (5, 16, 32, 3)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ParamError, match="a video frame of 32x16"):
        video_input.decode_video(clip, 5)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10**8)
    monkeypatch.setattr(video_input, "MAX_DECODED_BYTES", 3 * 32 * 16 * 3)  # room for 3 frames
    assert video_input.decode_video(clip, 3).shape[0] == 3
    with pytest.raises(ParamError, match="at most 3 frames fit"):
        video_input.decode_video(clip, 5)


def _ts_segment(width: int, height: int, frames: int = 6) -> bytes:
    """An MPEG-TS clip of `frames` flat frames (TS segments concatenate into one stream)."""
    from serving_helpers import flat_clip

    return flat_clip(frames, width, height, container="mpegts", codec="mpeg2video", rate=24, step=40)


def test_a_clip_that_changes_size_mid_stream_is_a_400():
    assert video_input.decode_video(_ts_segment(64, 64), 5).shape[1:] == (64, 64, 3)
    with pytest.raises(ParamError, match="changes size mid-stream"):
        video_input.decode_video(_ts_segment(64, 64) + _ts_segment(32, 48), 12, param="video_reference")


async def test_cheap_checks_come_before_a_reference_download():
    class NoFetch:
        async def fetch(self, *a, **k):
            raise AssertionError("downloaded a reference for a request refused anyway")

    url = {"image_url": "http://127.0.0.1:9/a.png"}
    for bad in ({"quality": "ultra"}, {"num_frames": 6}, {"lora": '{"name": "a", "path": "b"}'}):
        with pytest.raises((APIError, ParamError)):
            await build_inputs({"prompt": "x", "image_reference": url, **bad}, served_model="m", has_sound=False,
                               fetcher=NoFetch())  # fmt: skip


@pytest.mark.parametrize("field", ["image_reference", "video_reference", "video_params", "extra_params"])
async def test_json_fields_nested_too_deep_are_a_400(field):
    with pytest.raises(APIError) as err:
        await _params({"prompt": "x", field: "[" * 100_000})
    assert err.value.status == 400 and err.value.param == field and "Invalid JSON" in err.value.message

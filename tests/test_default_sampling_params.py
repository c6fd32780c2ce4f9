"""`--default-sampling-params` (vLLM-Omni's flag): the server's values for the video fields a request omits.

The flag parses into ServerConfig (stage "0", VideoParams field names, each value's type, the values checked
together as a request's), a request's own values win wherever they come from (top level, `video_params`,
`extra_params`), a default size stands before an I2V image's aspect ratio and a default fps before `seconds`
becomes frames, and a server built from the parsed flags generates with them over HTTP.
"""

from __future__ import annotations

import json

import pytest
from serving_helpers import asgi_server, png_bytes, poll_job
from test_api_videos import RecordingBackend
from test_serve_compat_flags import config, parse_args

from worldserve.api.video_inputs import build_inputs

DEFAULTS = {"num_inference_steps": 7, "width": 320, "height": 192, "num_frames": 17, "fps": 16.0,
            "guidance_scale": 4.5, "seed": 9, "negative_prompt": "blurry"}  # fmt: skip


def test_the_flag_becomes_the_video_defaults_with_flow_shift():
    cfg = config("--default-sampling-params", json.dumps({"0": DEFAULTS}), "--flow-shift", "7")
    assert cfg.video.video_defaults == {**DEFAULTS, "flow_shift": 7.0}
    own = config("--default-sampling-params", '{"0": {"flow_shift": 3}}', "--flow-shift", "7")
    assert own.video.video_defaults == {"flow_shift": 3}, "the flag's own flow_shift wins over --flow-shift"
    assert config().video.video_defaults == {} and config("--flow-shift", "5").video.video_defaults == {
        "flow_shift": 5.0
    }
    assert config("--default-sampling-params", '{"0": null, "1": {}}').video.video_defaults == {}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"1": {"num_inference_steps": 20}}', "stage '1': worldserve generates in one stage"),
        ('{"0": {"steps": 20}}', "unknown field 'steps'"),
        ('{"0": {"num_inference_steps": "20"}}', "num_inference_steps must be an integer"),
        ('{"0": {"num_inference_steps": true}}', "num_inference_steps must be an integer"),
        ('{"0": {"generate_sound": 1}}', "generate_sound must be true or false"),
        ('{"0": {"width": 640}}', "width and height must be given together"),
        ('{"0": [1]}', "expected an object of fields"),
        ("[]", "expected an object of stages"),
        ("{bad", "not valid JSON"),
    ],
)
def test_malformed_values_stop_the_start_naming_what_is_wrong(value, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args("--default-sampling-params", value)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--default-sampling-params" in err and message in err


@pytest.mark.parametrize(
    ("defaults", "message"),
    [
        ({"num_inference_steps": 500}, "num_inference_steps=500 must be in [1, 200]"),
        ({"num_frames": 301, "width": 832, "height": 480}, "exceeds the 480p limit"),
        ({"width": 650, "height": 480}, "width"),
        ({"guidance_scale": 25}, "guidance_scale=25 must be in [0, 20]"),
    ],
)
def test_values_that_no_request_could_use_stop_the_start(defaults, message):
    with pytest.raises(ValueError, match="--default-sampling-params") as error:
        config("--default-sampling-params", json.dumps({"0": defaults}))
    assert message in str(error.value)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_requests_take_the_defaults_for_what_they_omit_and_keep_their_own(anyio_backend):
    got = (await build_inputs({"prompt": "x"}, served_model="m", has_sound=False, defaults=DEFAULTS)).params
    assert (got.num_inference_steps, got.width, got.height, got.num_frames, got.fps) == (
        7,
        320,
        192,
        17,
        16.0,
    )
    assert (got.guidance_scale, got.seed, got.negative_prompt) == (4.5, 9, "blurry")
    fields = {"prompt": "x", "num_inference_steps": "3", "size": "256x256", "num_frames": "9", "fps": "24",
              "guidance_scale": "2", "seed": "1", "negative_prompt": "dark"}  # fmt: skip
    own = (await build_inputs(fields, served_model="m", has_sound=False, defaults=DEFAULTS)).params
    assert (own.num_inference_steps, own.width, own.height, own.num_frames, own.fps) == (3, 256, 256, 9, 24.0)
    assert (own.guidance_scale, own.seed, own.negative_prompt) == (2.0, 1, "dark")
    extra = {"prompt": "x", "extra_params": json.dumps({"num_inference_steps": 4, "seed": 5}),
             "video_params": json.dumps({"num_frames": 13, "width": 256, "height": 320})}  # fmt: skip
    mixed = (await build_inputs(extra, served_model="m", has_sound=False, defaults=DEFAULTS)).params
    assert (mixed.num_inference_steps, mixed.seed, mixed.num_frames, mixed.width) == (4, 5, 13, 256)
    zero = (await build_inputs({"prompt": "x", "guidance_scale": "0"}, served_model="m", has_sound=False,
                               defaults=DEFAULTS)).params  # fmt: skip
    assert zero.guidance_scale == 4.5, "a scale of 0 means not given: the server's default"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_default_fps_makes_the_frames_of_seconds_and_a_default_size_beats_the_image_aspect(
    anyio_backend,
):
    fps = {"fps": 16.0}
    got = (await build_inputs({"prompt": "x", "size": "320x192", "seconds": "2"}, served_model="m",
                              has_sound=False, defaults=fps)).params  # fmt: skip
    assert (got.fps, got.num_frames) == (16.0, 33), "2 s at the default 16 fps"
    tall = png_bytes(width=90, height=160)
    aspect = (await build_inputs(_upload(tall), served_model="m", has_sound=False)).params
    assert aspect.width < aspect.height, "without a default the image's aspect ratio sets the size"
    sized = (await build_inputs(_upload(tall), served_model="m", has_sound=False,
                                defaults={"width": 320, "height": 192})).params  # fmt: skip
    assert (sized.width, sized.height) == (320, 192)


def _upload(png: bytes) -> dict:
    """An I2V request's fields, its image uploaded as the form parser hands it over."""
    from io import BytesIO

    from starlette.datastructures import Headers, UploadFile

    image = UploadFile(BytesIO(png), filename="ref.png", headers=Headers({"content-type": "image/png"}))
    return {"prompt": "x", "num_frames": "5", "input_reference": image}


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_server_started_with_the_flag_generates_with_its_defaults(anyio_backend, tmp_path):
    cfg = config("--default-sampling-params", json.dumps({"0": DEFAULTS}))
    backend = RecordingBackend()
    async with asgi_server(
        tmp_path, backend=backend, app_kw={"video_defaults": cfg.video.video_defaults}
    ) as http:
        r = await http.post("/v1/videos", data={"prompt": "a red fox"})
        assert r.status_code == 200, r.text
        job = await poll_job(http, r.json()["id"])
        assert job["status"] == "completed" and job["size"] == "320x192"
        r = await http.post("/v1/videos", json={"prompt": "a red fox", "num_inference_steps": 2})
        assert r.status_code == 200, r.text
        await poll_job(http, r.json()["id"])
    first, second = backend.params
    assert (first.num_inference_steps, first.num_frames, first.fps, first.seed) == (7, 17, 16.0, 9)
    assert (second.num_inference_steps, second.width) == (2, 320)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_server_negative_prompt_is_not_capped_by_the_requests_max_sequence_length(
    anyio_backend, tiny_ckpt
):
    """Review find: the server's negative prompt was capped as if the request had sent it, so a request's
    max_sequence_length set for its prompt (NVIDIA's README: 512) was refused for a text it never sent."""
    from worldserve.models.cosmos3.prompt import PromptEncoder
    from worldserve.params import ParamError

    encoder = PromptEncoder.from_pretrained(tiny_ckpt)
    defaults = {"negative_prompt": "blurry, dark, " * 200, "width": 320, "height": 192, "num_frames": 17}
    got = (await build_inputs({"prompt": "a cat", "max_sequence_length": "128"}, served_model="m",
                              has_sound=False, defaults=defaults)).params  # fmt: skip
    assert got.server_negative_prompt and got.negative_prompt == defaults["negative_prompt"]
    cond, uncond = encoder.encode_params(got)
    assert len(cond) <= 128 < len(uncond)
    own = (await build_inputs({"prompt": "a cat", "max_sequence_length": "128", "negative_prompt": "x " * 300},
                              served_model="m", has_sound=False, defaults=defaults)).params  # fmt: skip
    assert not own.server_negative_prompt
    with pytest.raises(ParamError) as err:
        encoder.encode_params(own)
    assert err.value.param == "negative_prompt", "the request's own negative prompt is capped"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_sound_default_applies_to_videos_of_a_checkpoint_with_sound(anyio_backend):
    """Review find: a default generate_sound true made every image request (no sound there) a 400."""
    on = {"generate_sound": True}
    video = {"prompt": "x", "size": "320x192", "num_frames": "17"}
    image = {"prompt": "x", "size": "512x512", "num_frames": "1"}
    assert (
        await build_inputs(dict(video), served_model="m", has_sound=True, defaults=on)
    ).params.generate_sound
    assert (
        await build_inputs(dict(image), served_model="m", has_sound=True, defaults=on)
    ).params.generate_sound is None
    silent = await build_inputs(dict(video), served_model="m", has_sound=False, defaults=on)
    assert silent.params.generate_sound is False, "no sound tokenizer: the default cannot turn sound on"
    own = await build_inputs(
        {**video, "generate_sound": "false"}, served_model="m", has_sound=True, defaults=on
    )
    assert own.params.generate_sound is False


def test_a_default_guidance_of_zero_is_refused_and_auto_warm_up_follows_the_default_shape():
    """Review finds: a default guidance_scale 0 generated without the prompt (a request's 0 means 'not
    given'); --warmup-shapes auto warmed 1280x720x189 whatever the default shape."""
    with pytest.raises(ValueError, match="guidance_scale 0 would generate without the prompt"):
        config("--default-sampling-params", '{"0": {"guidance_scale": 0}}')
    small = config("--default-sampling-params", '{"0": {"width": 832, "height": 480, "num_frames": 121}}')
    assert small.model.warmup_shape_list(on_gpu=True) == [(832, 480, 121)]
    assert config().model.warmup_shape_list(on_gpu=True) == [(1280, 720, 189)]
    assert small.model.warmup_shape_list(on_gpu=False) == []

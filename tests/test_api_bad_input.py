"""Bad input never gets a 5xx: a table of known cases (status, envelope, `param`), then a hypothesis-driven
run over every operation of /openapi.json (valid-ish and garbage values, every body type)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from serving_helpers import asgi_server, mp4_bytes, png_bytes, poll_job, uvicorn_thread

pytestmark = pytest.mark.anyio
MISSING_PROMPT = "{'type': 'missing', 'loc': ('body', 'prompt'), 'msg': 'Field required', 'input': None}"
NOT_AN_IMAGE = "Invalid input_reference: provided content is not a valid image or video."
V2V_REF = json.dumps({"video_url": "data:video/mp4;base64," + base64.b64encode(mp4_bytes()).decode()})
I2V_REF = json.dumps({"image_url": "data:image/png;base64," + base64.b64encode(png_bytes()).decode()})
OK = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "1"}
BY_SECONDS = {**OK, "num_frames": ""}  # (an empty form value is "not given")


# (form fields or a callable building the request kwargs, status, param, message substring)
CASES = [
    ("missing prompt", {"size": "64x48"}, 400, "prompt", MISSING_PROMPT),
    ("empty prompt", {"prompt": ""}, 400, "prompt", "prompt must be a non-empty string"),
    ("size 640x", {**OK, "size": "640x"}, 400, "size", "string_pattern_mismatch"),
    ("size 1280*720", {**OK, "size": "1280*720"}, 400, "size", "should match pattern"),
    ("size 1280X720", {**OK, "size": "1280X720"}, 400, "size", "pattern"),
    ("size 1296x720", {**OK, "size": "1296x720"}, 400, "size", "multiple of 16 in [16, 1280] (it is above 1280)"),
    ("size in fullwidth digits", {**OK, "size": "６４x４８"}, 400, "size", "pattern"),
    ("codec option a boolean", {**OK, "extra_params": '{"video_codec_options": {"g": true}}'}, 400,
     "extra_params.video_codec_options", "'video_codec_options', 'g'"),
    ("size not /16", {**OK, "size": "100x48"}, 400, "size", "multiple of 16"),
    ("size above 720p", {**OK, "size": "1280x1280"}, 400, "size", "largest resolution tier"),
    ("width alone", {**OK, "size": "", "width": "64"}, 400, "height", "width and height must be given together"),
    ("seconds abc", {**OK, "seconds": "abc"}, 400, "seconds", "pattern"),
    ("seconds 0", {**OK, "seconds": "0"}, 400, "seconds", "pattern"),
    ("huge num_frames", {**OK, "num_frames": "1001"}, 400, "num_frames", "exceeds the 256p limit"),
    ("num_frames 0", {**OK, "num_frames": "0"}, 400, "num_frames", "greater than or equal to 1"),
    ("num_frames not 4k+1", {**OK, "num_frames": "8"}, 400, "num_frames", "must be 1 or 4k+1"),
    ("num_frames float", {**OK, "num_frames": "5.5"}, 400, "num_frames", "int_parsing"),
    ("negative steps", {**OK, "num_inference_steps": "-3"}, 400, "num_inference_steps", "greater than or equal to 1"),
    ("201 steps", {**OK, "num_inference_steps": "201"}, 400, "num_inference_steps", "less than or equal to 200"),
    ("guidance 25", {**OK, "guidance_scale": "25"}, 400, "guidance_scale", "less than or equal to 20"),
    ("guidance nan", {**OK, "guidance_scale": "nan"}, 400, "guidance_scale", "finite"),
    ("fps 0", {**OK, "fps": "0"}, 400, "fps", "greater than or equal to 1"),
    ("seed -2**63-1", {**OK, "seed": str(-(2**63) - 1)}, 400, "seed", "greater than"),
    ("seed 2**64", {**OK, "seed": str(2**64)}, 400, "seed", "less than"),
    ("bool garbage", {**OK, "generate_sound": "maybe"}, 400, "generate_sound", "bool_parsing"),
    ("quality ultra", {**OK, "quality": "ultra"}, 400, "quality", "quality must be one of ['lossless', 'high']"),
    ("quality default", {**OK, "quality": "default"}, 400, "quality", "quality must be one of ['lossless', 'high']"),
    ("n outputs 11", {**OK, "num_outputs_per_prompt": "11"}, 400, "num_outputs_per_prompt", "less than"),
    ("lora not JSON", {**OK, "lora": "notjson"}, 400, "lora", "Invalid lora object"),
    ("sound_duration under a frame", {**OK, "fps": "5", "generate_sound": "true", "sound_duration": "0.1"}, 400,
     "sound_duration", "sound_duration=0.1 must be in [1 / fps, "),
    ("extra audio_duration too long", {**OK, "generate_sound": "true", "extra_params": '{"audio_duration": 1e6}'},
     400, "extra_params.audio_duration", "sound_duration=1000000.0 must be in [1 / fps"),
    ("extra negative_metadata_mode", {**OK, "extra_params": '{"negative_metadata_mode": "zzz"}'}, 400,
     "extra_params.negative_metadata_mode", "'extra_params', 'negative_metadata_mode'"),
    ("lora no path", {**OK, "lora": '{"name": "a"}'}, 400, "lora", "both name and path are required"),
    ("lora without --enable-lora", {**OK, "lora": '{"name": "a", "path": "/x"}'}, 400, "lora",
     "per-request LoRA adapters are off on this server: start it with --enable-lora"),
    ("control_type alone", {**OK, "control_type": "edge"}, 400, "control_type", "requires a control_reference"),
    # vLLM-Omni's Wan2.2 fields and return_stage_metrics: typed (they were ignored whatever their value)
    ("true_cfg_scale abc", {**OK, "true_cfg_scale": "abc"}, 400, "true_cfg_scale", "float_parsing"),
    ("guidance_scale_2 nan", {**OK, "guidance_scale_2": "nan"}, 400, "guidance_scale_2", "finite"),
    ("boundary_ratio abc", {**OK, "boundary_ratio": "abc"}, 400, "boundary_ratio", "float_parsing"),
    ("return_stage_metrics maybe", {**OK, "return_stage_metrics": "maybe"}, 400, "return_stage_metrics",
     "bool_parsing"),
    ("interpolation 0", {**OK, "frame_interpolation_exp": "0"}, 400, "frame_interpolation_exp", "greater than"),
    ("interpolation on", {**OK, "enable_frame_interpolation": "true"}, 400, "enable_frame_interpolation",
     "not supported"),
    ("model mismatch", {**OK, "model": "nvidia/Cosmos3-Super"}, 400, "model", "Model mismatch: request specifies"),
    ("extra_params not JSON", {**OK, "extra_params": "{"}, 400, "extra_params", "Invalid JSON in form field."),
    ("extra_params 5000-digit number", {**OK, "extra_params": "9" * 5000}, 400, "extra_params",
     "Invalid JSON in form field."),
    ("video_params 5000-digit number", {**OK, "video_params": '{"fps": %s}' % ("9" * 5000)}, 400, "video_params",
     "Invalid JSON in form field."),
    ("extra_params list", {**OK, "extra_params": "[]"}, 400, "extra_params", "expected dict, got list."),
    ("extra_params null", {**OK, "extra_params": "null"}, 400, "extra_params", "expected dict, got NoneType."),
    ("video_params null", {**OK, "video_params": "null"}, 400, "video_params", "expected dict, got NoneType."),
    ("audio_reference null", {**OK, "audio_reference": "null"}, 400, "audio_reference",
     "expected dict, got NoneType."),
    ("extra_params action", {**OK, "extra_params": '{"action_mode": "policy"}'}, 400, "extra_params.action_mode",
     "not supported"),
    ("video_reference not a video", {**OK, "video_reference": '{"video_url": "data:video/mp4;base64,AA=="}'},
     400, "video_reference", "Invalid video_reference: provided content is not a valid video."),
    ("video_reference file_id", {**OK, "video_reference": '{"file_id": "f"}'}, 400, "video_reference",
     "file_id is not supported"),
    ("image and video references", {**OK, "image_reference": '{"image_url": "data:image/png;base64,AAAA"}',
     "video_reference": '{"video_url": "data:video/mp4;base64,AA=="}'}, 400, "video_reference", "not both"),
    ("condition index out of range", {**OK, "extra_params": '{"condition_frame_indexes_vision": [0, 9]}',
     "video_reference": V2V_REF}, 400,
     "extra_params.condition_frame_indexes_vision", "outside the latent timeline"),
    ("condition index negative", {**OK, "extra_params": '{"condition_frame_indexes_vision": [-1]}',
     "video_reference": V2V_REF}, 400,
     "extra_params.condition_frame_indexes_vision", "non-negative"),
    ("condition keep middle", {**OK, "extra_params": '{"condition_video_keep": "middle"}'}, 400,
     "extra_params.condition_video_keep", "literal_error"),
    ("image url download", {**OK, "image_reference": '{"image_url": "http://127.0.0.1:9/a.png"}'}, 400,
     "image_reference", "Invalid image_reference.image_url: failed to download image."),
    ("image url scheme", {**OK, "image_reference": '{"image_url": "ftp://x"}'}, 400, "image_reference",
     "must be an http(s) URL or data URL."),
    ("bad base64", {**OK, "image_reference": '{"image_url": "data:image/png;base64,@@@"}'}, 400, "image_reference",
     "base64"),
    ("data url not an image", {**OK, "image_reference": '{"image_url": "data:image/png;base64,AAAA"}'}, 400,
     "image_reference", "not a valid image"),
    ("input_reference as text", {**OK, "input_reference": "hello"}, 400, "input_reference", "file upload"),
    # numbers bounded before int() / float() can overflow, each error naming the field the value came in
    ("fps 1e308 with seconds", {**BY_SECONDS, "seconds": "2", "fps": "1e308"}, 400, "fps", "in [1, 120]"),
    ("seconds 400 digits", {**BY_SECONDS, "seconds": "9" * 400}, 400, "seconds", "400-digit number is above 400"),
    ("seconds 5000 digits", {**BY_SECONDS, "seconds": "9" * 5000}, 400, "seconds", "5000-digit number"),
    ("seconds past the tier", {**BY_SECONDS, "seconds": "20"}, 400, "seconds", "(from seconds x fps 24) exceeds the 256p"),
    ("seconds of one frame", {**BY_SECONDS, "seconds": "3", "fps": "1"}, 400, "seconds",  # (was a still image)
     "seconds=3 at fps=1 is 3 frames, fewer than the shortest video's 5"),
    ("size 5000 digits", {**OK, "size": "1" + "0" * 5000 + "x16"}, 400, "size", "must be at most 1280"),
    ("video_params fps 1e300", {**BY_SECONDS, "seconds": "2", "video_params": '{"fps": 1e300}'}, 400,
     "video_params", "fps=1e+300 must be a number in [1, 120]"),
    ("video_params width alone", {**OK, "size": "", "video_params": '{"width": 32}'}, 400, "video_params",
     "width and height must be given together (height is missing)"),
    ("video_params height 17", {**OK, "size": "", "video_params": '{"width": 32, "height": 17}'}, 400,
     "video_params", "height=17 must be a multiple of 16"),
    # an area past the largest tier names the field the sides came in (both in range alone)
    ("size area", {**OK, "size": "1280x1280"}, 400, "size", "above the model's largest resolution tier"),
    ("width x height area", {**OK, "size": "", "width": "1280", "height": "1280"}, 400, "width",
     "above the model's largest resolution tier"),
    ("video_params area", {**OK, "size": "", "video_params": '{"width": 1280, "height": 1280}'}, 400,
     "video_params", "above the model's largest resolution tier"),
    ("width 2**70", {**OK, "size": "", "width": str(2**70), "height": "16"}, 400, "width", "22-digit number"),
    ("height 8", {**OK, "size": "", "width": "16", "height": "8"}, 400, "height", "height=8 must be"),
    ("image_reference one frame", {**OK, "num_frames": "1", "image_reference": I2V_REF}, 400, "image_reference",
     "image-to-video needs num_frames > 1"),
    ("video_reference one frame", {**OK, "num_frames": "1", "video_reference": V2V_REF}, 400, "video_reference",
     "video-to-video needs num_frames > 1"),
    ("extra guidance_interval", {**OK, "extra_params": '{"guidance_interval": [5, 1]}'}, 400,
     "extra_params.guidance_interval", "0 <= lo <= hi <= 1000"),
    ("extra condition index true", {**OK, "extra_params": '{"condition_frame_indexes_vision": [0, true]}'}, 400,
     "extra_params.condition_frame_indexes_vision", "got a boolean"),
    ("extra_params deep JSON text", {**OK, "extra_params": '{"a": ' * 300 + "1" + "}" * 300}, 400, "extra_params",
     "nested deeper than"),
    ("extra flow_shift", {**OK, "extra_params": '{"flow_shift": 1000}'}, 400, "extra_params.flow_shift",
     "must be in [0.001, 100]"),
    # a denormal shift underflows the schedule's sigmas to 0: it was accepted, then failed the job
    ("flow_shift denormal", {**OK, "flow_shift": "5e-324"}, 400, "flow_shift", "must be in [0.001, 100]"),
    ("extra max_sequence_length", {**OK, "extra_params": '{"max_sequence_length": 200000}'}, 400,
     "extra_params.max_sequence_length", "[1, 131072]"),
    ("condition index negative, T2V", {**OK, "extra_params": '{"condition_frame_indexes_vision": [-1]}'}, 400,
     "extra_params.condition_frame_indexes_vision", "non-negative ints, e.g. [0, 1]; got -1"),
    ("condition index 2**70, T2V", {**OK, "extra_params": '{"condition_frame_indexes_vision": [1180591620717411303424]}'},
     400, "extra_params.condition_frame_indexes_vision", "outside the latent timeline"),
    ("condition index past num_frames, T2V", {**OK, "extra_params": '{"condition_frame_indexes_vision": [2]}'}, 400,
     "extra_params.condition_frame_indexes_vision", "outside the latent timeline (latent_frames=2"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "fields", "status", "param", "message"), CASES, ids=[c[0] for c in CASES])
async def test_bad_form_fields(tmp_path, name, fields, status, param, message):
    async with asgi_server(tmp_path) as http:
        for route in ("/v1/videos", "/v1/videos/sync"):
            r = await http.post(route, data=fields)
            assert r.status_code == status, (route, r.text)
            err = r.json()["error"]
            assert err["code"] == status and err["type"] == "Bad Request" and err["param"] == param, err
            assert message in err["message"], err["message"]
        jobs = (await http.get("/v1/videos")).json()["data"]
        assert jobs == [], "a rejected request leaves no job behind"


JSON_CASES = [
    ("fps 1e308", "/v1/videos", '{"prompt": "x", "size": "32x32", "seconds": "2", "fps": 1e308}', "fps"),
    ("seconds 400 digits", "/v1/videos/sync", '{"prompt": "x", "size": "32x32", "seconds": "' + "9" * 400 + '"}',
     "seconds"),
    ("seconds 5000 digits", "/v1/videos", '{"prompt": "x", "size": "32x32", "seconds": "' + "9" * 5000 + '"}',
     "seconds"),
    ("size 5000 digits", "/v1/videos/sync", '{"prompt": "x", "num_frames": 5, "size": "1' + "0" * 5000 + 'x16"}',
     "size"),
    ("video_params fps 1e300", "/v1/videos",
     '{"prompt": "x", "size": "32x32", "seconds": 2, "video_params": {"fps": 1e300}}', "video_params"),
    ("width 2**70", "/v1/videos", '{"prompt": "x", "width": 1180591620717411303424, "height": 16}', "width"),
    ("extra_params a list", "/v1/videos", '{"prompt": "x", "extra_params": [1]}', "extra_params"),
    ("video_params a number", "/v1/videos/sync", '{"prompt": "x", "video_params": 5}', "video_params"),
    ("true_cfg_scale NaN", "/v1/images/generations", '{"prompt": "x", "size": "32x32", "true_cfg_scale": NaN}',
     "true_cfg_scale"),
    ("true_cfg_scale -Infinity", "/v1/images/generations",
     '{"prompt": "x", "size": "32x32", "true_cfg_scale": -Infinity}', "true_cfg_scale"),
    ("image extra flow_shift", "/v1/images/generations",
     '{"prompt": "x", "size": "32x32", "extra_params": {"flow_shift": 1000}}', "extra_params.flow_shift"),
    ("image flow_shift denormal", "/v1/images/generations",
     '{"prompt": "x", "size": "32x32", "flow_shift": 5e-324}', "flow_shift"),
    ("image extra guidance_interval", "/v1/images/generations",
     '{"prompt": "x", "size": "32x32", "extra_params": {"guidance_interval": [5, 1]}}',
     "extra_params.guidance_interval"),
    ("image extra max_sequence_length", "/v1/images/generations",
     '{"prompt": "x", "size": "32x32", "extra_params": "{\\"max_sequence_length\\": 200000}"}',
     "extra_params.max_sequence_length"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "route", "body", "param"), JSON_CASES, ids=[c[0] for c in JSON_CASES])
async def test_bad_json_numbers_are_short_400s_naming_the_field(tmp_path, name, route, body, param):
    """The fuzzer's bodies: huge or non-finite numbers were 500s (OverflowError, int()'s digit limit), went
    through, or named another field; each is a 400 naming the field it came in, with a short message."""
    async with asgi_server(tmp_path) as http:
        r = await http.post(route, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == param and len(err["message"]) < 400, err


async def test_forms_take_starlette_s_1000_fields_and_no_more(tmp_path):
    """Undeclared fields are ignored up to Starlette's (and so vLLM-Omni's) 1,000 a form, multipart and
    urlencoded alike; past it a 400 in Starlette's words."""
    async with asgi_server(tmp_path) as http:
        for extra, status in ((1000 - len(OK), 200), (1001 - len(OK), 400)):
            fields = {**OK, **{f"x{i}": "1" for i in range(extra)}}
            for files in (None, {"unused": ("u.txt", b"u", "text/plain")}):  # (urlencoded, multipart)
                r = await http.post("/v1/videos", data=fields, files=files)
                assert r.status_code == status, (extra, files, r.text[:200])
                if status == 400:
                    assert (
                        r.json()["error"]["message"] == "Too many fields. Maximum number of fields is 1000."
                    )


async def test_a_part_header_over_the_parser_s_limit_is_told(tmp_path):
    """A 60 kB filename passes python-multipart's header line limit: a 400 saying so (Starlette's own
    message had been "Invalid multipart data." alone)."""
    async with asgi_server(tmp_path) as http:
        files = {"input_reference": ("a" * 60_000 + ".png", b"x", "image/png")}
        r = await http.post("/v1/videos", data={"prompt": "a fox"}, files=files)
        assert r.status_code == 400, r.text[:300]
        message = r.json()["error"]["message"]
        assert (
            message.startswith("Invalid multipart data: Maximum header size exceeded")
            and "filename" in message
        )


async def test_a_long_bad_value_is_echoed_cut_to_200_characters(tmp_path):
    """The validation message quotes the value it refused, its first 200 characters and "...": a 10,000-
    character value is not sent back whole; nor is a model name the server does not serve."""
    async with asgi_server(tmp_path) as http:
        r = await http.post("/v1/videos", data={"prompt": "x", "size": "7" * 10_000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "size"
        message = r.json()["error"]["message"]
        assert f"'input': '{'7' * 200}...'" in message and "7" * 201 not in message, message[:500]
        for route, body in (("/v1/videos", {"prompt": "x"}), ("/v1/images/generations", {"prompt": "x"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):  # fmt: skip
            r = await http.post(route, json={**body, "model": "m" * 100_000})
            error = r.json()["error"]
            assert error["param"] == "model" and "m" * 200 + "..." in error["message"], (route, r.text[:300])
            assert len(r.content) < 1_000, route  # (the whole name had come back)


def test_a_long_bytes_value_is_echoed_cut_to_200_bytes():
    """pydantic quotes a bytes input as it was given (a bytes value validated as another type): it is cut as a
    string is (`bytes + "..."` had raised a TypeError, a 500 where the answer is a 400)."""
    from pydantic import BaseModel, ValidationError

    from worldserve.api.errors import validation_error

    class Sized(BaseModel):
        size: int

    with pytest.raises(ValidationError) as refused:
        Sized.model_validate({"size": b"7x" * 5_000})
    err = validation_error(refused.value.errors())
    assert err.status == 400 and err.param == "size"
    assert f"'input': {b'7x' * 100 + b'...'!r}" in err.message and "7x" * 101 not in err.message, err.message


async def test_a_reference_far_from_the_videos_aspect_ratio_is_a_400_before_any_job(tmp_path):
    """A 1 x 80,000 PNG (a few hundred bytes) would be resized to 64 x 5,120,000 pixels to cover 64x64: a 400
    naming the field it came in, at create time (it was a job that failed with a 500, or gigabytes of RAM)."""
    strip = png_bytes(1, 80_000)
    url = "data:image/png;base64," + base64.b64encode(strip).decode()
    async with asgi_server(tmp_path) as http:
        size = {**OK, "size": "64x64"}
        r = await http.post("/v1/videos", data=size, files={"input_reference": ("s.png", strip, "image/png")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text
        assert "would be resized to 64x5120000" in r.json()["error"]["message"], r.text
        r = await http.post("/v1/videos/sync", json={**size, "image_reference": {"image_url": url}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "image_reference", r.text
        assert (await http.get("/v1/videos")).json()["data"] == []


async def test_a_data_url_scheme_is_read_in_any_case_as_chat_reads_it(tmp_path):
    """`DATA:image/png;base64,...` and one with a blank before it: the chat routes read them (urlsplit), the
    video routes refused them ("must be an http(s) URL or data URL")."""
    payload = base64.b64encode(png_bytes()).decode()
    async with asgi_server(tmp_path) as http:
        for url in (f"DATA:image/png;base64,{payload}", f" Data:image/png;base64,{payload}"):
            r = await http.post("/v1/videos", json={**OK, "image_reference": {"image_url": url}})
            assert r.status_code == 200, r.text
            assert (await poll_job(http, r.json()["id"]))["status"] == "completed"


async def test_bad_bodies_uploads_ids_keys_and_sizes(tmp_path):
    async with asgi_server(tmp_path, api_key="k", max_upload_bytes=4096) as http:
        auth = {"Authorization": "Bearer k"}
        r = await http.post("/v1/videos", data=OK, files={"input_reference": ("x.png", b"not an image", "image/png")},
                            headers=auth)  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["message"] == NOT_AN_IMAGE
        assert r.json()["error"]["param"] == "input_reference"
        r = await http.post(
            "/v1/videos", data=OK, files={"input_reference": ("x.png", b"", "image/png")}, headers=auth
        )
        assert r.status_code == 400 and r.json()["error"]["message"] == NOT_AN_IMAGE
        for field in (
            "prompt",
            "size",
            "extra_params",
        ):  # a file where text belongs: named, its headers not echoed
            r = await http.post("/v1/videos", data={k: v for k, v in OK.items() if k != field},
                                files={field: ("p.txt", b"hello", "text/plain")}, headers=auth)  # fmt: skip
            err = r.json()["error"]
            assert (r.status_code, err["param"], err["message"]) == (
                400,
                field,
                f"{field} must be a text field, not a file upload",
            ), r.text
        r = await http.post(
            "/v1/videos", data=OK, files={"notes": ("n.txt", b"hi", "text/plain")}, headers=auth
        )
        assert r.status_code == 200, (
            r.text
        )  # a file in a field the request has not: ignored, as unknown fields
        for body, ctype, fragment in (
            (b"[1, 2]", "application/json", "must be an object"),
            (b"{nope", "application/json", "Invalid JSON body"),
            (b"<xml/>", "text/xml", "Unsupported Content-Type"),
            (
                b"--x\r\ngarbage",
                "multipart/form-data",
                "Missing boundary in multipart.",
            ),  # (Starlette's words)
            (b"", "application/json", "Field required"),
            (json.dumps({"prompt": 5}).encode(), "application/json", "string_type"),
        ):
            r = await http.post("/v1/videos", content=body, headers={**auth, "Content-Type": ctype})
            assert r.status_code == 400 and fragment in r.json()["error"]["message"], (ctype, r.text)
        for method, path in (("GET", "/v1/videos/video_gen_" + "0" * 32), ("DELETE", "/v1/videos/nope"),
                             ("GET", "/v1/videos/nope/content")):  # fmt: skip
            r = await http.request(method, path, headers=auth)
            assert r.status_code == 404 and r.json()["error"]["message"] == "Video not found"
        r = await http.post("/v1/videos", data=OK, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        r = await http.post(
            "/v1/videos", data=OK, files={"input_reference": ("x.png", b"0" * 5000)}, headers=auth
        )
        assert r.status_code == 413 and r.json()["error"]["type"] in (
            "Request Entity Too Large",
            "Content Too Large",
        )


def _multipart(*parts: tuple[str, bytes], boundary: bytes = b"XyZ", close: bool = True) -> bytes:
    """A multipart/form-data body of (name, value) text parts, with or without its closing boundary."""
    body = b"".join(b"--%s\r\nContent-Disposition: form-data; name=\"%s\"\r\n\r\n%s\r\n"
                    % (boundary, name.encode(), value) for name, value in parts)  # fmt: skip
    return body + (b"--%s--\r\n" % boundary if close else b"")


async def test_cut_form_bodies_and_bad_form_text_are_400s(tmp_path):
    """The fuzzer's finds: a multipart body cut before its closing boundary ran a job with the defaults of the
    fields it lost (189 frames, 35 steps; a cut upload ran text-to-video), and form text that is not UTF-8
    became other characters; each is now a 400 (the field named where there is one)."""
    multipart = {"Content-Type": "multipart/form-data; boundary=XyZ"}
    urlencoded = {"Content-Type": "application/x-www-form-urlencoded"}
    fields = [(k, v.encode()) for k, v in OK.items()]
    accepted = []
    async with asgi_server(tmp_path) as http:
        cut = _multipart(*fields, close=False) + b'--XyZ\r\nContent-Disposition: form-data; name="num_fr'
        for body in (cut, _multipart(*fields, close=False)):
            r = await http.post("/v1/videos", content=body, headers=multipart)
            assert r.status_code == 400 and "closing boundary" in r.json()["error"]["message"], r.text
        upload = _multipart(*fields, close=False) + (
            b'--XyZ\r\nContent-Disposition: form-data; name="input_reference"; filename="a.png"\r\n'
            b"Content-Type: image/png\r\n\r\n" + png_bytes()[:40]
        )
        r = await http.post("/v1/videos", content=upload, headers=multipart)
        assert r.status_code == 400 and "closing boundary" in r.json()["error"]["message"], r.text
        r = await http.post("/v1/videos", content=_multipart(*fields) + b"an epilogue", headers=multipart)
        assert r.status_code == 200, r.text  # RFC 2046: text after the closing boundary is ignored
        accepted.append(r.json())
        text_ref = _multipart(*fields, ("input_reference", png_bytes()))  # curl -F 'input_reference=<a.png'
        r = await http.post("/v1/videos", content=text_ref, headers=multipart)
        assert r.status_code == 400 and "must be a file upload" in r.json()["error"]["message"], r.text
        bad = _multipart(*fields[1:], ("prompt", b"\xff\xfe fox"))
        r = await http.post("/v1/videos", content=bad, headers=multipart)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        bogus = {"Content-Type": "multipart/form-data; charset=bogus; boundary=XyZ"}  # (Starlette: latin-1)
        r = await http.post(
            "/v1/videos", content=_multipart(*fields[1:], ("prompt", "日本".encode())), headers=bogus
        )
        assert r.status_code == 400 and "unknown charset 'bogus'" in r.json()["error"]["message"], r.text
        sjis = {"Content-Type": "multipart/form-data; charset=shift_jis; boundary=XyZ"}
        r = await http.post("/v1/videos", content=_multipart(*fields[1:], ("prompt", "日本".encode("shift_jis"))),
                            headers=sjis)  # fmt: skip
        assert r.status_code == 200 and r.json()["prompt"] == "日本", r.text
        accepted.append(r.json())
        r = await http.post("/v1/videos", content=b"prompt=%ff%fe&size=64x48", headers=urlencoded)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        good = b"prompt=caf%C3%A9+au+lait&size=64x48&num_frames=5&num_inference_steps=1"
        r = await http.post("/v1/videos", content=good, headers=urlencoded)
        assert r.status_code == 200 and r.json()["prompt"] == "café au lait", r.text
        accepted.append(r.json())
        for job in accepted:
            assert (await poll_job(http, job["id"]))["status"] == "completed"


async def test_lone_surrogates_name_the_field_and_seeds_outputs_follow_vllm(tmp_path):
    """JSON may escape a lone UTF-16 surrogate, which no tokenizer or UTF-8 response carries: a 400 naming
    the field on every JSON route (it was a 500). int64 seeds (negative too) and num_outputs_per_prompt up
    to 10 are accepted as vLLM-Omni accepts them; a control upload without its type, a JSON boolean as a
    number are 400s; media errors name their field; an empty `after` cursor means none."""
    async with asgi_server(tmp_path) as http:
        raw = '{"prompt": "fox \\ud800", "size": "64x48", "num_frames": 5, "num_inference_steps": 1}'
        r = await http.post("/v1/videos", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        raw = '{"prompt": "fox", "model": "\\udfff"}'
        r = await http.post("/v1/videos/sync", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        raw = '{"prompt": "a cat \\ud800", "size": "64x48"}'
        r = await http.post(
            "/v1/images/generations", content=raw, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        raw = '{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800"}]}'
        r = await http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
        for fields in (
            {**OK, "seed": "-1"},
            {**OK, "seed": str(-(2**63))},
            {**OK, "num_outputs_per_prompt": "3"},
        ):
            r = await http.post("/v1/videos/sync", data=fields)
            assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", (fields, r.text)
        r = await http.post("/v1/videos", json={"prompt": "x", "num_frames": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "num_frames", r.text
        r = await http.post(
            "/v1/videos", json={**OK, "image_reference": {"image_url": "data:image/png;base64,AAAA"}}
        )
        assert r.json()["error"]["message"].startswith("Invalid image_reference: provided content"), r.text
        assert (await http.get("/v1/videos?after=")).status_code == 200
        # surrogates inside a JSON string field (extra_params as a form string), deep nesting, JSON nulls
        r = await http.post("/v1/videos", data={**OK, "extra_params": '{"negative_prompt": "x\\ud800"}'})
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_params.negative_prompt", r.text
        raw = '{"prompt": "x", "size": "64x64", "extra_params": "{\\"system_prompt\\": \\"\\\\udfff\\"}"}'
        r = await http.post(
            "/v1/images/generations", content=raw, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_params.system_prompt", r.text
        deep = '{"model": "m", "messages": ' + "[" * 5000 + "]" * 5000 + "}"
        r = await http.post(
            "/v1/chat/completions", content=deep, headers={"Content-Type": "application/json"}
        )
        # (Python 3.11's parser runs out of stack: "nested too deeply"; 3.12's parses it and the model refuses
        # the messages: a 400 either way)
        err = r.json()["error"]
        assert r.status_code == 400 and (
            "nested too deeply" in err["message"] or err["param"] == "messages"
        ), r.text
        nulls = {**OK, "enable_frame_interpolation": None, "frame_interpolation_exp": None, "lora": None}
        assert (await http.post("/v1/videos/sync", json=nulls)).status_code == 200
        r = await http.post("/v1/videos", json={**OK, "extra_params": {"max_sequence_length": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_params.max_sequence_length", (
            r.text
        )
        r = await http.post("/v1/images/generations", json={"prompt": "x", "n": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        r = await http.post("/v1/videos", data=OK, files={"control_reference": ("c.png", b"x", "image/png")})
        assert (
            r.status_code == 400
            and r.json()["error"]["message"] == "control_reference requires control_type."
        )
        r = await http.post(
            "/v1/videos",
            data={**OK, "control_type": "foo"},
            files={"control_reference": ("c.png", b"x", "image/png")},
        )
        assert r.status_code == 400 and "Supported control upload types: blur" in r.json()["error"]["message"]
        r = await http.post(  # vLLM-Omni's emptiness check comes before the transfer mode's
            "/v1/videos",
            data={**OK, "control_type": "edge"},
            files={"control_reference": ("c.png", b"", "image/png")},
        )
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "control_reference must not be empty.", "type": "Bad Request",
            "param": "control_reference", "code": 400,
        }  # fmt: skip
        for empty in ([], {}):  # a structured prompt with nothing in it is as empty as ""
            r = await http.post("/v1/videos", json={**OK, "prompt": empty})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        for bad, why in (("notjson", "Invalid JSON in form field."), ("[1]", "expected dict, got list")):
            r = await http.post("/v1/videos", data={**OK, "audio_reference": bad})  # (it was ignored)
            assert r.status_code == 400 and r.json()["error"]["param"] == "audio_reference", r.text
            assert why in r.json()["error"]["message"]
        for field in ("prompt", "negative_prompt"):  # one prompt a request: a list was one video of its text
            r = await http.post("/v1/videos", json={**OK, field: ["a fox", "a cat"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert "got a list: one prompt a request" in r.json()["error"]["message"]
        ok = {
            **OK,
            "true_cfg_scale": 4.0,
            "guidance_scale_2": 3,
            "boundary_ratio": 0.9,
            "return_stage_metrics": True,
            # a JSON body's null is the field left out (a form's text "null" is a 400: CASES)
            "extra_params": None,
            "video_params": None,
            "audio_reference": None,
        }
        assert (await http.post("/v1/videos/sync", json=ok)).status_code == 200  # accepted, unused by Cosmos3
        jpeg = io.BytesIO()
        Image.effect_noise((64, 48), 60).convert("RGB").save(jpeg, "JPEG")
        cut = jpeg.getvalue()[:-40]  # Pillow refuses it; FFmpeg would read it as a one-frame clip (V2V)
        r = await http.post("/v1/videos", data=OK, files={"input_reference": ("a.jpg", cut, "image/jpeg")})
        assert r.status_code == 400 and r.json()["error"]["message"] == NOT_AN_IMAGE, r.text


async def test_openapi_documents_400s_not_422s(tmp_path):
    """Validation answers 400 (never FastAPI's 422): /openapi.json says so too (it listed a 422 for every
    route with path or query parameters), with no dangling reference to the schemas it dropped."""
    async with asgi_server(tmp_path) as http:
        spec = (await http.get("/openapi.json")).json()
    text = json.dumps(spec)
    assert '"422"' not in text and "ValidationError" not in text
    assert "400" in spec["paths"]["/v1/videos"]["get"]["responses"]
    assert all("400" in ops["post"]["responses"] for ops in spec["paths"].values() if "post" in ops)


# -- hypothesis over /openapi.json -------------------------------------------------------------------------
GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=30),
    st.sampled_from(["", "nan", "inf", "-1", "0", "1e400", "9" * 30, "video_gen_" + "a" * 32, "../..", "x" * 300]),
)  # fmt: skip


def from_schema(schema: dict) -> st.SearchStrategy:
    """A value that usually fits `schema`, sometimes not."""
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "string":
        if schema.get("format") == "binary":
            return st.binary(max_size=64)
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: len(s) < 12)
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        return st.text(max_size=40)
    if kind == "integer":
        return st.integers(
            min_value=schema.get("minimum", -(2**70)), max_value=min(schema.get("maximum", 2**70), 400)
        )
    if kind == "number":
        return st.floats(min_value=schema.get("minimum"), max_value=schema.get("maximum"), allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "object":
        return st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=3)
    return GARBAGE


def maybe_garbage(schema: dict) -> st.SearchStrategy:
    return st.one_of(from_schema(schema), from_schema(schema), GARBAGE)


def as_form_value(value) -> str | bytes:
    if isinstance(value, bytes | str):
        return value
    return json.dumps(value) if isinstance(value, dict | list | bool) or value is None else str(value)


@st.composite
def api_calls(draw, spec: dict) -> dict:
    operations = [(path, method, op) for path, item in spec["paths"].items() for method, op in item.items()]
    path, method, op = draw(st.sampled_from(operations))
    params: dict = {}
    for param in op.get("parameters", []):
        if param["in"] == "path":
            value = draw(
                st.one_of(
                    st.from_regex(r"video_gen_[0-9a-f]{32}", fullmatch=True),
                    st.text(
                        alphabet=st.characters(min_codepoint=48, max_codepoint=122), min_size=1, max_size=20
                    ),
                )
            )
            path = path.replace("{" + param["name"] + "}", value)
        elif draw(st.booleans()):
            params[param["name"]] = as_form_value(draw(maybe_garbage(param.get("schema", {}))))
    call: dict = {"method": method.upper(), "url": path, "params": params}
    content = op.get("requestBody", {}).get("content", {})
    if content:
        ctype = draw(st.sampled_from(sorted(content)))
        props = content[ctype]["schema"]["properties"]
        chosen = draw(st.lists(st.sampled_from(sorted(props)), unique=True, max_size=len(props)))
        if "prompt" in props and "prompt" not in chosen and draw(st.integers(0, 4)):
            chosen.append("prompt")
        fields = {name: draw(maybe_garbage(props[name])) for name in chosen}
        if ctype == "application/json":
            call["content"] = json.dumps(
                {k: v.hex() if isinstance(v, bytes) else v for k, v in fields.items()}
            )
            call["headers"] = {"Content-Type": ctype}
        elif ctype == "multipart/form-data":
            call["files"] = {
                k: (("f.bin", v) if isinstance(v, bytes) else (None, as_form_value(v)))
                for k, v in fields.items()
            }
            call["files"].setdefault("_", (None, ""))  # always multipart, even with no fields
        else:
            call["data"] = {k: as_form_value(v) for k, v in fields.items() if not isinstance(v, bytes)}
    return call


def test_fuzz_openapi_operations_never_5xx(tmp_path):
    with uvicorn_thread(tmp_path, sync_timeout_s=5.0, max_batch_size=4) as (url, _):
        spec = httpx.get(f"{url}/openapi.json").json()
        assert {
            "/v1/videos",
            "/v1/videos/sync",
            "/v1/videos/{video_id}",
            "/v1/videos/{video_id}/content",
        } <= set(spec["paths"])
        with httpx.Client(base_url=url, timeout=30) as http:

            @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(api_calls(spec))
            def check(call):
                r = http.request(**call)
                # a valid sync request that waited past --sync-timeout behind the fuzz's own jobs (a loaded
                # host) is the documented 504, not a failure of input handling
                timed_out = call["url"] == "/v1/videos/sync" and r.status_code == 504
                assert r.status_code < 500 or (timed_out and "timed out after" in r.text), (
                    call, r.status_code, r.text[:500],
                )  # fmt: skip
                if r.status_code >= 400 and r.status_code != 401:
                    err = r.json()["error"]
                    assert err["code"] == r.status_code and isinstance(err["message"], str) and err["type"]

            check()


async def test_unknown_paths_and_401s_stay_out_of_vllms_names(tmp_path):
    """A path that only starts like one of vLLM's routes is an unknown route (the reason phrase, not vLLM's
    NotFoundError); a 401 answered before routing is not counted in http_* (vLLM's middleware order)."""
    async with asgi_server(tmp_path, api_key="k") as http:
        auth = {"Authorization": "Bearer k"}
        for path in ("/v1/completionsX", "/tokenize/extra", "/v1/chat/completions/more"):
            r = await http.post(path, json={}, headers=auth)
            assert r.status_code == 404 and r.json()["error"]["type"] == "Not Found", (path, r.text)
        r = await http.post("/v1/chat/completions", json={"messages": []}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request"  # (request validation)
        assert (await http.get("/v1/videos/nope")).status_code == 401
        metrics = (await http.get("/metrics", headers=auth)).text
        counted = [line for line in metrics.splitlines() if line.startswith("http_requests_total")]
        assert counted and not any('method="GET"' in line for line in counted), counted  # the 401 GET


HI = [{"role": "user", "content": "hi"}]
# (body, error type, param): the fields the chat and completion requests share, sent to both routes
SHARED_REFUSALS = [
    ({"temperature": "x"}, "Bad Request", "temperature"),
    ({"stream_options": {"include_usage": True}}, "Bad Request", "stream_options"),
    ({"stream": True, "prompt_logprobs": 1}, "Bad Request", "prompt_logprobs"),
    ({"n": 17}, "BadRequestError", "n"),
    ({"model": "nope"}, "NotFoundError", "model"),
]
TYPED_REFUSALS = [
    *[("/v1/chat/completions", {"messages": HI, **body}, kind, param) for body, kind, param in SHARED_REFUSALS],
    *[("/v1/completions", {"prompt": "hi", **body}, kind, param) for body, kind, param in SHARED_REFUSALS],
    ("/v1/chat/completions", {"messages": []}, "Bad Request", "messages"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, "Bad Request", "top_logprobs"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, "Bad Request", "tool_choice"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "sometimes"}, "Bad Request", "tool_choice"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}}, "Bad Request", "tool_choice"),
    ("/v1/chat/completions", {"messages": HI, "continue_final_message": True}, "Bad Request",
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "min_tokens": 5}, "BadRequestError", "min_tokens"),
    ("/v1/chat/completions", "not json", "Bad Request", None),
    ("/v1/completions", "not json", "Bad Request", None),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "kind", "param"), TYPED_REFUSALS)
async def test_vllm_routes_type_request_validation_as_bad_request(tmp_path, route, body, kind, param):
    """On vLLM's routes a request its validation refuses (pydantic's types and ranges, its request model's
    validators, a body that is not JSON) is typed with the reason phrase "Bad Request", as vLLM's
    RequestValidationError handler types it (serving-api.md §3.2); what its serving code refuses later (the
    sampling parameters' checks, an unknown model) keeps vLLM's typed names."""
    async with asgi_server(tmp_path) as http:
        if isinstance(body, str):
            r = await http.post(route, content=body, headers={"Content-Type": "application/json"})
        else:
            r = await http.post(route, json=body)
    err = r.json()["error"]
    assert r.status_code == (404 if kind == "NotFoundError" else 400), r.text
    assert (err["type"], err["param"]) == (kind, param), r.text


async def test_the_api_key_guards_tokenize_and_detokenize_too(tmp_path):
    """Beyond vLLM (which guards /v1 only): /tokenize runs a chat's media pipeline (downloads, local files,
    decodes), so with --api-key it needs the key as /v1 does; the probes and /metrics stay open."""
    async with asgi_server(tmp_path, api_key="k") as http:
        body = {"model": "test-model", "prompt": "hi"}
        for path in ("/tokenize", "/detokenize", "/invocations"):  # (vLLM leaves /invocations open too)
            r = await http.post(path, json=body)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (path, r.text)
            r = await http.post(path, json=body, headers={"Authorization": "Bearer k"})
            assert r.status_code != 401, (path, r.text)
        for path in ("/health", "/metrics", "/version", "/ping"):
            assert (await http.get(path)).status_code == 200, path


async def test_a_large_json_body_is_parsed_off_the_event_loop(tmp_path, monkeypatch):
    """JSON bodies past INLINE_JSON_BYTES are parsed on a thread (a 100 MB one held every request for seconds);
    small ones on the loop; a bad large one is the same 400."""
    import threading

    from worldserve.api import bodies

    threads: list[bool] = []
    parse = bodies.parse_json

    def recording(body, *a):
        threads.append(threading.current_thread() is threading.main_thread())
        return parse(body, *a)

    monkeypatch.setattr(bodies, "parse_json", recording)
    big = json.dumps({"prompt": "x" * (bodies.INLINE_JSON_BYTES + 10), "size": "64x48", "n": 11})
    async with asgi_server(tmp_path) as http:
        for route in ("/v1/images/generations", "/v1/videos"):
            r = await http.post(route, content=big, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text  # (n above 10 / too long a prompt: parsed, then refused)
            r = await http.post(route, content=big[:-1], headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["message"].startswith("Invalid JSON body"), (
                r.text
            )
        r = await http.post("/v1/images/generations", json={"prompt": "x", "n": 11})
        assert r.status_code == 400
    assert threads == [False, False, False, False, True], threads


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_json_bodies_refuse_the_non_json_constants_naming_their_field(constant):
    """Python's json takes NaN / Infinity, JSON does not: in a Responses tool schema one made the answer
    unserialisable (a 500 on the request, and on every GET of it once stored); every JSON body refuses them
    with a 400 naming the field they are in."""
    from worldserve.api.bodies import parse_json
    from worldserve.api.errors import APIError

    with pytest.raises(APIError) as err:
        parse_json(f'{{"input": "x", "tools": [{{"parameters": {{"maximum": {constant}}}}}]}}')
    assert err.value.status == 400 and f"{constant} is not a JSON number" in err.value.message
    assert err.value.param == "tools[0].parameters.maximum"
    with pytest.raises(APIError) as err:
        parse_json(constant)
    assert err.value.param is None


async def test_a_refused_fps_is_quoted_as_it_came(tmp_path):
    """fps=120.0000001 had read "fps=120 must be a number in [1, 120]": a value rounded into the range."""
    async with asgi_server(tmp_path) as http:
        r = await http.post("/v1/videos", json={"prompt": "x", "fps": 120.0000001})
    assert r.status_code == 400 and "fps=120.0000001 must" in r.json()["error"]["message"], r.text


async def test_a_field_sent_twice_in_a_form_is_a_400_naming_it(tmp_path):
    """Two `input_reference` parts (or two prompts): which one was meant? FastAPI would take the last and drop
    the other unsaid (a 200 that had made a video from one of the two); a 400 naming the field. The repeatable
    `input_references` and fields the request does not have stay as they were."""
    png = png_bytes(64, 48)
    async with asgi_server(tmp_path) as http:
        two = [
            ("input_reference", ("a.png", png, "image/png")),
            ("input_reference", ("b.png", png, "image/png")),
        ]
        r = await http.post("/v1/videos", data=OK, files=two)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text
        assert "input_reference was sent 2 times" in r.json()["error"]["message"]
        r = await http.post("/v1/videos/sync", content=b"prompt=a&prompt=b&size=64x48",
                            headers={"Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = await http.post("/v1/videos", content=b"prompt=a&note=1&note=2&size=64x48",
                            headers={"Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
        assert r.status_code == 200, r.text

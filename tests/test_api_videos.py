"""The video API over httpx.ASGITransport on the FakeBackend (stub encoder): shapes, defaults, body types, job
lifecycle, list/delete/content semantics, image and video references (the sync route, auth, limits, metrics
and shutdown: test_api_video_server.py)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import re

import pytest
from serving_helpers import JOB_FIELDS, SMALL_FORM, asgi_server, mp4_bytes, png_bytes, poll_job, stub_meta

from worldserve.engine.fake_backend import FakeBackend

pytestmark = pytest.mark.anyio


async def test_create_multipart_then_poll_then_download(tmp_path):
    async with asgi_server(tmp_path) as http:
        r = await http.post("/v1/videos", files={"prompt": (None, '{"subjects": [{"a": 1}]}'), **{
            k: (None, v) for k, v in SMALL_FORM.items()}})  # fmt: skip
        assert r.status_code == 200, r.text
        job = r.json()
        assert set(job) == JOB_FIELDS
        assert re.fullmatch(r"video_gen_[0-9a-f]{32}", job["id"])
        assert (job["object"], job["status"], job["progress"], job["model"]) == (
            "video",
            "queued",
            0,
            "test-model",
        )
        assert (job["size"], job["num_frames"], job["fps"], job["media_type"]) == (
            "64x48",
            5,
            8.0,
            "video/mp4",
        )
        done = await poll_job(http, job["id"])
        assert done["status"] == "completed" and done["progress"] == 100
        assert done["file_name"] == f"{job['id']}.mp4" and done["completed_at"] >= done["created_at"]
        assert {"prepare", "diffuse", "decode", "encode"} <= set(done["stage_durations"])
        content = await http.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        assert content.headers["content-disposition"] == f'attachment; filename="{job["id"]}.mp4"'
        assert stub_meta(content.content)["frames"] == [5, 48, 64, 3]
        head = await http.head(f"/v1/videos/{job['id']}/content")
        assert head.status_code == 200 and head.content == b"" and head.headers["content-type"] == "video/mp4"
        assert int(head.headers["content-length"]) == len(content.content)
        part = await http.get(f"/v1/videos/{job['id']}/content", headers={"Range": "bytes=0-6"})
        assert part.status_code == 206 and part.content == b"FAKEMP4"
        size = len(content.content)  # a Range Starlette refuses: the error envelope, not its plain text
        for header, status in (
            ("bytes=abc", 400),
            ("bytes=10-5", 400),
            (f"bytes={size}-", 416),
            (f"bytes=-0,{size + 5}-", 416),
        ):
            bad = await http.get(f"/v1/videos/{job['id']}/content", headers={"Range": header})
            assert bad.status_code == status and bad.json()["error"]["param"] == "Range", (header, bad.text)
        assert bad.headers["content-range"] == f"bytes */{size}"
        # RFC 9110 §14.2: a unit other than bytes is ignored (the whole file); ranges past the end are dropped
        # when another range can be served (a 416 only when none can)
        lines = await http.get(f"/v1/videos/{job['id']}/content", headers={"Range": "lines=1-2"})
        assert lines.status_code == 200 and lines.content == content.content
        some = await http.get(f"/v1/videos/{job['id']}/content", headers={"Range": f"bytes=0-3,{size + 5}-"})
        assert some.status_code == 206 and some.content == b"FAKE", some.headers
        stale = (
            await http.get(  # a stale If-Range: the Range is ignored and the whole file served, as HTTP says
                f"/v1/videos/{job['id']}/content", headers={"Range": f"bytes={size}-", "If-Range": '"stale"'}
            )
        )
        assert stale.status_code == 200 and stale.content == content.content
        for header, status in (("bytes=10-5", 400), (f"bytes={size}-", 416)):  # a matching If-Range: checked
            bad = await http.get(f"/v1/videos/{job['id']}/content",
                                 headers={"Range": header, "If-Range": content.headers["etag"]})  # fmt: skip
            assert bad.status_code == status and bad.json()["error"]["param"] == "Range", (header, bad.text)
        # a revalidation (a browser's, a CDN's): 304 without the body while the copy is current
        url, etag, modified = (
            f"/v1/videos/{job['id']}/content",
            content.headers["etag"],
            content.headers["last-modified"],
        )
        for asked in ({"If-None-Match": etag}, {"If-None-Match": f'"x", W/{etag}'}, {"If-None-Match": "*"},
                      {"If-Modified-Since": modified}):  # fmt: skip
            kept = await http.get(url, headers=asked)
            assert kept.status_code == 304 and kept.content == b"" and kept.headers["etag"] == etag, asked
        for asked in ({"If-None-Match": '"other"', "If-Modified-Since": modified},  # (If-None-Match wins)
                      {"If-Modified-Since": "Thu, 01 Jan 1970 00:00:00 GMT"}, {"If-Modified-Since": "garbage"}):  # fmt: skip
            fresh = await http.get(url, headers=asked)
            assert fresh.status_code == 200 and fresh.content == content.content, asked
        same = await http.get(f"/v1/videos/{job['id']}/content", params={"variant": "video"})
        assert same.content == content.content
        thumb = await http.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
        assert thumb.status_code == 400 and thumb.json()["error"]["param"] == "variant", "not the MP4 instead"
        unknown = await http.get(
            "/v1/videos/video_gen_" + "0" * 32 + "/content", params={"variant": "thumbnail"}
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "video_id"  # the id first


async def test_omitted_fields_take_model_defaults(tmp_path):
    async with asgi_server(tmp_path) as http:
        job = (await http.post("/v1/videos", data={"prompt": "a cat"})).json()
        assert (job["size"], job["num_frames"], job["fps"], job["seconds"]) == ("1280x720", 189, 24.0, "8")
        done = await poll_job(http, job["id"])
        meta = stub_meta((await http.get(f"/v1/videos/{job['id']}/content")).content)
        assert meta["frames"] == [189, 720, 1280, 3] and meta["crf"] == 18 and meta["audio"] == [2, 378000]
        assert done["status"] == "completed"


async def test_json_body_same_names_and_structured_prompt(tmp_path):
    async with asgi_server(tmp_path) as http:
        body = {"prompt": {"subjects": ["a dog"]}, "size": "64x48", "num_frames": 9, "fps": 8, "seed": 3,
                "num_inference_steps": 1, "generate_sound": False, "quality": "lossless",
                "extra_params": {"video_codec_options": {"preset": "fast"}}}  # fmt: skip
        r = await http.post("/v1/videos", json=body)
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["prompt"] == '{"subjects":["a dog"]}' and job["quality"] == "lossless"
        await poll_job(http, job["id"])
        meta = stub_meta((await http.get(f"/v1/videos/{job['id']}/content")).content)
        assert meta["audio"] is None and meta["crf"] == 0 and meta["codec_options"] == {"preset": "fast"}
        assert meta["frames"] == [9, 48, 64, 3]
        body["extra_params"] = {"video_codec_options": {"profile": "main"}}  # x264: no lossless in main
        r = await http.post("/v1/videos", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_params.video_codec_options", (
            r.text
        )


async def test_seconds_width_height_and_extra_params(tmp_path):
    async with asgi_server(tmp_path) as http:
        r = await http.post("/v1/videos", data={"prompt": "x", "width": "32", "height": "32", "seconds": "2",
                                                "fps": "10", "extra_params": '{"generate_sound": false}'})  # fmt: skip
        job = r.json()
        assert (job["num_frames"], job["size"], job["seconds"]) == (21, "32x32", "2")
        r = await http.post("/v1/videos", data={"prompt": "x", "size": "32x32", "seconds": "3", "fps": "8",
                                                "num_frames": "17"})  # fmt: skip
        # num_frames wins over seconds: the echo is the video's length (17 frames at 8 fps), not the 3 asked
        assert (r.json()["num_frames"], r.json()["seconds"]) == (17, "2"), r.text
        r = await http.post("/v1/videos", data={"prompt": "x", "extra_params": "[1]"})
        assert (
            r.status_code == 400
            and r.json()["error"]["message"] == "Invalid JSON in form field: expected dict, got list."
        )
        r = await http.post("/v1/videos", data={"prompt": "x", "extra_params": "{nope"})
        assert r.json()["error"] == {"message": "Invalid JSON in form field.", "type": "Bad Request",
                                     "param": "extra_params", "code": 400}  # fmt: skip
        r = await http.post("/v1/videos", data={"prompt": "x", "extra_params": '{"flow_shift": -1}'})
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_params.flow_shift"


async def test_model_name_check(tmp_path):
    async with asgi_server(tmp_path) as http:
        r = await http.post("/v1/videos", data={"prompt": "x", "model": "other", **SMALL_FORM})
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "Model mismatch: request specifies 'other' but server is running 'test-model'.",
            "type": "Bad Request", "param": "model", "code": 400,
        }  # fmt: skip
        assert (
            await http.post("/v1/videos", data={"prompt": "x", "model": "test-model", **SMALL_FORM})
        ).status_code == 200


async def test_failed_job_get_uses_failure_code_and_content_422(tmp_path):
    async with asgi_server(tmp_path) as http:
        job = (await http.post("/v1/videos", data={"prompt": "__fail__:denoise", **SMALL_FORM})).json()
        body = await poll_job(http, job["id"])
        r = await http.get(f"/v1/videos/{job['id']}")
        assert r.status_code == 500 and body["status"] == "failed"
        assert body["error"]["code"] == 500 and "injected failure" in body["error"]["message"]
        c = await http.get(f"/v1/videos/{job['id']}/content")
        assert c.status_code == 422
        assert c.json()["error"]["message"] == "Video generation failed. Check job status for error details."
        s = await http.post("/v1/videos/sync", data={"prompt": "__fail__:decode", **SMALL_FORM})
        assert s.status_code == 500 and s.json()["error"]["message"].startswith("Video generation failed:")
        assert (await http.delete(f"/v1/videos/{job['id']}")).status_code == 200


async def test_in_progress_content_delete_and_unknown_ids(tmp_path):
    async with asgi_server(tmp_path, backend=FakeBackend(step_delay=0.02)) as http:
        job = (
            await http.post("/v1/videos", data={"prompt": "x", **SMALL_FORM, "num_inference_steps": "200"})
        ).json()
        r = await http.get(f"/v1/videos/{job['id']}/content")
        assert r.status_code == 404 and r.json()["error"]["message"] == "Generation is still in-progress"
        assert (await http.get(f"/v1/videos/{job['id']}")).headers["openai-poll-after-ms"] == "500"
        d = await http.delete(f"/v1/videos/{job['id']}")
        assert d.status_code == 200 and d.json() == {
            "id": job["id"],
            "deleted": True,
            "object": "video.deleted",
        }
        for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/content")):
            r = await http.request(method, f"/v1/videos/{job['id']}{path}")
            assert r.status_code == 404 and r.json()["error"]["message"] == "Video not found"
        r = await http.get("/v1/videos/..%2F..%2Fetc%2Fpasswd/content")
        assert r.status_code == 404


async def test_list_pagination_and_bad_query(tmp_path):
    async with asgi_server(tmp_path) as http:
        ids = [
            (await http.post("/v1/videos", data={"prompt": f"p{i}", **SMALL_FORM})).json()["id"]
            for i in range(5)
        ]
        page = (await http.get("/v1/videos", params={"limit": 2, "order": "asc"})).json()
        assert [j["id"] for j in page["data"]] == ids[:2] and page["has_more"] and page["object"] == "list"
        assert (page["first_id"], page["last_id"]) == (ids[0], ids[1])
        page = (await http.get("/v1/videos", params={"limit": 10, "order": "asc", "after": ids[1]})).json()
        assert [j["id"] for j in page["data"]] == ids[2:] and not page["has_more"]
        newest = (await http.get("/v1/videos")).json()
        assert [j["id"] for j in newest["data"]] == ids[::-1]
        assert (await http.get("/v1/videos", params={"after": "video_gen_nope"})).json()["data"] == []
        for bad in ({"limit": 101}, {"limit": -1}, {"order": "up"}, {"limit": "x"}):
            r = await http.get("/v1/videos", params=bad)
            assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request", bad
            assert r.json()["error"]["param"] in ("limit", "order")


async def test_image_to_video_upload_and_data_url(tmp_path):
    png = png_bytes()
    async with asgi_server(tmp_path) as http:
        r = await http.post("/v1/videos", data={"prompt": "x", **SMALL_FORM},
                            files={"input_reference": ("ref.png", png, "image/png")})  # fmt: skip
        assert r.status_code == 200, r.text
        assert (await poll_job(http, r.json()["id"]))["status"] == "completed"
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        r = await http.post(
            "/v1/videos", json={"prompt": "x", **SMALL_FORM, "image_reference": {"image_url": url}}
        )
        assert r.status_code == 200, r.text
        r = await http.post("/v1/videos", data={"prompt": "x", "image_reference": json.dumps({"image_url": url})},
                            files={"input_reference": ("ref.png", png, "image/png")})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "Provide only one of input_reference"
        )
        r = await http.post("/v1/videos", data={"prompt": "x", "image_reference": '{"file_id": "f"}'})
        assert r.json()["error"]["message"] == "Invalid image_reference: file_id is not supported yet."


class RecordingBackend(FakeBackend):
    def __init__(self):
        super().__init__()
        self.params = []

    def prepare(self, request_id, params):
        self.params.append(params)
        return super().prepare(request_id, params)


async def test_video_to_video_upload_extra_params_and_data_url(tmp_path):
    clip = mp4_bytes(frames=12)
    backend = RecordingBackend()
    async with asgi_server(tmp_path, backend=backend) as http:
        small = {**SMALL_FORM, "num_frames": "9"}
        r = await http.post("/v1/videos", data={"prompt": "x", **small},
                            files={"input_reference": ("ref.mp4", clip, "video/mp4")})  # fmt: skip
        assert r.status_code == 200, r.text
        assert (await poll_job(http, r.json()["id"]))["status"] == "completed"
        extra = {"condition_frame_indexes_vision": [0, 2], "condition_video_keep": "last"}
        r = await http.post("/v1/videos", data={"prompt": "x", **small, "extra_params": json.dumps(extra)},
                            files={"input_reference": ("ref.mp4", clip, "video/mp4")})  # fmt: skip
        assert r.status_code == 200, r.text
        assert (await poll_job(http, r.json()["id"]))["status"] == "completed"
        url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
        r = await http.post(
            "/v1/videos", json={"prompt": "x", **small, "video_reference": {"video_url": url}}
        )
        assert r.status_code == 200, r.text
        assert (await poll_job(http, r.json()["id"]))["status"] == "completed"
        r = await http.post("/v1/videos", data={"prompt": "x", **small, "num_frames": "1"},
                            files={"input_reference": ("ref.mp4", clip, "video/mp4")})  # fmt: skip
        err = r.json()["error"]  # (the upload's own kind: it had been checked as an image first)
        assert (r.status_code, err["param"], err["message"]) == (
            400,
            "input_reference",
            "video-to-video needs num_frames > 1",
        ), r.text
        r = await http.post("/v1/videos", data={"prompt": "x", **small},
                            files={"input_reference": ("ref.mp4", clip[:64], "video/mp4")})  # fmt: skip
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "input_reference"
        assert err["message"] == "Invalid input_reference: provided content is not a valid image or video."
        # FFmpeg demuxes an SVG but has no decoder for it (no codec context): a 400 too, upload or data URL
        svg = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>'
        r = await http.post("/v1/videos", data={"prompt": "x", **small},
                            files={"input_reference": ("a.svg", svg, "image/svg+xml")})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text
        url = "data:video/mp4;base64," + base64.b64encode(svg).decode()
        r = await http.post(
            "/v1/videos", json={"prompt": "x", **small, "video_reference": {"video_url": url}}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "video_reference", r.text
    first, last, json_ref = backend.params
    assert first.image is None and first.video.shape == (5, 16, 32, 3)
    assert first.condition_frame_indexes == (0, 1) and first.condition_video_keep == "first"
    assert last.video.shape == (9, 16, 32, 3) and last.condition_frame_indexes == (0, 2)
    assert last.condition_video_keep == "last" and last.video[-1].mean() > first.video[-1].mean()
    assert json_ref.video.shape == (5, 16, 32, 3)


def test_video_reference_survives_a_restart_record():
    import numpy as np

    from worldserve.engine.client import EncodeOptions
    from worldserve.engine.job_files import inputs_from_record, inputs_record
    from worldserve.media.video_input import decode_video
    from worldserve.params import VideoParams

    clip = mp4_bytes(frames=12)
    params = VideoParams(prompt="x", num_frames=9, width=64, height=48, video=decode_video(clip, 9, "last"),
                         condition_frame_indexes=(0, 2), condition_video_keep="last",
                         guidance_interval=(400.0, 1000.0), add_duration_template=False,
                         system_prompt="You render documentaries.", negative_metadata="none")  # fmt: skip
    record = json.loads(json.dumps(inputs_record(params, EncodeOptions(crf=18))))
    again, _ = inputs_from_record(record, clip)
    assert again.condition_frame_indexes == (0, 2) and again.condition_video_keep == "last"
    assert again.guidance_interval == (400.0, 1000.0) and not again.add_duration_template
    assert again.system_prompt == "You render documentaries." and again.negative_metadata == "none"
    np.testing.assert_array_equal(again.video, params.video)


def test_a_record_written_before_videoparams_named_its_fields_restores_its_request_fields():
    """Older records named the reference `input_reference` (its request field as the value) and the condition
    fields not at all: a check failing as the job is restored names what its client sent, as at submit."""
    from worldserve.engine.client import EncodeOptions
    from worldserve.engine.job_files import inputs_from_record, inputs_record
    from worldserve.media.image import decode_image
    from worldserve.params import ParamError, VideoParams

    params = VideoParams(prompt="x", num_frames=9, width=64, height=48, image=decode_image(png_bytes()))
    record = json.loads(json.dumps(inputs_record(params, EncodeOptions())))
    record["params"]["field_names"] = [
        ["input_reference", "image_reference"]
    ]  # (as an older server wrote it)
    again, _ = inputs_from_record(record, png_bytes())
    for change, param in (({"num_frames": 1}, "image_reference"),
                          ({"condition_video_keep": "middle"}, "extra_params.condition_video_keep")):  # fmt: skip
        with pytest.raises(ParamError) as error:
            dataclasses.replace(again, **change).validate_as(dict(again.field_names))
        assert error.value.param == param


def test_a_reference_is_read_again_as_it_was_at_submit():
    """A restart reads a job's reference as its submit did: a video_reference whose bytes are an image (a PNG,
    or a truncated JPEG Pillow refuses) stays a one-frame clip (it became I2V, or failed to restore), an image
    stays an image; a record from before the kind was kept is sniffed, image first."""
    import io

    import numpy as np
    from PIL import Image

    from worldserve.engine.client import EncodeOptions
    from worldserve.engine.job_files import inputs_from_record, inputs_record
    from worldserve.media.image import decode_image
    from worldserve.media.video_input import decode_video
    from worldserve.params import VideoParams

    jpeg = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), np.uint8)).save(jpeg, "JPEG")
    base = {"prompt": "x", "num_frames": 9, "width": 64, "height": 48}
    for data in (png_bytes(), jpeg.getvalue()[:-40]):
        params = VideoParams(**base, video=decode_video(data, 5))
        again, _ = inputs_from_record(json.loads(json.dumps(inputs_record(params, EncodeOptions()))), data)
        assert again.image is None and again.video.shape == params.video.shape
    params = VideoParams(**base, image=decode_image(png_bytes()))
    record = json.loads(json.dumps(inputs_record(params, EncodeOptions())))
    again, _ = inputs_from_record(record, png_bytes())
    assert again.video is None and again.image.shape == params.image.shape
    del record["reference"]  # (an older record)
    assert inputs_from_record(record, png_bytes())[0].image is not None


async def test_prompt_template_extra_params_reach_the_request():
    """vLLM-Omni's extra_params prompt switches: use_duration_template / use_resolution_template /
    use_system_prompt / system_prompt become the request's VideoParams (formatting: test_prompt.py)."""
    from worldserve.api.errors import APIError
    from worldserve.api.video_inputs import build_inputs
    from worldserve.params import ParamError

    extra = {"use_duration_template": False, "use_resolution_template": False, "use_system_prompt": True,
             "system_prompt": "You render documentaries.", "guidance_interval": [400, 1000],
             "negative_metadata_mode": "inverse"}  # fmt: skip
    inputs = await build_inputs(
        {"prompt": "x", "extra_params": json.dumps(extra)}, served_model="m", has_sound=True
    )
    p = inputs.params
    assert (p.add_duration_template, p.add_resolution_template) == (False, False)
    assert p.use_system_prompt and p.system_prompt == "You render documentaries."
    assert p.guidance_interval == (400.0, 1000.0) and p.negative_metadata == "inverse"
    for bad in ("[1000, 400]", "[0, 2000]", "[1, 2, 3]", '"soon"'):
        with pytest.raises((APIError, ParamError)) as err:
            await build_inputs({"prompt": "x", "extra_params": f'{{"guidance_interval": {bad}}}'}, served_model="m",
                               has_sound=True)  # fmt: skip
        assert "guidance_interval" in str(getattr(err.value, "param", "")) + str(err.value)
    defaults = (await build_inputs({"prompt": "x"}, served_model="m", has_sound=True)).params
    assert (
        defaults.add_duration_template and defaults.add_resolution_template and not defaults.use_system_prompt
    ) and defaults.negative_metadata == "same"
    with pytest.raises(APIError) as bad:
        await build_inputs({"prompt": "x", "extra_params": '{"use_system_prompt": "maybe"}'}, served_model="m",
                           has_sound=True)  # fmt: skip
    assert bad.value.status == 400 and "use_system_prompt" in (bad.value.param or "") + bad.value.message


@pytest.mark.parametrize("range_header", [None, "bytes=2-5"])
async def test_a_download_survives_the_file_being_deleted_after_it_was_opened(tmp_path, range_header):
    """GET content opens the MP4 in the handler: a DELETE (or TTL sweep) unlinking it before the bytes go out
    cannot turn the answer into a 500 or a cut connection; the descriptor is closed afterwards."""
    import os

    from worldserve.api.videos import OpenFileResponse

    path = tmp_path / "v.mp4"
    path.write_bytes(b"0123456789")
    fd = os.open(path, os.O_RDONLY)
    response = OpenFileResponse(fd, media_type="video/mp4", filename="v.mp4", range_header=range_header)
    path.unlink()
    headers = [(b"range", range_header.encode())] if range_header else []
    scope = {"type": "http", "method": "GET", "path": "/", "headers": headers, "query_string": b""}
    sent: list[dict] = []

    requests = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():  # the request once, then nothing until the response is done (no disconnect)
        if requests:
            return requests.pop()
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message)

    await response(scope, receive, send)
    status = sent[0]["status"]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert (status, body) == ((206, b"2345") if range_header else (200, b"0123456789"))
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


async def test_a_locked_job_database_holds_its_requests_not_the_other_routes(tmp_path):
    """The store's writes run off the event loop: while another process holds the database's write lock,
    a create and a delete wait (and then succeed), and /health and job reads answer at once meanwhile (while
    the create and the delete still wait for the lock)."""
    import sqlite3

    async with asgi_server(tmp_path) as http:
        form = {"prompt": "a cat", **SMALL_FORM}
        done = (await http.post("/v1/videos", data=form)).json()
        await poll_job(http, done["id"])
        lock = sqlite3.connect(str(tmp_path / "jobs.sqlite3"), isolation_level=None, check_same_thread=False)
        lock.execute("BEGIN IMMEDIATE")  # another process's write lock on the database
        try:
            create = asyncio.ensure_future(http.post("/v1/videos", data=form))
            delete = asyncio.ensure_future(http.delete(f"/v1/videos/{done['id']}"))
            await asyncio.sleep(0.3)
            assert (await http.get("/health")).status_code == 200
            assert (await http.get(f"/v1/videos/{done['id']}")).status_code == 200
            assert not create.done() and not delete.done()  # answered while those still wait for the lock
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        created, deleted = await create, await delete
        assert created.status_code == 200 and deleted.status_code == 200, (created.text, deleted.text)
        assert (await poll_job(http, created.json()["id"]))["status"] == "completed"
        assert (await http.get(f"/v1/videos/{done['id']}")).status_code == 404


async def test_input_references_is_a_reference_video_alone(tmp_path):
    """vLLM-Omni's plural `input_references` upload: on Cosmos3 a reference video (V2V), as its server keeps
    these uploads for models without mixed references; beside another reference vLLM-Omni's 400, and more
    than one file or a text value a 400 naming it (it had been dropped: a plain text-to-video job)."""
    clip = mp4_bytes(frames=12)
    backend = RecordingBackend()
    small = {**SMALL_FORM, "num_frames": "9"}
    async with asgi_server(tmp_path, backend=backend) as http:
        r = await http.post("/v1/videos", data={"prompt": "x", **small},
                            files={"input_references": ("ref.mp4", clip, "video/mp4")})  # fmt: skip
        assert r.status_code == 200, r.text
        assert (await poll_job(http, r.json()["id"]))["status"] == "completed"
        refused = [
            ({"input_references": ("a.mp4", clip, "video/mp4"), "input_reference": ("b.png", png_bytes(), "image/png")},
             {}, "Provide input_references alone, without input_reference, image_reference, or video_reference."),
            ([("input_references", ("a.mp4", clip, "video/mp4")), ("input_references", ("b.mp4", clip, "video/mp4"))],
             {}, "one reference video"),
            ({"input_references": ("a.mp4", b"", "video/mp4")}, {}, "not a valid image or video"),
            ({"input_references": ("a.mp4", clip[:64], "video/mp4")}, {}, "input_references"),
        ]  # fmt: skip
        for files, more, needle in refused:
            r = await http.post("/v1/videos", data={"prompt": "x", **small, **more}, files=files)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "input_references" and needle in err["message"], (
                r.text
            )
        r = await http.post("/v1/videos", json={"prompt": "x", **small, "input_references": "ref.mp4"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_references", r.text
    (made,) = backend.params
    assert made.image is None and made.video.shape == (5, 16, 32, 3)


async def test_empty_json_strings_are_not_given_as_in_a_form(tmp_path):
    """`"model": ""`, `"seconds": ""`, `"extra_params": ""` in a JSON body mean what they mean in a form: not
    given (they were a model mismatch and type errors); an empty prompt stays a 400 naming it."""
    async with asgi_server(tmp_path) as http:
        body = {
            "prompt": "x",
            **SMALL_FORM,
            "model": "",
            "seconds": "",
            "extra_params": "",
            "negative_prompt": "",
        }
        for sent in ({"data": body}, {"json": body}):
            r = await http.post("/v1/videos", **sent)
            assert r.status_code == 200, r.text
            assert (await poll_job(http, r.json()["id"]))["status"] == "completed"
        r = await http.post("/v1/videos", json={**body, "prompt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text

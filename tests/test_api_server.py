"""A real uvicorn on a loopback port: the recipe's curl, async progress, cancel, 64 concurrent requests and
the official `openai` client's videos calls. FakeBackend; the recipe test uses the real MP4 encoder."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import warnings

import httpx
import pytest
from serving_helpers import png_bytes, uvicorn_thread, wait_until

from worldserve.engine.fake_backend import FakeBackend

RECIPE_PROMPT = (
    '{"subjects":[{"description":"a red robot arm","action":"stacks two wooden blocks"}],'
    '"background_setting":"a sunlit workshop","cinematography":{"camera_motion":"Static"},'
    '"audio_description":"soft clicks of wood on wood"}'
)
NEGATIVE = '{"artifacts":"blurry, distorted, flickering"}'


def recipe_fields(size: str) -> list[tuple[str, str]]:
    return [("prompt", RECIPE_PROMPT), ("negative_prompt", NEGATIVE), ("size", size), ("num_frames", "189"),
            ("fps", "24"), ("num_inference_steps", "35"), ("guidance_scale", "6.0"),
            ("max_sequence_length", "4096"), ("flow_shift", "10.0"), ("seed", "123")]  # fmt: skip


def test_recipe_curl_gives_h264_aac_mp4(tmp_path):
    av = pytest.importorskip("av")
    size = "320x192"  # the recipe's fields and frame count; a small size keeps the x264 encode under a second
    out = tmp_path / "output.mp4"
    with uvicorn_thread(tmp_path / "store", real_encoder=True) as (url, _):
        if shutil.which("curl"):
            cmd = ["curl", "-sS", "-X", "POST", f"{url}/v1/videos/sync", "-H", "Accept: video/mp4",
                   "-D", str(tmp_path / "headers"), "--output", str(out)]  # fmt: skip
            for name, value in recipe_fields(size):
                cmd += ["-F", f"{name}={value}"]
            subprocess.run(cmd, check=True, timeout=120)
            headers = (tmp_path / "headers").read_text().lower()
        else:
            r = httpx.post(
                f"{url}/v1/videos/sync", files=[(k, (None, v)) for k, v in recipe_fields(size)], timeout=120
            )
            out.write_bytes(r.content)
            headers = "\n".join(f"{k}: {v}" for k, v in r.headers.items()).lower()
    assert " 200" in headers.splitlines()[0] if "http/" in headers else True
    assert "content-type: video/mp4" in headers and "x-request-id: video_sync-" in headers
    with av.open(str(out)) as container:
        video = container.streams.video[0]
        audio = container.streams.audio[0]
        assert video.codec_context.name == "h264" and video.average_rate == 24
        assert (video.codec_context.width, video.codec_context.height) == (320, 192)
        assert audio.codec_context.name == "aac" and audio.codec_context.sample_rate == 48000
        assert audio.codec_context.channels == 2
        frames = sum(1 for _ in container.decode(video=0))
    assert frames == 189


def test_async_progress_rises_then_content(tmp_path):
    with uvicorn_thread(tmp_path, backend=FakeBackend(step_delay=0.02)) as (url, _):
        with httpx.Client(base_url=url, timeout=10) as http:
            job = http.post("/v1/videos", data={"prompt": "x", "size": "64x48", "num_frames": "5",
                                                "num_inference_steps": "25"}).json()  # fmt: skip
            seen = []
            while (body := http.get(f"/v1/videos/{job['id']}").json())["status"] != "completed":
                seen.append(body["progress"])
                time.sleep(0.01)
            assert len(set(seen)) >= 5 and seen == sorted(seen) and 0 < max(seen) < 100, seen
            content = http.get(f"/v1/videos/{job['id']}/content")
            assert content.status_code == 200 and content.content.startswith(b"FAKEMP4")


def test_cancel_mid_job_over_http(tmp_path):
    backend = FakeBackend(step_delay=0.02)
    with uvicorn_thread(tmp_path, backend=backend) as (url, _):
        with httpx.Client(base_url=url, timeout=10) as http:
            job = http.post("/v1/videos", data={"prompt": "x", "size": "64x48", "num_frames": "5",
                                                "num_inference_steps": "200"}).json()  # fmt: skip
            wait_until(lambda: http.get(f"/v1/videos/{job['id']}").json()["progress"] >= 2)
            assert http.delete(f"/v1/videos/{job['id']}").json()["deleted"] is True
            wait_until(lambda: job["id"] in backend.released)
            assert not backend.live and http.get(f"/v1/videos/{job['id']}").status_code == 404
            n_steps = len(backend.batch_sizes)
            time.sleep(0.1)
            assert len(backend.batch_sizes) == n_steps, "no more steps after the cancel"


def test_64_concurrent_requests_no_errors(tmp_path):
    backend = FakeBackend(step_delay=0.002)

    async def main(url):
        async with httpx.AsyncClient(
            base_url=url, timeout=60, limits=httpx.Limits(max_connections=64)
        ) as http:

            async def one(i):
                form = {"prompt": f"p{i}", "size": "64x48", "num_frames": "5", "num_inference_steps": "4",
                        "seed": str(i)}  # fmt: skip
                if i % 2:
                    return await http.post("/v1/videos/sync", data=form)
                job = (await http.post("/v1/videos", data=form)).json()
                while (await http.get(f"/v1/videos/{job['id']}")).json()["status"] != "completed":
                    await asyncio.sleep(0.01)
                return await http.get(f"/v1/videos/{job['id']}/content")

            return await asyncio.gather(*(one(i) for i in range(64)))

    with uvicorn_thread(tmp_path, backend=backend, max_batch_size=8) as (url, _):
        responses = asyncio.run(main(url))
        listed = httpx.get(f"{url}/v1/videos", params={"limit": 100}).json()
    assert [r.status_code for r in responses] == [200] * 64
    assert len({r.content for r in responses}) == 64, "every seed gave its own video"
    assert max(backend.batch_sizes) > 1 and len(listed["data"]) == 64


def test_openai_client_videos_calls(tmp_path):
    openai = pytest.importorskip("openai")
    with uvicorn_thread(tmp_path, api_key="sk-test") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)
        small = {"num_frames": 5, "num_inference_steps": 2, "fps": 8}
        video = client.videos.create(prompt="a cat", size="64x48", seconds="1", extra_body=small)
        assert video.id.startswith("video_gen_") and video.status == "queued" and video.size == "64x48"
        done = client.videos.create_and_poll(
            prompt="a dog", size="64x48", extra_body=small, poll_interval_ms=20
        )
        assert done.status == "completed" and done.progress == 100
        image = client.videos.create(prompt="i2v", size="64x48", extra_body=small,
                                     input_reference=("ref.png", png_bytes(), "image/png"))  # fmt: skip
        assert client.videos.retrieve(image.id).model == "test-model"
        ids = [v.id for v in client.videos.list(limit=2, order="asc")]  # auto-paginates over all pages
        assert ids[:2] == [video.id, done.id] and image.id in ids
        content = client.videos.download_content(done.id)
        assert content.content.startswith(b"FAKEMP4")
        deleted = client.videos.delete(video.id)
        assert deleted.deleted and deleted.id == video.id
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).videos.list()
        # Sora's own calls (vLLM-Omni serves none): a 404 saying so (remix was a bare 404, extend and edit 405s)
        for call in (lambda: client.videos.remix(done.id, prompt="again"),
                     lambda: client.videos.extend(prompt="on", seconds="4", video=("in.mp4", content.content, "video/mp4")),
                     lambda: client.videos.edit(prompt="red", video=("in.mp4", content.content, "video/mp4")),
                     lambda: client.videos.get_character("char_1")):  # fmt: skip
            with (
                pytest.raises(openai.NotFoundError, match="is Sora's and not served here"),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore", DeprecationWarning)
                call()


def test_openai_sdk_nested_extra_body_and_input_reference_objects(tmp_path, caplog):
    """The SDK posts videos.create as multipart and writes a nested extra_body value key by key in brackets
    (`extra_params[seed]=3`, `extra_params[video_codec_options][preset]=fast`); those fields had been
    ignored as unknown ones, so the job ran without its extra_params, unsaid. They are now the object they
    were, as OpenAI's `input_reference: {"image_url": ...}` is an image reference (in a JSON body too); an
    unknown form field is logged as a JSON body's is."""
    import base64
    import json

    openai = pytest.importorskip("openai")
    small = {"num_frames": 5, "num_inference_steps": 2, "fps": 8}
    extra = {"seed": 3, "generate_sound": False, "video_codec_options": {"preset": "fast"}}
    image = "data:image/png;base64," + base64.b64encode(png_bytes(32, 24)).decode()  # (4:3: I2V's own size)
    with uvicorn_thread(tmp_path) as (url, _), caplog.at_level("WARNING", logger="worldserve.api.bodies"):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)

        def content(**body) -> dict:
            video = client.videos.create_and_poll(
                prompt="x", poll_interval_ms=20, extra_body={**small, **body}
            )
            assert video.status == "completed", video
            return {**json.loads(client.videos.download_content(video.id).content[7:]), "size": video.size}

        nested, as_text = (
            content(size="64x48", extra_params=extra),
            content(size="64x48", extra_params=json.dumps(extra)),
        )
        assert nested == as_text and nested["audio"] is None and nested["codec_options"] == {"preset": "fast"}
        assert content(size="64x48", extra_params={"seed": 4})["first_pixel"] != nested["first_pixel"]
        assert (
            content(input_reference={"image_url": image})["size"] == "1104x816"
        )  # (T2V's default: 1280x720)
        r = httpx.post(
            f"{url}/v1/videos", json={"prompt": "x", **small, "input_reference": {"image_url": image}}
        )
        assert r.status_code == 200 and r.json()["size"] == "1104x816", r.text
        assert "ignored" not in caplog.text
        for fields, param, needle in [
            ({"input_reference[file_id]": "file_1"}, "input_reference", "file_id is not supported"),
            ({"extra_params": "{}", "extra_params[seed]": "3"}, "extra_params", "sent both whole and as"),
            ({"extra_params[seed]": "3", "extra_params[seed][x]": "4"}, "extra_params", "given twice, or beside"),
            ({"extra_params[l][][a]": "1"}, "extra_params", "a list of objects"),
            ({"extra_params[seed]": "x"}, "extra_params.seed", "seed"),
        ]:  # fmt: skip
            r = httpx.post(
                f"{url}/v1/videos", files={"prompt": (None, "x"), **{k: (None, v) for k, v in fields.items()}}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert needle in r.json()["error"]["message"], r.text
        assert httpx.post(f"{url}/v1/videos", data={"prompt": "x", **small, "bogus": "1"}).status_code == 200
    assert "The following fields were present in the request but ignored: {'bogus'}" in caplog.text


def test_openai_failed_job_status_lets_the_sdk_poll_a_failed_job(tmp_path):
    """vLLM-Omni answers a failed job's GET with its failure code, so the SDK's create_and_poll raises (after
    retrying a 5xx); `--openai-failed-job-status` answers it 200 as OpenAI does: the SDK returns the failed
    Video with its error. The flag reaches the app through serve's settings."""
    openai = pytest.importorskip("openai")
    from worldserve.cli import build_parser
    from worldserve.commands.serve import app_settings, engine_config

    argv = ["serve", "--openai-failed-job-status"]
    assert app_settings(engine_config(build_parser(argv).parse_args(argv))).failed_jobs_ok
    argv = ["serve"]
    assert not app_settings(engine_config(build_parser(argv).parse_args(argv))).failed_jobs_ok
    small = {"num_frames": 5, "num_inference_steps": 2, "fps": 8}
    for failed_ok in (False, True):
        with uvicorn_thread(tmp_path / str(failed_ok), app_kw={"failed_jobs_ok": failed_ok}) as (url, _):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
            body = {
                "prompt": "__fail__:denoise",
                "size": "64x48",
                "poll_interval_ms": 20,
                "extra_body": small,
            }
            if not failed_ok:
                with pytest.raises(openai.InternalServerError):
                    client.videos.create_and_poll(**body)
                continue
            video = client.videos.create_and_poll(**body)
            assert video.status == "failed" and "injected failure" in video.error.message, video


def test_openai_sdk_retrieves_each_served_model(tmp_path):
    """OpenAI's GET /v1/models/{model} (the SDK's models.retrieve, which some frameworks call to check a model;
    vLLM serves only the list): each served name's card, a name with a slash too, else vLLM's 404."""
    openai = pytest.importorskip("openai")
    with uvicorn_thread(tmp_path, app_kw={"model_aliases": ("org/c3",)}) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        cards = [client.models.retrieve(name) for name in ("test-model", "org/c3")]
        assert [c.id for c in cards] == ["test-model", "org/c3"] and cards[1].owned_by == "vllm"
        assert httpx.get(f"{url}/v1/models/org%2Fc3").json()["id"] == "org/c3"
        with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
            client.models.retrieve("nope")


def test_a_sync_client_that_disconnects_takes_its_job_with_it(tmp_path):
    """/v1/videos/sync: a client gone before the answer never learnt the job id; the job is deleted and its
    GPU work aborted (serving-api.md §14), and the server keeps serving."""
    backend = FakeBackend(step_delay=0.05)
    with uvicorn_thread(tmp_path, backend=backend) as (url, client):
        form = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "200"}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/videos/sync", data=form, timeout=httpx.Timeout(5, read=0.5))
        wait_until(lambda: httpx.get(url + "/v1/videos").json()["data"] == [], timeout=5)
        wait_until(lambda: client.engine.num_running == 0, timeout=5)
        quick = httpx.post(url + "/v1/videos/sync", data={**form, "num_inference_steps": "2"}, timeout=30)
        assert quick.status_code == 200 and quick.content.startswith(b"FAKEMP4")

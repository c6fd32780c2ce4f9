"""The server on the real `VideoPipeline` and the tiny random checkpoint (CPU): in process over ASGI
(T2V sync MP4, I2V async, a batched pair), and `worldserve serve` with no MODEL as a subprocess."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import subprocess
import sys

import httpx
import pytest
from serving_helpers import asgi_server, png_bytes, poll_job, served_url

pytestmark = pytest.mark.anyio
TINY = {"size": "32x32", "num_frames": "5", "num_inference_steps": "2", "fps": "8"}


@pytest.fixture(scope="module")
def pipeline(tiny_ckpt):
    from worldserve.runner.video_pipeline import VideoPipeline

    return VideoPipeline.from_pretrained(tiny_ckpt, device="cpu", progress=False)


def probe(mp4: bytes) -> dict:
    import av

    with av.open(io.BytesIO(mp4)) as container:
        v = container.streams.video[0].codec_context
        audio = container.streams.audio
        a = audio[0].codec_context if audio else None
        info = {"video": v.name, "size": (v.width, v.height), "rate": container.streams.video[0].average_rate,
                "audio": a and (a.name, a.sample_rate, a.channels)}  # fmt: skip
        info["frames"] = sum(1 for _ in container.decode(video=0))
    return info


async def test_sync_i2v_and_batched_pair_on_the_tiny_checkpoint(tmp_path, pipeline):
    async with asgi_server(tmp_path, backend=pipeline, real_encoder=True, max_batch_size=2) as http:
        r = await http.post("/v1/videos/sync", data={"prompt": '{"subjects":["a cat"]}', **TINY})
        assert r.status_code == 200, r.text
        assert probe(r.content) == {"video": "h264", "size": (32, 32), "rate": 8, "audio": ("aac", 48000, 2),
                                    "frames": 5}  # fmt: skip
        stages = r.headers["x-stage-durations"]
        assert "vae.decode" in stages and "encode" in stages

        i2v = (await http.post("/v1/videos", data={"prompt": "move", **TINY, "generate_sound": "false"},
                               files={"input_reference": ("r.png", png_bytes(40, 24), "image/png")})).json()  # fmt: skip
        pair = [
            (await http.post("/v1/videos", data={"prompt": f"p{i}", **TINY, "seed": str(i)})).json()
            for i in range(2)
        ]
        for job in (i2v, *pair):
            assert (await poll_job(http, job["id"], timeout=60))["status"] == "completed"
        assert probe((await http.get(f"/v1/videos/{i2v['id']}/content")).content)["audio"] is None
        contents = [(await http.get(f"/v1/videos/{j['id']}/content")).content for j in pair]
        assert contents[0] != contents[1]


async def test_sound_duration_trims_or_pads_the_jointly_generated_sound(tmp_path, pipeline):
    """vLLM-Omni's sound_duration: the sound is generated as long as the clip (5 frames at 8 fps: 0.625 s), then
    its waveform cut or padded with silence to the duration asked for; the video is unchanged."""
    from media_probe import probe_mp4

    async with asgi_server(tmp_path, backend=pipeline, real_encoder=True) as http:
        clips = {}
        for name, extra in (("clip", {}), ("short", {"sound_duration": "0.25"}),
                            ("long", {"extra_params": '{"audio_duration": 2}'})):  # fmt: skip
            r = await http.post("/v1/videos/sync", data={"prompt": "a cat", **TINY, "seed": "3", **extra})
            assert r.status_code == 200, r.text
            clips[name] = probe_mp4(r.content, decode=True)
    for name, seconds in (("clip", 0.625), ("short", 0.25), ("long", 2.0)):
        p = clips[name]
        assert abs(p.audio_duration - seconds) <= 1e-3 and abs(p.video_duration - 0.625) <= 1e-3, name
        assert p.num_frames == 5 and p.audio_codec == "aac"
    assert clips["short"].frames.tobytes() == clips["clip"].frames.tobytes() == clips["long"].frames.tobytes()


def test_a_longer_sound_duration_pads_the_clips_sound_with_silence(pipeline):
    """Past the clip (5 frames at 8 fps: 30,000 samples) the padding is silence: the decoder's output runs on
    to a whole hop (30,720 samples), and that tail was kept before the zeros."""
    import numpy as np

    from worldserve.params import VideoParams

    clip = VideoParams(prompt="a cat", width=32, height=32, num_frames=5, fps=8, num_inference_steps=2, seed=3,
                       generate_sound=True)  # fmt: skip
    plain, _ = pipeline.generate(clip)
    long, _ = pipeline.generate(dataclasses.replace(clip, sound_duration=2.0))
    assert plain.audio.shape == (2, 30_000) and long.audio.shape == (2, 96_000)
    assert np.array_equal(long.audio[:, :30_000], plain.audio) and np.abs(plain.audio).max() > 0
    assert not long.audio[:, 30_000:].any()


async def test_model_validation_reaches_the_client(tmp_path, pipeline):
    async with asgi_server(tmp_path, backend=pipeline) as http:
        r = await http.post("/v1/videos", data={"prompt": "x " * 50, **TINY, "max_sequence_length": "4"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = await http.post("/v1/videos", data={"prompt": "x " * 50, **TINY, "max_sequence_length": "512",
                                                "negative_prompt": "y " * 600})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "negative_prompt", r.text
        # a cap set for the prompt (NVIDIA's README: 512) does not refuse the default negative prompt
        r = await http.post("/v1/videos", data={"prompt": "x " * 50, **TINY, "max_sequence_length": "512"})
        assert r.status_code == 200, r.text
        assert (await poll_job(http, r.json()["id"], timeout=60))["status"] == "completed"
        r = await http.post(
            "/v1/videos", data={"prompt": "x", **TINY, "num_frames": "1", "generate_sound": "true"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "generate_sound"
        r = await http.post(  # the model's checks name the field the value came in, as the field checks do
            "/v1/videos",
            data={"prompt": "x", **TINY, "num_frames": "1", "extra_params": '{"generate_sound": true}'},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_params.generate_sound", r.text
        await asyncio.sleep(0)


def test_serve_without_model_uses_the_tiny_checkpoint_loudly_with_layerwise_offload(tmp_path):
    log = tmp_path / "serve.log"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "worldserve.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--device", "cpu", "--omni", "--init-timeout", "300", "--enable-layerwise-offload",
           "--warmup-shapes", "32x32x5"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        url = served_url(log, proc, timeout=120)
        text = log.read_text()
        assert "TINY RANDOM" in text and "NOISE" in text
        assert (tmp_path / "cache" / "worldserve" / "storage" / "jobs.sqlite3").is_file(), (
            "default storage dir"
        )
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "worldserve/tiny-cosmos3"
        r = httpx.post(f"{url}/v1/videos/sync", data={"prompt": "noise", **TINY}, timeout=120)
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4" and r.content[4:8] == b"ftyp"
        # the layers stream from host buffers (on a CPU this only exercises the path) for both APIs
        assert "+offload" in log.read_text() and "warm-up 32x32x5 (1 step + decode)" in log.read_text()
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "model": "worldserve/tiny-cosmos3",
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    finally:
        proc.terminate()
        proc.wait(30)


async def test_jobs_with_and_without_an_adapter_run_side_by_side(tmp_path, pipeline, tiny_ckpt):
    """Over HTTP on the real pipeline (--enable-lora, max batch 3): a job with an adapter, one without and one
    with a bad adapter's path submitted together. The bad one is a 400 naming `lora` before it is queued;
    the other two complete, each MP4's decoded frames equal to those of the same request run alone (sync),
    and the adapter changed the video."""
    from pipeline_helpers import write_random_adapter

    from worldserve.api.lora_field import LoraSettings

    adapter = write_random_adapter(tmp_path / "fox", tiny_ckpt, std=0.2)
    fields = {"prompt": "a fox", **TINY, "generate_sound": "false", "seed": "5"}
    lora = f'{{"name": "fox", "path": "{adapter}", "scale": 0.8}}'
    async with asgi_server(tmp_path / "s", backend=pipeline, real_encoder=True, max_batch_size=3,
                           app_kw={"lora": LoraSettings(per_request=True)}) as http:  # fmt: skip
        bad = await http.post("/v1/videos", data={**fields, "lora": '{"name": "x", "path": "/nowhere"}'})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora", bad.text
        jobs = await asyncio.gather(
            http.post("/v1/videos", data={**fields, "lora": lora}), http.post("/v1/videos", data=fields)
        )
        ids = [j.json()["id"] for j in jobs]
        for job_id in ids:
            assert (await poll_job(http, job_id, timeout=60))["status"] == "completed"
        together = [(await http.get(f"/v1/videos/{i}/content")).content for i in ids]
        alone = []
        for extra in ({"lora": lora}, {}):
            r = await http.post("/v1/videos/sync", data={**fields, **extra})
            assert r.status_code == 200, r.text
            alone.append(r.content)
    assert [frames_of(m) for m in together] == [frames_of(m) for m in alone]
    assert frames_of(together[0]) != frames_of(together[1])


def frames_of(mp4: bytes) -> list[bytes]:
    import av

    with av.open(io.BytesIO(mp4)) as container:
        return [f.to_ndarray(format="rgb24").tobytes() for f in container.decode(video=0)]

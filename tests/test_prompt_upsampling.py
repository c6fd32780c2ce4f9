"""Prompt upsampling (engine/prompt_upsampling.py, `extra_params.upsample_prompt`): the Reasoner writes the
video's JSON prompt under a bounded schema before the job is queued. Unit checks of the chat and the answer's
parsing; a uniform random walk through the schema's grammar closes within the budget; over HTTP on the tiny
checkpoint (real pipeline, real Reasoner, CPU): the job shows the prompt it ran with and its MP4 equals a job
sent that prompt directly; a delete while upsampling, a server without a Reasoner, and a restart in between.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import numpy as np
import pytest
import torch
from reasoner_helpers import tiny_reasoner
from serving_helpers import asgi_server, make_client, png_bytes, poll_job, realtime_session, serve_app, ws_url

from worldserve.chat_params import StructuredOutput
from worldserve.engine.prompt_upsampling import UpsamplerConfig, prompt_from_answer, upsampling_chat
from worldserve.media.image import resize_center_crop
from worldserve.media.video_input import resize_video
from worldserve.params import VideoParams

SMALL = UpsamplerConfig(max_chars=12, max_subjects=1, max_actions=1, min_room=1024)
"""Short texts: a random tiny model fills every field to its bound, and CPU tests stay quick (the tiny
Reasoner's context is 4,096 tokens)."""
TINY = {"size": "32x32", "num_frames": "5", "num_inference_steps": "2", "fps": "8", "seed": "7"}
KEYS = {"subjects", "background_setting", "lighting", "aesthetics", "cinematography", "style_medium", "actions",
        "temporal_caption", "audio_description"}  # fmt: skip


def test_the_chat_asks_for_the_schema_with_nvidias_sampling_and_the_image():
    t2v = upsampling_chat(VideoParams(prompt="a fox in the snow", seed=5))
    assert t2v.temperature == 0.7 and t2v.top_p == 0.8 and t2v.top_k == 20 and t2v.seed == 5
    assert t2v.structured.kind == "json" and set(json.loads(t2v.structured.spec)["required"]) == KEYS
    (turn,) = t2v.messages
    assert [p.type for p in turn.content] == ["text"] and "a fox in the snow" in turn.content[0].text
    assert "7.9 seconds" in turn.content[0].text
    # the frame the video starts from, as the pipeline makes it (any aspect ratio: a 1 x 400 image too)
    image = np.random.default_rng(0).integers(0, 255, (1, 400, 3), dtype=np.uint8)
    i2v = upsampling_chat(VideoParams(prompt="it moves", image=image, width=320, height=192))
    assert [p.type for p in i2v.messages[0].content] == ["image", "text"]
    assert np.array_equal(i2v.messages[0].content[0].image, resize_center_crop(image, 320, 192))
    assert "attached image" in i2v.messages[0].content[1].text
    clip = np.arange(9 * 16 * 24 * 3, dtype=np.uint8).reshape(9, 16, 24, 3)
    last = VideoParams(prompt="it goes on", video=clip, width=64, height=48, condition_video_keep="last")
    v2v = upsampling_chat(last).messages[0].content  # the conditioning clip: the last 5 frames
    assert (
        np.array_equal(v2v[0].image, resize_video(clip[4:5], 64, 48)[0])
        and "first frame is attached" in v2v[1].text
    )


def test_the_chat_is_built_off_the_chat_workers_thread(reasoner):
    """The Reasoner's prompt for the upsampling chat (the frame through the ViT's preprocessing, template,
    tokens) is built before the chat is queued, so the chat worker (every running chat's thread) does not;
    a prompt that cannot be built is UpsamplingFailed(400)."""
    from worldserve.engine.prompt_upsampling import UpsamplingFailed, built_upsampling_chat

    params = VideoParams(prompt="a fox in the snow", seed=5)
    chat = asyncio.run(built_upsampling_chat(reasoner, params, SMALL))
    assert chat.prebuilt is not None
    assert chat.prebuilt.input_ids == reasoner.build_prompt(upsampling_chat(params, SMALL)).input_ids
    assert (
        asyncio.run(built_upsampling_chat(None, params, SMALL)).prebuilt is None
    )  # (no prompts: the worker's)
    sliver = VideoParams(prompt="it moves", image=np.zeros((64, 64, 3), np.uint8), width=16, height=3600)
    with pytest.raises(UpsamplingFailed, match="aspect ratio") as info:  # a frame the ViT cannot resize
        asyncio.run(built_upsampling_chat(reasoner, sliver, SMALL))
    assert info.value.status == 400


def test_the_answer_becomes_a_compact_json_prompt():
    assert prompt_from_answer('{ "subjects" : [ {"description": "fox"} ],\n "caf\u00e9": 1 }') == (
        '{"subjects": [{"description": "fox"}], "caf\\u00e9": 1}'
    )
    for cut in ('{"subjects": [', "[1, 2]", ""):
        with pytest.raises(ValueError, match="prompt upsampler"):
            prompt_from_answer(cut)


def test_a_random_walk_through_the_schema_closes_within_its_bounds(reasoner):
    """A model with flat logits (uniform among allowed tokens) still writes a complete document: every text
    and list is bounded."""
    compiler = reasoner.grammars
    so = StructuredOutput(kind="json", spec=json.dumps(SMALL.schema()))
    for seed in range(3):
        grammar, gen, ids = compiler.grammar(so), torch.Generator().manual_seed(seed), []
        while True:
            mask = torch.isfinite(grammar.constrain(torch.zeros(compiler.vocab_size)))
            token = int(torch.multinomial(mask.float(), 1, generator=gen))
            if token in compiler.end_ids:
                break
            grammar.accept(token)
            ids.append(token)
            assert len(ids) < 2000
        doc = json.loads(prompt_from_answer(compiler.hf_tokenizer.decode(ids)))
        assert set(doc) == KEYS and all(len(s["description"]) <= 12 for s in doc["subjects"])


@pytest.fixture(scope="module")
def pipeline(tiny_ckpt):
    from worldserve.runner.video_pipeline import VideoPipeline

    return VideoPipeline.from_pretrained(tiny_ckpt, device="cpu", progress=False)


@pytest.fixture(scope="module")
def chat_backend(tiny_ckpt):
    return tiny_reasoner(tiny_ckpt)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_upsampled_job_runs_the_prompt_it_shows(tmp_path, pipeline, chat_backend, anyio_backend):
    async with asgi_server(tmp_path, backend=pipeline, real_encoder=True, chat_backend=chat_backend,
                           upsampler=SMALL) as http:  # fmt: skip
        upsample = {"prompt": "a fox", **TINY, "extra_params": json.dumps({"upsample_prompt": True})}
        sync = await http.post("/v1/videos/sync", data=upsample)
        assert sync.status_code == 200, sync.text
        job = (await http.get(f"/v1/videos/{sync.headers['x-video-id']}")).json()
        assert job["prompt"] == "a fox" and set(json.loads(job["upsampled_prompt"])) == KEYS
        metrics = (await http.get("/metrics")).text  # the upsampling chat counted as a chat
        assert re.search(
            r'worldserve:chat_request_success_total\{[^}]*finish_reason="stop"[^}]*\} 1\.0', metrics
        )
        direct = await http.post("/v1/videos/sync", data={**TINY, "prompt": job["upsampled_prompt"]})
        assert direct.status_code == 200 and direct.content == sync.content  # the same video: that prompt ran
        again = await http.post("/v1/videos", data=upsample)  # async, seeded: the same prompt again
        done = await poll_job(http, again.json()["id"], timeout=120)
        assert done["status"] == "completed" and done["upsampled_prompt"] == job["upsampled_prompt"]
        i2v = await http.post("/v1/videos", data=upsample, files={"input_reference": ("r.png", png_bytes(40, 24),
                              "image/png")})  # fmt: skip
        done = await poll_job(http, i2v.json()["id"], timeout=120)
        assert done["status"] == "completed" and set(json.loads(done["upsampled_prompt"])) == KEYS


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_delete_while_upsampling_stops_the_chat(tmp_path, pipeline, chat_backend, anyio_backend):
    slow = UpsamplerConfig(
        max_chars=4000, max_subjects=3, max_actions=4, min_room=1024
    )  # still writing when deleted
    async with asgi_server(tmp_path, backend=pipeline, real_encoder=True, chat_backend=chat_backend,
                           upsampler=slow) as http:  # fmt: skip
        client = http.engine_client
        created = await http.post("/v1/videos", data={"prompt": "a fox", **TINY,
                                                      "extra_params": '{"upsample_prompt": true}'})  # fmt: skip
        job_id = created.json()["id"]
        assert created.json()["status"] == "queued" and job_id in client.jobs._upsampling
        await asyncio.sleep(0.3)
        assert (await http.delete(f"/v1/videos/{job_id}")).status_code == 200
        assert await _chat_stopped(chat_backend)  # the chat left the Reasoner
        assert (await http.get(f"/v1/videos/{job_id}")).status_code == 404


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_without_a_reasoner_upsampling_is_a_400(tmp_path, anyio_backend):
    async with asgi_server(tmp_path) as http:
        r = await http.post(
            "/v1/videos", data={"prompt": "a fox", "extra_params": '{"upsample_prompt": true}'}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_params.upsample_prompt"


async def _one_waiting(http, upsampling) -> None:
    """Wait (~10 s at most) for `upsampling()` to hold, then check that /metrics counts one request waiting."""
    for _ in range(1000):
        if upsampling():
            break
        await asyncio.sleep(0.01)
    assert re.search(r"worldserve:num_requests_waiting\{[^}]*\} 1\.0", (await http.get("/metrics")).text)


async def _chat_live(reasoner) -> bool:
    """Whether the Reasoner holds a chat within ~10 s (a loaded CI machine)."""
    for _ in range(500):
        if reasoner._live > 0:
            return True
        await asyncio.sleep(0.02)
    return False


async def _chat_stopped(reasoner) -> bool:
    """Whether the Reasoner has no chat left within ~10 s (a stopped chat leaves at its next step)."""
    for _ in range(500):
        if reasoner._live == 0:
            return True
        await asyncio.sleep(0.02)
    return False


async def _completes_on_restart(storage, pipeline, chat_backend, job_id: str) -> None:
    """A server started again on `storage` with a Reasoner upsamples and completes the job."""
    async with asgi_server(storage, backend=pipeline, real_encoder=True, chat_backend=chat_backend,
                           upsampler=SMALL) as http:  # fmt: skip
        done = await poll_job(http, job_id, timeout=120)
        assert done["status"] == "completed" and set(json.loads(done["upsampled_prompt"])) == KEYS


def _store_unupsampled_job(store) -> str:
    """A job stored as submit stores it, its upsampling never started (a server stopped right after); its id."""
    from worldserve.engine.job_files import inputs_record
    from worldserve.engine.job_schema import new_job_id
    from worldserve.engine.jobs import Job, JobSpec, JobStatus
    from worldserve.engine.request import EncodeOptions

    params = VideoParams(prompt="a fox", width=32, height=32, num_frames=5, num_inference_steps=2, fps=8,
                         seed=7, upsample_prompt=True)  # fmt: skip
    spec = JobSpec(model="m", prompt="a fox", size="32x32", seconds="0.6", quality="standard", fps=8,
                   num_frames=5)  # fmt: skip
    stored = Job(id=new_job_id(), status=JobStatus.QUEUED, progress=0, created_at=0.0, spec=spec)
    store.create(stored, inputs_record(params, EncodeOptions()), None)
    return stored.id


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_restart_upsamples_an_interrupted_job(tmp_path, pipeline, chat_backend, anyio_backend):
    """A job accepted but not yet upsampled when the server stopped is upsampled and run at the next start;
    one restarted on a server without a Reasoner fails with the reason (it stayed queued forever before)."""
    async with asgi_server(tmp_path, backend=pipeline, real_encoder=True) as http:
        job_id = _store_unupsampled_job(http.engine_client.store)
    async with asgi_server(tmp_path / "other", backend=pipeline, real_encoder=True) as http:
        orphan = _store_unupsampled_job(http.engine_client.store)
    async with asgi_server(tmp_path / "other", backend=pipeline, real_encoder=True) as http:  # no Reasoner
        failed = await poll_job(http, orphan, timeout=30)
        assert failed["status"] == "failed" and failed["error"]["code"] == 400
        assert "the model now served does not take it" in failed["error"]["message"]
        assert "prompt upsampling needs the Reasoner" in failed["error"]["message"]
    await _completes_on_restart(tmp_path, pipeline, chat_backend, job_id)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_prompt_to_upsample_is_not_held_to_max_sequence_length(
    tmp_path, pipeline, chat_backend, anyio_backend
):
    """The client's prompt is the Reasoner's input, not the text the gen tower reads: past the request's
    max_sequence_length it is upsampled (the Reasoner's context bounds it), and the prompt written for it is
    the one held to that limit (it was refused as too long before the Reasoner saw it)."""
    async with asgi_server(tmp_path, backend=pipeline, real_encoder=True, chat_backend=chat_backend,
                           upsampler=SMALL) as http:  # fmt: skip
        tokens = len(pipeline.encoder.tokenizer("a red fox runs " * 100)["input_ids"])
        limit = json.dumps({"max_sequence_length": 400})
        data = {"prompt": "a red fox runs " * 100, **TINY}
        assert tokens > 400
        plain = await http.post("/v1/videos", data={**data, "extra_params": limit})
        assert plain.status_code == 400 and plain.json()["error"]["param"] == "prompt", plain.text
        extra = json.dumps({"upsample_prompt": True, "max_sequence_length": 400})
        r = await http.post("/v1/videos/sync", data={**data, "extra_params": extra})
        assert r.status_code == 200, r.text
        job = (await http.get(f"/v1/videos/{r.headers['x-video-id']}")).json()
        written = len(pipeline.encoder.tokenizer(job["upsampled_prompt"])["input_ids"])
        assert set(json.loads(job["upsampled_prompt"])) == KEYS and written <= 400


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_written_prompt_past_max_sequence_length_fails_the_job(
    tmp_path, pipeline, chat_backend, anyio_backend
):
    """The written prompt is checked as a client's would be (here: more tokens than the request's
    max_sequence_length): the job fails with a 400 that says so, the sync request answers it; the images
    route answers the same, naming the field the value came in (its top-level max_sequence_length is
    honoured too)."""
    async with asgi_server(tmp_path, backend=pipeline, real_encoder=True, chat_backend=chat_backend,
                           upsampler=SMALL) as http:  # fmt: skip
        extra = json.dumps({"upsample_prompt": True, "max_sequence_length": 150, "negative_prompt": "blur"})
        r = await http.post("/v1/videos/sync", data={"prompt": "a fox", **TINY, "extra_params": extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_params.max_sequence_length", (
            r.text
        )
        message = r.json()["error"]["message"]  # (the field the value came in)
        assert "Prompt upsampling failed" in message and "raise extra_params.max_sequence_length" in message
        assert message.count("max_sequence_length") == 2 and "shorten" not in message, message  # (said once)
        body = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 2, "negative_prompt": "",
                "max_sequence_length": 150}  # fmt: skip
        image = await http.post(
            "/v1/images/generations", json={**body, "extra_params": {"upsample_prompt": True}}
        )
        assert image.status_code == 400 and image.json()["error"]["param"] == "max_sequence_length", (
            image.text
        )
        long = await http.post("/v1/images/generations", json={**body, "prompt": "a fox " * 200})
        assert long.status_code == 400 and long.json()["error"]["param"] == "prompt", long.text


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_images_answer_the_written_prompt_as_revised_prompt(
    tmp_path, pipeline, chat_backend, anyio_backend
):
    """/v1/images/generations: one prompt written for the n images, answered as OpenAI's `revised_prompt`;
    the image equals one asked with that prompt."""
    async with asgi_server(tmp_path, backend=pipeline, chat_backend=chat_backend, upsampler=SMALL) as http:
        body = {"prompt": "a fox", "size": "32x32", "n": 2, "seed": 5, "num_inference_steps": 2}
        r = await http.post(
            "/v1/images/generations", json={**body, "extra_params": {"upsample_prompt": True}}
        )
        assert r.status_code == 200, r.text
        revised = [d["revised_prompt"] for d in r.json()["data"]]
        assert revised[0] == revised[1] and set(json.loads(revised[0])) == KEYS
        direct = await http.post("/v1/images/generations", json={**body, "prompt": revised[0]})
        assert [d["b64_json"] for d in direct.json()["data"]] == [d["b64_json"] for d in r.json()["data"]]
        assert direct.json()["data"][0]["revised_prompt"] is None
    async with asgi_server(tmp_path / "none") as http:
        r = await http.post(
            "/v1/images/generations", json={**body, "extra_params": {"upsample_prompt": True}}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_params.upsample_prompt"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_shutdown_while_upsampling_keeps_the_job_for_the_next_start(tmp_path, pipeline, chat_backend,
                                                                           anyio_backend):  # fmt: skip
    slow = UpsamplerConfig(max_chars=4000, max_subjects=3, max_actions=4, min_room=1024)
    async with asgi_server(tmp_path, backend=pipeline, real_encoder=True, chat_backend=chat_backend,
                           upsampler=slow) as http:  # fmt: skip
        created = await http.post("/v1/videos", data={"prompt": "a fox", **TINY,
                                                      "extra_params": '{"upsample_prompt": true}'})  # fmt: skip
        job_id = created.json()["id"]
        await asyncio.sleep(0.3)  # the chat is writing when the server stops
    assert chat_backend._live == 0
    await _completes_on_restart(tmp_path, pipeline, chat_backend, job_id)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_shutdown_stops_an_image_requests_upsampling_at_once(tmp_path, pipeline, chat_backend,
                                                                     anyio_backend):  # fmt: skip
    """A shutdown stops the prompts being upsampled when it begins: their requests are queued ones, which
    start no more. An image request (a realtime session alike) got its 503 only once its chat had run to its
    end, or the shutdown's timeout had passed (30 s by default, holding the server's exit)."""
    slow = UpsamplerConfig(max_chars=4000, max_subjects=3, max_actions=4, min_room=1024)
    async with asgi_server(tmp_path, backend=pipeline, chat_backend=chat_backend, upsampler=slow,
                           sync_timeout_s=600) as http:  # fmt: skip
        body = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 2,
                "extra_params": {"upsample_prompt": True}}  # fmt: skip
        image = asyncio.create_task(http.post("/v1/images/generations", json=body))
        client = http.engine_client
        await _one_waiting(http, lambda: client.jobless.upsampling)
        # its chat running in the Reasoner (on a loaded machine the shutdown could otherwise begin before the
        # chat was submitted: then no chat runs, none is stopped, and none is metered)
        assert await _chat_live(chat_backend)
        client.begin_shutdown(600)
        answer = await asyncio.wait_for(image, 60)  # (a hang guard only)
        assert answer.status_code == 503, answer.text
        assert "shutting down" in answer.json()["error"]["message"], answer.text
        assert await _chat_stopped(chat_backend)
        assert client.num_waiting == 0
        # its chat stopped (abort, metered once its end reaches the loop), not run to its end before the
        # admission's refusal
        aborted = r'worldserve:chat_request_success_total\{[^}]*finish_reason="abort"[^}]*\} 1\.0'
        for _ in range(250):
            metrics = (await http.get("/metrics")).text
            if re.search(aborted, metrics):
                break
            await asyncio.sleep(0.02)
        assert re.search(aborted, metrics), metrics
        rejected = 'worldserve:request_rejected_total{model_name="test-model",reason="shutting_down"} 1.0'
        assert rejected in metrics


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_prompt_leaving_the_answer_too_little_context_is_a_400(
    tmp_path, pipeline, chat_backend, anyio_backend
):
    async with asgi_server(tmp_path, backend=pipeline, chat_backend=chat_backend, upsampler=SMALL) as http:
        long = " ".join(f"fox{i}" for i in range(1500))
        r = await http.post(
            "/v1/videos", data={"prompt": long, **TINY, "extra_params": '{"upsample_prompt": true}'}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "too long to upsample" in r.json()["error"]["message"]
        assert (await http.get("/v1/videos")).json()["data"] == []  # nothing was queued


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_stopped_chat_worker_fails_the_job_and_a_delete_answers_the_sync_wait(
    tmp_path, pipeline, chat_backend, anyio_backend
):
    """A chat failure outside the shutdown (here: the worker stopped) fails the job with its status, counted in
    the metrics; a DELETE during upsampling answers a sync request waiting on the job at once (404)."""
    slow = UpsamplerConfig(max_chars=4000, max_subjects=3, max_actions=4, min_room=1024)
    async with asgi_server(tmp_path, backend=pipeline, chat_backend=chat_backend, upsampler=slow,
                           sync_timeout_s=60) as http:  # fmt: skip
        data = {"prompt": "a fox", **TINY, "extra_params": '{"upsample_prompt": true}'}
        sync = asyncio.create_task(http.post("/v1/videos/sync", data=data))
        client = http.engine_client
        await _one_waiting(http, lambda: client.jobs._upsampling)
        (job_id,) = client.jobs._upsampling
        assert (await http.delete(f"/v1/videos/{job_id}")).status_code == 200
        answer = await asyncio.wait_for(sync, 10)
        assert answer.status_code == 404, answer.text
        await asyncio.to_thread(client.chat_worker.stop, 1.0)
        created = await http.post("/v1/videos", data=data)
        done = await poll_job(http, created.json()["id"], timeout=30)
        assert done["status"] == "failed" and done["error"]["code"] == 503
        assert "Prompt upsampling failed" in done["error"]["message"]
        assert re.search(
            r'worldserve:request_failure_total\{[^}]*status="503"[^}]*\} 1\.0',
            (await http.get("/metrics")).text,
        )


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_image_whose_prompt_outlasts_the_sync_timeout_is_a_504(
    tmp_path, chat_backend, anyio_backend
):
    slow = UpsamplerConfig(max_chars=4000, max_subjects=3, max_actions=4, min_room=1024)
    async with asgi_server(tmp_path, chat_backend=chat_backend, upsampler=slow, sync_timeout_s=0.5) as http:
        r = await http.post("/v1/images/generations", json={"prompt": "a fox", "size": "32x32",
                                                            "extra_params": {"upsample_prompt": True}})  # fmt: skip
        assert r.status_code == 504 and "while its prompt was being written" in r.json()["error"]["message"]
        assert await _chat_stopped(chat_backend)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_realtime_session_streams_the_video_of_its_upsampled_prompt(
    tmp_path, pipeline, chat_backend, anyio_backend
):
    """/v1/realtime/video with `extra_params.upsample_prompt`: the Reasoner writes the prompt first
    (video.start's config shows it as `upsampled_prompt`) and the parts join into the video a session sent
    that prompt directly streams; a session.stop while the prompt is being written stops the chat."""
    import websockets

    from worldserve.api.app import build_app

    slow = UpsamplerConfig(max_chars=4000, max_subjects=3, max_actions=4, min_room=1024)
    for upsampler in (SMALL, slow):
        client = make_client(tmp_path / str(upsampler.max_chars), backend=pipeline, real_encoder=True,
                             chat_backend=chat_backend, upsampler=upsampler)  # fmt: skip
        with serve_app(build_app(client, shutdown_timeout_s=1.0)) as url:
            start = {"type": "session.start", "prompt": "a fox", "size": "32x32", "num_frames": 5, "fps": 8,
                     "num_inference_steps": 2, "seed": 7, "extra_params": {"upsample_prompt": True}}  # fmt: skip
            if upsampler is slow:
                async with websockets.connect(ws_url(url)) as ws:
                    await ws.send(json.dumps(start))
                    await asyncio.sleep(0.3)
                    await ws.send(json.dumps({"type": "session.stop"}))
                    done = json.loads(await ws.recv())
                assert done["type"] == "session.done" and done["stopped"] is True and done["chunks"] == 0
                assert await _chat_stopped(chat_backend)
                continue
            messages, data, _ = await realtime_session(url, start)
            config = messages[0]["config"]
            assert config["prompt"] == "a fox" and set(json.loads(config["upsampled_prompt"])) == KEYS
            assert messages[-1]["type"] == "session.done" and messages[-1]["stopped"] is False
            direct = {**start, "prompt": config["upsampled_prompt"], "extra_params": {}}
            messages, direct_data, _ = await realtime_session(url, direct)
            assert "upsampled_prompt" not in messages[0]["config"] and direct_data == data


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_realtime_upsampling_holds_its_queue_slot_and_is_counted(
    tmp_path, pipeline, chat_backend, anyio_backend
):
    """A session whose prompt the Reasoner writes is admitted before the upsampling and waits in the queue
    meanwhile, as a job does: with --max-queued-requests 1 a second session gets its 429 at once (not after
    the Reasoner's work); stopped meanwhile, it counts as cancelled; a written prompt past
    max_sequence_length counts as a failed request (400), as the job's failure does."""
    import websockets

    from worldserve.api.app import build_app

    slow = UpsamplerConfig(max_chars=4000, max_subjects=3, max_actions=4, min_room=1024)
    client = make_client(tmp_path, backend=pipeline, chat_backend=chat_backend, upsampler=slow,
                         max_queued_requests=1)  # fmt: skip
    with serve_app(build_app(client, shutdown_timeout_s=1.0)) as url:
        start = {"type": "session.start", "prompt": "a fox", "size": "32x32", "num_frames": 5, "fps": 8,
                 "num_inference_steps": 2, "extra_params": {"upsample_prompt": True}}  # fmt: skip
        async with websockets.connect(ws_url(url)) as ws, httpx.AsyncClient(base_url=url) as http:
            await ws.send(json.dumps(start))
            await _one_waiting(http, lambda: client.num_waiting)
            second, _, _ = await realtime_session(url, start)
            assert [(m["type"], m["code"]) for m in second] == [("error", 429)], second
            await ws.send(json.dumps({"type": "session.stop"}))
            done = json.loads(await ws.recv())
            assert done["type"] == "session.done" and done["stopped"] is True
            assert await _chat_stopped(chat_backend) and client.num_waiting == 0
            client.upsampler = SMALL
            too_long = {**start, "extra_params": {"upsample_prompt": True, "max_sequence_length": 150}}
            (failed,), _, _ = await realtime_session(url, too_long)
            assert failed["code"] == 400 and "Prompt upsampling failed" in failed["message"], failed
            metrics = (await http.get("/metrics")).text
        assert re.search(r'worldserve:request_failure_total\{[^}]*status="400"[^}]*\} 1\.0', metrics)
        assert re.search(r"worldserve:request_cancelled_total\{[^}]*\} 1\.0", metrics)
        assert re.search(r'worldserve:request_rejected_total\{[^}]*reason="queue_full"[^}]*\} 1\.0', metrics)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_image_batch_being_upsampled_holds_its_queue_slots(tmp_path, chat_backend, anyio_backend):
    """/v1/images/generations with upsample_prompt: its n requests are admitted before the Reasoner writes the
    prompt and wait in the queue meanwhile (a full queue answers the next request at once); past the sync
    timeout they count as one failed request (504), as vLLM-Omni counts a request of n images."""
    slow = UpsamplerConfig(max_chars=4000, max_subjects=3, max_actions=4, min_room=1024)
    async with asgi_server(tmp_path, chat_backend=chat_backend, upsampler=slow, sync_timeout_s=1.5,
                           max_queued_requests=2) as http:  # fmt: skip
        body = {"prompt": "a fox", "size": "32x32", "n": 2, "extra_params": {"upsample_prompt": True}}
        first = asyncio.ensure_future(http.post("/v1/images/generations", json=body))
        for _ in range(200):
            if http.engine_client.num_waiting == 2:
                break
            await asyncio.sleep(0.01)
        metrics = (await http.get("/metrics")).text
        assert re.search(r"worldserve:num_requests_waiting\{[^}]*\} 2\.0", metrics)
        second = await http.post("/v1/images/generations", json={**body, "n": 1})
        assert second.status_code == 429, second.text
        r = await first
        assert r.status_code == 504 and "while its prompt was being written" in r.json()["error"]["message"]
        metrics = (await http.get("/metrics")).text
        assert re.search(r'worldserve:request_failure_total\{[^}]*status="504"[^}]*\} 1\.0', metrics)
        assert http.engine_client.num_waiting == 0 and await _chat_stopped(chat_backend)

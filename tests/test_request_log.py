"""--enable-log-requests / --max-log-len (api/request_log.py): one INFO line a generating request, carrying the
id its answer carries, its prompt cut to --max-log-len characters and its parameters, for chats, text
completions and Responses over a real uvicorn (the tiny Reasoner) and for video jobs and images over the app;
nothing is logged without the flag."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from serving_helpers import SMALL_FORM, asgi_server, png_bytes, poll_job, serve_reasoner, wait_until
from test_serve_compat_flags import config

from worldserve.api.chat_messages import ChatMessageIn
from worldserve.api.request_log import RequestLog, chat_text, sampling
from worldserve.chat_params import ChatMessage, ChatParams
from worldserve.commands import serve
from worldserve.engine.fake_backend import FakeBackend
from worldserve.params import VideoParams

LOGGER = "worldserve.requests"


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_the_flags_reach_the_app_and_bad_lengths_are_refused():
    assert serve.app_settings(config()).request_log is None
    assert serve.app_settings(
        config("--enable-log-requests", "--max-log-len", "7")
    ).request_log == RequestLog(7)
    assert serve.app_settings(config("--enable-log-requests")).request_log == RequestLog(None)
    with pytest.raises(ValueError, match="--max-log-len must be >= 0"):
        config("--max-log-len", "-1")


def test_a_chat_shows_as_role_lines_and_its_sampling_as_what_differs(caplog):
    messages = [ChatMessageIn.model_validate(m) for m in (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                     {"type": "text", "text": "What is this?"}]},
    )]  # fmt: skip
    assert chat_text(messages) == "system: Be brief.\nuser: <image>What is this?"
    params = ChatParams(
        messages=(ChatMessage(role="user", content="x"),), temperature=0.5, seed=3, stop=("!",)
    )
    assert sampling(params) == {"max_tokens": None, "temperature": 0.5, "seed": 3, "stop": ("!",)}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        RequestLog(12).chat("chatcmpl-1", messages, params, 2, 40)
    [line] = _lines(caplog)
    assert line == ("Received request chatcmpl-1: prompt: 'system: Be b', params: max_tokens=None, "
                    "temperature=0.5, seed=3, stop=('!',), n=2, prompt_tokens: 40.")  # fmt: skip


@pytest.fixture(scope="module")
def served(reasoner, tmp_path_factory):
    from openai import OpenAI

    folder = tmp_path_factory.mktemp("request-log")
    with serve_reasoner(reasoner, folder, model="m", name="log-uvicorn", request_log=RequestLog(16)) as url:
        yield OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chats_completions_and_responses_are_logged_under_their_ids(served, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        chat = served.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Tell me about the sea, please"}], max_tokens=2,
            temperature=0, stream=True,
        )  # fmt: skip
        chat_id = next(iter(chat)).id
        list(chat)
        text = served.completions.create(model="m", prompt="Once upon a time there was", max_tokens=2, seed=5)
        resp = served.responses.create(model="m", input="Hello there, friend", max_output_tokens=2)
    chat_line, text_line, resp_line = _lines(caplog)
    assert chat_line.startswith(f"Received request {chat_id}: prompt: 'user: Tell me ab', params: max_tokens=2, "
                                "temperature=0.0")  # fmt: skip
    assert text_line.startswith(
        f"Received request {text.id}: prompt: 'Once upon a time', params: max_tokens=2, "
    )
    assert "seed=5" in text_line and text_line.endswith(
        "n=1, prompt_tokens: " + str(text.usage.prompt_tokens) + "."
    )
    assert resp_line.startswith(f"Received request {resp.id}: prompt: 'user: Hello ther'")


@pytest.mark.anyio
async def test_videos_and_images_are_logged_with_every_field(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        async with asgi_server(tmp_path, app_kw={"request_log": RequestLog()}) as http:
            job = (await http.post("/v1/videos", data={**SMALL_FORM, "prompt": "a red fox"})).json()
            image = await http.post("/v1/images/generations", json={"prompt": "a blue bird", "size": "64x64"})
            i2v_answer = await http.post("/v1/videos", data={**SMALL_FORM, "prompt": "it moves"},
                                         files={"input_reference": ("in.png", png_bytes(40, 30), "image/png")})  # fmt: skip
            i2v = i2v_answer.json()
        async with asgi_server(tmp_path / "quiet") as http:  # without the flag: nothing
            await http.post("/v1/videos", data={**SMALL_FORM, "prompt": "unlogged"})
    video_line, image_line, i2v_line = _lines(caplog)
    assert video_line.startswith(f"Received request {job['id']}: prompt: 'a red fox', params: ")
    assert "width=64, height=48, num_frames=5" in video_line and "num_inference_steps=2" in video_line
    assert image_line.startswith(f"Received request {image.headers['x-request-id']}: prompt: 'a blue bird'")
    assert "num_frames=1" in image_line
    assert i2v_line.startswith(f"Received request {i2v['id']}: prompt: 'it moves'") and len(i2v_line) < 2000
    assert i2v_line.endswith(  # its size, not its bytes; then the HTTP request's own id beside the job's
        f"reference='<{len(png_bytes(40, 30))} bytes>', request_id: {i2v_answer.headers['x-request-id']}."
    )
    with caplog.at_level(logging.INFO, logger=LOGGER):  # decoded frames (an image request's) show as a shape
        RequestLog().video("r", VideoParams(prompt="p", image=np.zeros((48, 64, 3), np.uint8)))
    assert "image='<48x64x3 array>'" in _lines(caplog)[-1]


@pytest.mark.anyio
async def test_a_request_the_full_queue_refuses_is_not_logged_as_received(tmp_path, caplog):
    """A 429 (queue full) is not a request received: an image request's line had been written before its
    admission, a video job's only once created; now both only once admitted."""
    backend = FakeBackend(step_delay=0.5)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        async with asgi_server(tmp_path, app_kw={"request_log": RequestLog()}, backend=backend,
                               max_queued_requests=1) as http:  # fmt: skip
            running = (await http.post("/v1/videos", data={**SMALL_FORM, "prompt": "runs"})).json()
            for _ in range(100):
                if (await http.get(f"/v1/videos/{running['id']}")).json()["status"] != "queued":
                    break
                await asyncio.sleep(0.02)
            held = (await http.post("/v1/videos", data={**SMALL_FORM, "prompt": "holds the queue"})).json()
            image = await http.post("/v1/images/generations", json={"prompt": "a blue bird", "size": "64x64"})
            video = await http.post("/v1/videos", data={**SMALL_FORM, "prompt": "refused too"})
            for job in (running, held):
                await http.delete(f"/v1/videos/{job['id']}")
    assert (image.status_code, video.status_code) == (429, 429), image.text
    received = [line.split(":")[0] for line in _lines(caplog) if line.startswith("Received request")]
    assert received == [f"Received request {running['id']}", f"Received request {held['id']}"], received


@pytest.mark.anyio
async def test_a_job_line_names_the_client_s_request_id_and_a_deleted_job_in_flight_is_aborted(
    tmp_path, caplog
):
    """The client's X-Request-Id shows beside the job id; DELETE of a job in flight logs vLLM's "Aborted
    request" line, of a finished one nothing more."""
    backend = FakeBackend(step_delay=0.5)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        async with asgi_server(tmp_path, app_kw={"request_log": RequestLog()}, backend=backend) as http:
            slow = (await http.post("/v1/videos", data={**SMALL_FORM, "prompt": "slow"},
                                    headers={"X-Request-Id": "client-7"})).json()  # fmt: skip
            await http.delete(f"/v1/videos/{slow['id']}")
            backend.step_delay = 0.0
            done = (await http.post("/v1/videos", data={**SMALL_FORM, "prompt": "quick"})).json()
            assert (await poll_job(http, done["id"]))["status"] == "completed"
            await http.delete(f"/v1/videos/{done['id']}")
    received, aborted, _ = _lines(caplog)
    assert received.startswith(f"Received request {slow['id']}: prompt: 'slow'")
    assert received.endswith(", request_id: client-7.")
    assert aborted in (f"Aborted request {slow['id']} (deleted while queued).",
                       f"Aborted request {slow['id']} (deleted while in_progress).")  # fmt: skip


def test_a_chat_its_client_leaves_is_logged_as_aborted(served, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        chat = served.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Count"}], max_tokens=400, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chat_id = next(iter(chat)).id
        chat.close()  # the client leaves mid-answer
        wait_until(lambda: any(line.startswith(f"Aborted request {chat_id} ") for line in _lines(caplog)))
    assert sum(line.startswith("Aborted request") for line in _lines(caplog)) == 1


@pytest.mark.anyio
async def test_a_realtime_session_is_logged_under_its_request_id(tmp_path, caplog):
    from serving_helpers import realtime_session, uvicorn_thread

    start = {"type": "session.start", "model": "test-model", "prompt": "waves at dusk", "size": "64x48",
             "num_frames": 9, "fps": 8, "num_inference_steps": 2}  # fmt: skip
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with uvicorn_thread(tmp_path, app_kw={"request_log": RequestLog(5)}) as (url, _):
            messages, _, _ = await realtime_session(url, start)
    [line] = _lines(caplog)
    assert line.startswith(f"Received request {messages[0]['request_id']}: prompt: 'waves', params: ")
    assert "num_frames=9" in line

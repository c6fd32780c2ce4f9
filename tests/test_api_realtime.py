"""WebSocket /v1/realtime/video over a real uvicorn with the `websockets` client: a whole session (metadata
and bytes in pairs, the joined parts one MP4 with its audio, decoded), session.stop, the client leaving,
ping / interaction / unknown messages beside a running request, every bad session.start (an error naming the
field, then the socket closed), the start and stall timeouts, a full queue, a failing decode, auth, I2V by a
data URL; and the same session on the tiny checkpoint's real pipeline."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import re
import threading
import time

import httpx
import pytest
import websockets
from media_probe import probe_mp4
from serving_helpers import (
    graceful_uvicorn,
    png_bytes,
    realtime_session,
    serve_app,
    uvicorn_thread,
    wait_until,
    ws_url,
)

from worldserve.api import realtime, realtime_start, ws_protocol
from worldserve.commands import serve_http
from worldserve.engine.fake_backend import FAIL_MARKER, FakeBackend
from worldserve.params import VideoParams

pytestmark = pytest.mark.anyio
SMALL = {"size": "64x48", "num_frames": 33, "fps": 8, "num_inference_steps": 2}


async def test_a_session_streams_one_mp4_in_parts(tmp_path):
    with uvicorn_thread(tmp_path, real_encoder=True) as (url, client):
        start = {"type": "session.start", "model": "test-model", "prompt": {"subjects": ["a cat"]}, **SMALL,
                 "sampling_params": {"seed": 3, "num_inference_steps": 5, "flow_shift": 7.0,
                                     "extra_params": {"guidance_interval": [0.5, 1.0]}}}  # fmt: skip
        messages, data, order = await realtime_session(url, start)
        assert client.list(after=None, limit=None, order="desc")[0] == [], "no job is stored"
    first, *chunks, done = messages
    assert first["type"] == "video.start" and first["format"] == "m4s"
    assert first["request_id"].startswith("video_stream-")
    # vLLM-Omni's merge: sampling_params fill the request fields it omits (seed, flow_shift); the rest go to
    # extra_params, whose keys win over the top level, as for POST /v1/videos: the config shows the 5 steps
    # the video is made with (it had echoed the top level's 2)
    config = first["config"]
    assert (config["seed"], config["flow_shift"], config["num_inference_steps"]) == (3, 7.0, 5)
    assert config["extra_params"]["num_inference_steps"] == 5
    assert config["extra_params"]["guidance_interval"] == [0.5, 1.0]
    assert first["config"]["prompt"] == '{"subjects":["a cat"]}'
    assert done == {"type": "session.done", "request_id": first["request_id"], "chunks": len(chunks),
                    "stopped": False}  # fmt: skip
    # each part: its metadata, then its bytes
    assert [kind for kind, _ in order[1:-1]] == ["json", "bytes"] * len(chunks)
    sizes = [size for kind, size in order if kind == "bytes"]
    assert [c["byte_length"] for c in chunks] == sizes
    assert [c["transport_chunk_index"] for c in chunks] == list(range(len(chunks)))
    # frame 0 and 16-frame chunks: the init segment, then each fragment once the next chunk's keyframe is out
    assert [c["num_frames"] for c in chunks] == [0, 1, 16, 16]
    assert data[4:8] == b"ftyp"
    probe = probe_mp4(data)
    assert (probe.video_codec, probe.width, probe.height, probe.num_frames) == ("h264", 64, 48, 33)
    assert (probe.audio_codec, probe.sample_rate, probe.channels) == ("aac", 48000, 2)
    assert client.engine.backend.live == set() and first["request_id"] in client.engine.backend.released


async def test_stop_and_client_leaving_abort_the_request(tmp_path):
    backend = FakeBackend(step_delay=0.05)
    with uvicorn_thread(tmp_path, backend=backend, app_kw={"server_load_tracking": True}) as (url, client):
        start = {"type": "session.start", "prompt": "x", **SMALL, "num_inference_steps": 200}

        async def stop(ws):
            await ws.send(json.dumps({"type": "session.ping"}))
            await ws.send(json.dumps({"type": "session.stop"}))

        messages, data, _ = await realtime_session(url, start, during=stop)
        assert [m["type"] for m in messages] == ["video.start", "session.pong", "session.done"]
        assert messages[-1]["stopped"] is True and messages[-1]["chunks"] == 0 and data == b""
        engine = (
            client.engine
        )  # (stopped before or after the engine prepared it: a loaded host may do either)
        wait_until(lambda: not backend.live and engine.num_running == 0 and engine.num_waiting == 0)
        assert backend.batch_sizes.count(1) < 200  # (not run to its end)

        async with websockets.connect(ws_url(url)) as ws:  # the client leaves while its request runs
            await ws.send(json.dumps(start))
            request_id = json.loads(await ws.recv())["request_id"]
            wait_until(lambda: request_id in backend.live)
            assert httpx.get(url + "/load").json() == {"server_load": 1}  # a session counts (it had not)
        wait_until(lambda: request_id in backend.released and not backend.live)
        wait_until(lambda: httpx.get(url + "/load").json() == {"server_load": 0})
        wait_until(lambda: client.engine.num_running == 0)  # (counted again just after the release)


async def test_control_messages_beside_a_running_request(tmp_path):
    with uvicorn_thread(tmp_path, backend=FakeBackend(step_delay=0.02), real_encoder=True) as (url, _):
        start = {"type": "session.start", "prompt": "x", **SMALL, "num_inference_steps": 30}

        async def talk(ws):
            await ws.send(
                json.dumps({"type": "session.interaction", "interaction": {"event": {"prompt": "y"}}})
            )
            await ws.send(json.dumps({"type": "session.dance"}))
            await ws.send("{not json")
            await ws.send(b"\x00\x01")
            await ws.send("[1]")
            await ws.send(json.dumps({"type": "session.ping"}))
            await ws.send(json.dumps(start))

        messages, data, _ = await realtime_session(url, start, during=talk)
    kinds = [m["type"] for m in messages if m["type"] != "video.chunk_metadata"]
    assert kinds == [
        "video.start",
        "error",
        "error",
        "error",
        "error",
        "error",
        "session.pong",
        "error",
        "session.done",
    ]
    errors = [m["message"] for m in messages if m["type"] == "error"]
    assert (
        "session.interaction is not supported" in errors[0]
        and errors[1] == "Unknown message type: session.dance"
    )
    assert errors[2:] == ["Invalid JSON message", "WebSocket messages must be JSON text",
                          "WebSocket messages must be JSON objects",
                          "The session has started: one session.start per session"]  # fmt: skip
    assert all(m["code"] == 400 for m in messages if m["type"] == "error")
    # the messages whose `type` is wrong name it, as a bad session.start's error names its field
    params = [m.get("param") for m in messages if m["type"] == "error"]
    assert params == ["type", "type", None, None, None, "type"]
    assert messages[-1]["stopped"] is False and probe_mp4(data).num_frames == 33


@pytest.mark.parametrize(
    ("start", "message", "param"),
    [
        ("{nope", "Invalid JSON in session.start", None),
        ("[]", "session.start must be a JSON object", None),
        ({"type": "session.begin"}, "Expected session.start, got: session.begin", "type"),
        ({"type": "session.start", "prompt": "x", "format": "mp4"}, "Invalid session.start format", "format"),
        ({"type": "session.start", "prompt": "x", "size": "big"}, "size", "size"),
        ({"type": "session.start", "prompt": "x", "model": "other"}, "Model mismatch", "model"),
        ({"type": "session.start", "prompt": "x", "input_reference": "cat.png"}, "must be a file upload",
         "input_reference"),
        ({"type": "session.start", "prompt": "x", "sampling_params": [1]}, "sampling_params must be",
         "sampling_params"),
        ({"type": "session.start", "prompt": "x", "extra_params": "{bad", "sampling_params": {"a": 1}},
         "Invalid JSON", "extra_params"),
        ({"type": "session.start", "prompt": "x", "extra_params": {"video_codec_options": {"tune": "loud"}}},
         "video_codec_options.tune", "extra_params.video_codec_options"),
        ({"type": "session.start", "prompt": "x", "extra_params": {"video_codec_options": {"bf": 2}}},
         "bf must be 0 on /v1/realtime/video", "extra_params.video_codec_options"),
        ({"type": "session.start", "prompt": "x", "extra_params": {"upsample_prompt": True}},
         "prompt upsampling needs the Reasoner", "extra_params.upsample_prompt"),
        ({"type": "session.start", "prompt": "x", "extra_params": {"edge": True}}, "transfer/action",
         "extra_params.edge"),
        # a value sent in sampling_params is named there, not by the field vLLM-Omni's merge filled with it
        ({"type": "session.start", "prompt": "x", "sampling_params": {"num_inference_steps": -3}}, "",
         "sampling_params.num_inference_steps"),
        ({"type": "session.start", "prompt": "x", "num_inference_steps": 2,
          "sampling_params": {"num_inference_steps": -3}}, "", "sampling_params.num_inference_steps"),
        ({"type": "session.start", "prompt": "x", "sampling_params": {"video_codec_options": {"bf": 2}}},
         "bf must be 0", "sampling_params.video_codec_options"),
        ({"type": "session.start", "prompt": "x", "sampling_params": {"extra_params": {"seed": "s"}}}, "",
         "sampling_params.extra_params.seed"),
    ],
)  # fmt: skip
async def test_bad_starts_get_an_error_naming_the_field_and_a_close(tmp_path, start, message, param):
    with uvicorn_thread(tmp_path) as (url, client):
        messages, data, order = await realtime_session(url, start)
        assert client.engine.num_waiting == 0 and client.engine.backend.batch_sizes == []
    assert len(messages) == 1 and data == b"", messages
    error = messages[0]
    assert error["type"] == "error" and message in error["message"] and error["code"] == 400
    assert error.get("param") == param


async def test_start_timeout_size_limit_queue_full_and_a_failed_decode(tmp_path, monkeypatch):
    monkeypatch.setattr(realtime_start, "START_TIMEOUT_S", 0.2)
    with uvicorn_thread(tmp_path, real_encoder=True, app_kw={"max_upload_bytes": 200}) as (url, client):
        async with websockets.connect(ws_url(url)) as ws:
            assert json.loads(await ws.recv()) == {
                "type": "error",
                "message": "Timeout waiting for session.start",
                "code": 408,
            }
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
        wide = json.dumps({"type": "session.start", "prompt": "é" * 90}, ensure_ascii=False)  # 129 characters
        for big in ({"type": "session.start", "prompt": "x" * 200}, wide):  # (the bytes count: 219 of them)
            assert (await realtime_session(url, big))[0] == [{"type": "error", "code": 413, "message":
                "session.start message exceeds the 0.000191 MiB limit (--max-upload-mb)"}]  # fmt: skip
        metrics = httpx.get(f"{url}/metrics").text  # (counted as POST /v1/videos counts a body too large)
        assert re.search(r'worldserve:request_rejected_total\{[^}]*reason="too_large"[^}]*\} 2\.0', metrics)
        failing = {"type": "session.start", "prompt": f"x {FAIL_MARKER}decode_stream", **SMALL}
        messages, data, _ = await realtime_session(url, failing)
        # (the init segment may or may not go out first: a failed decode drops the chunks not yet muxed)
        assert messages[0]["type"] == "video.start"
        assert {m["type"] for m in messages[1:-1]} <= {"video.chunk_metadata"}
        assert messages[-1]["type"] == "error" and messages[-1]["code"] == 500
        assert "injected failure at decode_stream" in messages[-1]["message"]
    backend = FakeBackend(step_delay=0.05)
    with uvicorn_thread(tmp_path / "q", backend=backend, max_queued_requests=1) as (url, client):
        form = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "200"}
        jobs = [
            httpx.post(f"{url}/v1/videos", data=form).json()["id"] for _ in range(2)
        ]  # one runs, one waits
        wait_until(lambda: client.num_running == 1 and client.num_waiting == 1)
        messages, _, _ = await realtime_session(url, {"type": "session.start", "prompt": "x", **SMALL})
        assert messages == [{"type": "error", "message": "Too many queued requests (1); retry later.",
                             "code": 429, "retry_after_s": 1}]  # fmt: skip
        for job in jobs:
            httpx.delete(f"{url}/v1/videos/{job}")


async def test_a_start_may_be_as_large_as_a_request_body(tmp_path):
    """A session.start may be as large as --max-upload-mb lets a POST /v1/videos body be (an inline
    reference); uvicorn's own 16 MiB WebSocket limit had closed one of 17 MiB with 1009 before the session
    read it. Past the limit, up to OVERSIZE_BYTES more, the start gets the 413 naming the flag; larger, the
    protocol's 1009 (message too big) closes the socket before it is buffered."""
    pad = {"pad": "x" * (17 << 20)}  # (extra_params keys Cosmos3 does not read pass, as in vLLM-Omni)
    big = json.dumps({"type": "session.start", "prompt": "x", **SMALL, "extra_params": pad})
    with uvicorn_thread(tmp_path) as (url, _):  # (serve's WebSocket size for the default 100 MiB)
        messages, _, _ = await realtime_session(url, big)
    assert [messages[0]["type"], messages[-1]["type"]] == ["video.start", "session.done"]
    limit = 1 << 16
    options = serve_http.uvicorn_options(argparse.Namespace(), limit)
    with uvicorn_thread(tmp_path, uvicorn_options=options, app_kw={"max_upload_bytes": limit}) as (url, _):
        over = json.dumps({"type": "session.start", "prompt": "x" * limit})
        assert (await realtime_session(url, over))[0] == [{"type": "error", "code": 413, "message":
            "session.start message exceeds the 0.0625 MiB limit (--max-upload-mb)"}]  # fmt: skip
        async with websockets.connect(ws_url(url), max_size=None) as ws:
            await ws.send(
                json.dumps({"type": "session.start", "prompt": "x" * (limit + realtime.OVERSIZE_BYTES)})
            )
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


async def test_a_start_too_big_for_the_socket_counts_as_a_rejection(tmp_path):
    """A session.start past the socket's size (`ws_max_size`) is closed by the protocol with 1009 before the
    app reads it: it was counted nowhere, where the same body on POST /v1/videos counts as a too_large
    rejection (as the 413 of a start just past --max-upload-mb does). A control message too big for the
    socket, once the request is queued, is no rejection: its request is cancelled."""
    limit = 1 << 16
    options = serve_http.uvicorn_options(argparse.Namespace(), limit)
    rejected = re.compile(r'worldserve:request_rejected_total\{[^}]*reason="too_large"[^}]*\} (\d+)\.0')
    backend = FakeBackend(step_delay=0.05)
    with uvicorn_thread(tmp_path, backend=backend, uvicorn_options=options,
                        app_kw={"max_upload_bytes": limit}) as (url, _):  # fmt: skip
        assert rejected.search(httpx.get(f"{url}/metrics").text).group(1) == "0"  # (exported from the start)
        huge = "x" * (limit + realtime.OVERSIZE_BYTES)
        async with websockets.connect(ws_url(url), max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.start", "prompt": huge}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        wait_until(lambda: rejected.search(httpx.get(f"{url}/metrics").text).group(1) == "1")
        async with websockets.connect(ws_url(url), max_size=None) as ws:
            await ws.send(
                json.dumps({"type": "session.start", "prompt": "x", **SMALL, "num_inference_steps": 200})
            )
            assert json.loads(await ws.recv())["type"] == "video.start"
            await ws.send(json.dumps({"type": "session.ping", "pad": huge}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        cancelled = re.compile(r"worldserve:request_cancelled_total\{[^}]*\} 1\.0")
        wait_until(lambda: cancelled.search(httpx.get(f"{url}/metrics").text))
        assert rejected.search(httpx.get(f"{url}/metrics").text).group(1) == "1"


async def test_video_start_echoes_the_request_as_its_video_is_made(tmp_path):
    """video.start's config had echoed the request model as the client sent it (vLLM-Omni's model_dump): the
    server's defaults, the frames `seconds` makes, the width and height of `size` left out, and a value that
    extra_params overrode shown as sent at the top level. It now shows the values the video is made with;
    the fields the HTTP job object has, as GET /v1/videos/{id} shows them for the same request."""
    fields = {"prompt": "a cat", "size": "64x48", "seconds": "2", "fps": "8", "guidance_scale": "0",
              "seed": "7", "extra_params": {"seed": 9}}  # fmt: skip
    with uvicorn_thread(tmp_path, app_kw={"video_defaults": {"num_inference_steps": 3}}) as (url, _):
        messages, _, _ = await realtime_session(url, {"type": "session.start", **fields})
        job = httpx.post(f"{url}/v1/videos", json=fields).json()
        httpx.delete(f"{url}/v1/videos/{job['id']}")
    assert messages[0]["type"] == "video.start", messages
    config = messages[0]["config"]
    resolved = {
        "model": "test-model", "prompt": "a cat", "size": "64x48", "width": 64, "height": 48, "seconds": "2",
        # (2 s x 8 fps, to the nearest 4k+1; guidance 0 is Cosmos3's "not given"; extra_params' seed wins)
        "num_frames": 17, "fps": 8.0, "quality": "default", "num_inference_steps": 3, "guidance_scale": 6.0,
        "seed": 9, "flow_shift": VideoParams(prompt="x", width=64, height=48).resolved_flow_shift(),
        "max_sequence_length": VideoParams(prompt="x").max_sequence_length, "generate_sound": True,
    }  # fmt: skip
    assert {k: config.get(k) for k in resolved} == resolved
    shown = ("model", "prompt", "size", "seconds", "quality", "fps", "num_frames")
    assert {k: config[k] for k in shown} == {k: job[k] for k in shown}
    assert "negative_prompt" not in config and "lora" not in config
    extra = config["extra_params"]
    assert extra["seed"] == 9 and extra["video_codec_options"] == {"tune": "zerolatency"}
    assert (extra["use_duration_template"], extra["negative_metadata_mode"], extra["upsample_prompt"]) == (
        True, "same", False)  # fmt: skip


async def test_a_running_request_without_progress_stalls(tmp_path, monkeypatch):
    monkeypatch.setattr(realtime, "STALL_TIMEOUT_S", 0.3)
    monkeypatch.setattr(realtime, "POLL_S", 0.05)
    backend = FakeBackend(step_delay=1.0)
    with uvicorn_thread(tmp_path, backend=backend) as (url, _):

        async def ping(ws):  # (then read to the close: pongs, the error, then session.done)
            with contextlib.suppress(websockets.ConnectionClosed):  # (the stall closes the socket)
                for _ in range(10):  # pings are not progress: they keep no stalled request alive
                    await ws.send(json.dumps({"type": "session.ping"}))
                    await asyncio.sleep(0.1)

        start = {"type": "session.start", "prompt": "x", **SMALL}
        messages, _, _ = await realtime_session(url, start, during=ping)
        pongs = [m for m in messages if m["type"] == "session.pong"]
        assert len(pongs) < 10, "the stall ended the session while the client was still pinging"
        messages = [m for m in messages if m["type"] != "session.pong"]
        assert [m["type"] for m in messages] == ["video.start", "error", "session.done"]
        assert (
            messages[1]["message"] == "Stall timeout: no generation progress" and messages[1]["code"] == 504
        )
        assert messages[2]["stopped"] is True and messages[2]["chunks"] == 0
        wait_until(lambda: not backend.live)


async def test_a_video_made_whole_but_never_sent_counts_as_cancelled(tmp_path, monkeypatch):
    """The parts are made ahead of the socket: a client that reads nothing while the whole (short) video is
    decoded and muxed, then times out, got none of it; its request had been counted a success. Its finish is
    held until the last part is sent (HeldFinish) and counts as cancelled here."""
    monkeypatch.setattr(realtime, "SEND_TIMEOUT_S", 0.5)
    send_now = realtime._Session._send_now
    made = threading.Event()

    async def stalled(self, messages):
        if any(isinstance(m, bytes) for m in messages):
            await asyncio.to_thread(made.wait, 10)  # (the request ended: every part was made)
            await asyncio.sleep(30)
        await send_now(self, messages)

    monkeypatch.setattr(realtime._Session, "_send_now", stalled)
    backend = FakeBackend()
    with uvicorn_thread(tmp_path, backend=backend, real_encoder=True) as (url, client):
        real_deliver = client.engine._ends.hand_over

        def hand_over(request, result):
            real_deliver(request, result)
            made.set()

        monkeypatch.setattr(client.engine._ends, "hand_over", hand_over)
        start = {"type": "session.start", "prompt": "x", **SMALL, "num_frames": 9}
        messages, data, _ = await realtime_session(url, start, during=lambda ws: asyncio.sleep(0))
        assert [m["type"] for m in messages] == ["video.start"] and data == b"" and made.is_set()
        cancelled = re.compile(r"worldserve:request_cancelled_total\{[^}]*\} 1\.0")
        wait_until(lambda: cancelled.search(httpx.get(url + "/metrics").text))
        metrics = httpx.get(url + "/metrics").text
        assert not re.search(r"worldserve:request_success_total\{[^}]*\} [1-9]", metrics)
        # a session that sends every part counts its success once session.done is out
        monkeypatch.setattr(realtime._Session, "_send_now", send_now)
        messages, data, _ = await realtime_session(url, start, during=lambda ws: asyncio.sleep(0))
        assert messages[-1]["type"] == "session.done" and data
        success = re.compile(r"worldserve:request_success_total\{[^}]*\} 1\.0")
        wait_until(lambda: success.search(httpx.get(url + "/metrics").text))


@pytest.mark.parametrize("failure", ["closed", "not reading"])
async def test_a_part_that_cannot_be_sent_aborts_the_request_and_its_encode(tmp_path, monkeypatch, failure):
    """uvicorn raises RuntimeError on a send to a socket it has closed; a client that reads nothing blocks
    a send: past SEND_TIMEOUT_S the session ends. Either way the request is aborted (its decode and encode
    stop, at the next chunk) and the server goes on serving."""
    monkeypatch.setattr(realtime, "SEND_TIMEOUT_S", 0.2)
    send_now = realtime._Session._send_now

    async def failing(self, messages):
        if any(isinstance(m, bytes) for m in messages):
            if failure == "closed":
                raise RuntimeError('Cannot call "send" once a close message has been sent.')
            await asyncio.sleep(30)
        await send_now(self, messages)

    monkeypatch.setattr(realtime._Session, "_send_now", failing)
    backend = FakeBackend(
        decode_chunk_delay=0.3
    )  # (0.1 s chunks could all be made before a loaded host aborts)
    with uvicorn_thread(tmp_path, backend=backend, real_encoder=True) as (url, client):
        # 193 frames: 13 chunks, ~3.9 s of decode if nothing stops it (97 frames' 1.8 s could all be made
        # before a heavily loaded 2-core host had aborted)
        start = {"type": "session.start", "prompt": "x", **SMALL, "num_frames": 193}
        messages, data, _ = await realtime_session(url, start, during=lambda ws: asyncio.sleep(0))
        assert [m["type"] for m in messages] == ["video.start"] and data == b""
        wait_until(lambda: not backend.live and client.engine.num_running == 0)
        assert backend.decoded_chunks < 13, "the decode stopped early"
        cancelled = re.compile(r"worldserve:request_cancelled_total\{[^}]*\} 1\.0")  # (the encode ends last)
        wait_until(lambda: cancelled.search(httpx.get(url + "/metrics").text))
        metrics = httpx.get(url + "/metrics").text  # cancelled, not finished (it had been counted a success)
        assert not re.search(r"worldserve:request_success_total\{[^}]*\} [1-9]", metrics)
        monkeypatch.setattr(realtime._Session, "_send_now", send_now)
        messages, data, _ = await realtime_session(url, {"type": "session.start", "prompt": "x", **SMALL})
        assert messages[-1]["type"] == "session.done" and probe_mp4(data).num_frames == 33


async def test_a_close_that_cannot_be_sent_drops_the_connection(tmp_path, monkeypatch):
    """A client that reads nothing never lets the close frame out (it waits behind the unread parts): the
    socket and the session's task had outlived the session, and a shutdown waited for uvicorn's task
    cancellation. Past ABORT_AFTER_S the connection is dropped (the close is made to hang here, as it does
    behind a full send buffer)."""
    from starlette.websockets import WebSocket

    monkeypatch.setattr(realtime, "ABORT_AFTER_S", 0.3)

    async def never_sent(self, code=1000, reason=None):
        await asyncio.sleep(60)

    monkeypatch.setattr(WebSocket, "close", never_sent)
    aborted = []  # (the app found the transport the server's protocol handed it, and dropped it)
    monkeypatch.setattr(
        realtime, "abort_connection", lambda ws: aborted.append(ws_protocol.abort_connection(ws))
    )
    with uvicorn_thread(tmp_path, real_encoder=True) as (url, _):
        async with websockets.connect(ws_url(url), max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.start", "prompt": "x", **SMALL}))
            started = None
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    raw = await asyncio.wait_for(ws.recv(), 30)
                    if isinstance(raw, str) and json.loads(raw)["type"] == "session.done":
                        started = time.monotonic()
            assert started is not None and time.monotonic() - started < 10
            assert closed.value.rcvd is None and aborted == [True]  # (dropped: no close frame came)


def test_a_client_that_reads_nothing_is_dropped_once_its_session_ends(tmp_path, monkeypatch):
    """A real client that reads nothing (a raw socket after the handshake): the server's sends fill the
    socket's buffers, the send timeout ends the session, the close frame cannot go out, and the connection
    is dropped rather than held open (the audit saw it held until the client left, and a shutdown wait ~40 s
    for it). The parts are made large (a 16 MiB first message) so that the buffers fill at once."""
    _bulky_first_part(monkeypatch)
    with uvicorn_thread(tmp_path) as (url, client):
        with _unread_session(url) as raw:
            time.sleep(3)  # (reading nothing: the session's send times out, its close cannot go out)
            got, took = _read_to_the_end(raw)
            assert got < 16 * 2**20  # the connection ended before the whole first message could come
            assert took < 5  # (dropped: it had stayed open until the header timeout, ~100 s)
        wait_until(lambda: client.engine.num_running == 0)


def test_a_shutdown_drops_a_socket_its_app_left_open_and_its_client_does_not_read(tmp_path, monkeypatch):
    """The protocol's own last resort (ws_protocol's late close): a session still open CLOSE_MARGIN_S before
    uvicorn would cancel the app (here an app stuck in its close) is closed with uvicorn's 1012, and its
    connection dropped ABORT_AFTER_S later when the close cannot flush (a client reading nothing): without
    the drop the connection outlived the shutdown's deadline."""
    _bulky_first_part(monkeypatch)
    monkeypatch.setattr(ws_protocol, "CLOSE_MARGIN_S", 10.5)  # (grace 1 + 10 s: the late close at 0.5 s)
    monkeypatch.setattr(ws_protocol, "ABORT_AFTER_S", 0.3)
    stuck = []

    async def stuck_close(self):
        stuck.append(self)
        await asyncio.sleep(3)  # (neither closes nor drops its socket)

    monkeypatch.setattr(realtime._Session, "_close", stuck_close)
    with graceful_uvicorn(tmp_path, 1.0) as (url, client, terminate):
        with _unread_session(url) as raw:
            wait_until(lambda: stuck)  # (the session ended by its send timeout, its socket left open)
            terminate()
            got, took = _read_to_the_end(raw)
            assert got < 16 * 2**20 and took < 5  # dropped at 0.8 s, not left to the 11 s deadline


def _bulky_first_part(monkeypatch) -> None:
    """A 16 MiB message before video.start (more than loopback's buffers hold), sends timing out in 0.5 s."""
    monkeypatch.setattr(realtime, "SEND_TIMEOUT_S", 0.5)
    monkeypatch.setattr(realtime, "ABORT_AFTER_S", 0.3)
    send_now = realtime._Session._send_now

    async def bulky(self, messages):
        if any(isinstance(m, dict) and m.get("type") == "video.start" for m in messages):
            await self.ws.send_bytes(bytes(16 * 2**20))
        await send_now(self, messages)

    monkeypatch.setattr(realtime._Session, "_send_now", bulky)


@contextlib.contextmanager
def _unread_session(url: str):
    """A raw socket to /v1/realtime/video that shakes hands, sends a session.start and reads nothing."""
    import base64 as b64
    import os
    import socket

    host, port = url.removeprefix("http://").split(":")
    key = b64.b64encode(os.urandom(16)).decode()
    with socket.create_connection((host, int(port))) as raw:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.sendall((f"GET /v1/realtime/video HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
                     f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())  # fmt: skip
        assert raw.recv(4096).startswith(b"HTTP/1.1 101")
        start = json.dumps({"type": "session.start", "prompt": "x", **SMALL}).encode()
        mask = os.urandom(4)
        raw.sendall(bytes([0x81, 0x80 | 126]) + len(start).to_bytes(2, "big") + mask
                    + bytes(b ^ mask[i % 4] for i, b in enumerate(start)))  # fmt: skip
        yield raw


def _read_to_the_end(raw) -> tuple[int, float]:
    """Read what the buffers held until the connection ends: (bytes read, seconds it took)."""
    raw.settimeout(10)
    got, t0 = 0, time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        while chunk := raw.recv(1 << 20):
            got += len(chunk)
    return got, time.monotonic() - t0


async def test_auth_and_an_image_reference(tmp_path):
    with uvicorn_thread(tmp_path, api_key="sekret", real_encoder=True) as (url, _):
        with pytest.raises(websockets.InvalidStatus) as refused:
            await realtime_session(url, {"type": "session.start", "prompt": "x", **SMALL})
        assert refused.value.response.status_code == 401
        image = "data:image/png;base64," + base64.b64encode(png_bytes(64, 48)).decode()
        start = {"type": "session.start", "prompt": "x", **SMALL, "image_reference": {"image_url": image}}
        messages, data, _ = await realtime_session(url, start, headers={"Authorization": "Bearer sekret"})
        assert messages[-1]["type"] == "session.done" and "image_reference" not in messages[0]["config"]
        assert probe_mp4(data).num_frames == 33


async def test_the_tiny_checkpoint_streams_over_a_real_socket(tmp_path, tiny_ckpt):
    from serving_helpers import make_client

    from worldserve.api.app import build_app
    from worldserve.runner.video_pipeline import VideoPipeline

    pipeline = await asyncio.to_thread(VideoPipeline.from_pretrained, tiny_ckpt, device="cpu", progress=False)
    client = make_client(tmp_path, backend=pipeline, real_encoder=True)
    with serve_app(build_app(client, shutdown_timeout_s=1.0)) as url:
        start = {"type": "session.start", "prompt": "a cat", "size": "32x32", "num_frames": 21, "fps": 8,
                 "num_inference_steps": 2, "seed": 5}  # fmt: skip
        messages, data, _ = await realtime_session(url, start)
    assert messages[-1]["type"] == "session.done" and messages[-1]["stopped"] is False
    # the init segment, frame 0, then 4 frames per latent frame of a decode chunk (2 latent frames)
    assert [m["num_frames"] for m in messages[1:-1]] == [0, 1, 8, 8, 4]
    probe = probe_mp4(data)
    assert (probe.width, probe.height, probe.num_frames, probe.audio_codec) == (32, 32, 21, "aac")


async def test_a_server_without_handshake_responses_refuses_an_unauthorized_socket():
    """Where the ASGI server cannot answer a WebSocket handshake with an HTTP response (no
    `websocket.http.response` extension), the key check closes it instead (the server answers 403)."""
    from worldserve.api.auth import APIKeyMiddleware

    async def app(scope, receive, send):
        raise AssertionError("reached the app without a key")

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/realtime/video", "headers": [], "extensions": {}}
    await APIKeyMiddleware(app, api_keys=["sekret"])(scope, None, send)
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "Unauthorized"}]


async def test_the_server_never_deflates_the_sockets_video(tmp_path):
    """`worldserve serve`'s uvicorn options (serve_app's defaults) decline permessage-deflate, which a
    `websockets` client offers and uvicorn's default accepts: zlib cannot shrink H.264 and took longer per part
    than the VAE's decode."""
    extensions = {}
    for name, options in (("uvicorn", {"ws_per_message_deflate": True}), ("worldserve", {})):
        with uvicorn_thread(tmp_path / name, uvicorn_options=options) as (url, _):
            async with websockets.connect(ws_url(url)) as ws:  # (offers permessage-deflate, as by default)
                extensions[name] = ws.response.headers.get("Sec-WebSocket-Extensions")
    assert extensions["uvicorn"] and "permessage-deflate" in extensions["uvicorn"]  # what it would negotiate
    assert extensions["worldserve"] is None


async def _next_message(ws) -> dict:
    """The next JSON message (parts' bytes skipped)."""
    while isinstance(raw := await asyncio.wait_for(ws.recv(), 10), bytes):
        pass
    return json.loads(raw)


async def _to_the_end(ws) -> tuple[list[dict], bytes, int]:
    """Read until the server closes: (JSON messages, the parts joined, the close code)."""
    messages, parts = [], []
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            raw = await asyncio.wait_for(ws.recv(), 20)
            if isinstance(raw, bytes):
                parts.append(raw)
            else:
                messages.append(json.loads(raw))
    return messages, b"".join(parts), ws.close_code


async def _one_running_one_queued(running, queued, client, start) -> None:
    """`start` on `running` until its request runs, then on `queued` (its request waits behind it)."""
    await running.send(json.dumps(start))
    assert (await _next_message(running))["type"] == "video.start"
    await asyncio.to_thread(wait_until, lambda: client.num_running == 1)
    await queued.send(json.dumps(start))
    assert (await _next_message(queued))["type"] == "video.start"


async def test_a_graceful_shutdown_gives_a_running_stream_its_grace(tmp_path):
    """SIGTERM (`worldserve serve`'s GracefulServer, 6 s --shutdown-timeout): the session whose video is being
    made streams it to its end and closes normally; one still queued and one that has not sent session.start
    get the shutdown's 503 error at once and a 1012 close. (uvicorn closed every socket with 1012 at once, so
    the running video was lost.)"""
    backend = FakeBackend(step_delay=0.05)
    start = {"type": "session.start", "prompt": "x", **SMALL, "num_inference_steps": 60}  # 3 s of steps
    with graceful_uvicorn(tmp_path, 6.0, backend=backend, real_encoder=True) as (url, client, terminate):
        async with (websockets.connect(ws_url(url), max_size=None) as running,
                    websockets.connect(ws_url(url)) as queued, websockets.connect(ws_url(url)) as idle):  # fmt: skip
            await _one_running_one_queued(running, queued, client, start)
            terminate()
            for ws in (idle, queued):
                messages, _, code = await _to_the_end(ws)  # (its waits are the hang guard)
                assert messages[-1]["type"] == "error" and messages[-1]["code"] == 503
                assert "the server is shutting down" in messages[-1]["message"]
                assert code == 1012
                # at once, not when the running one ends: it is still running, its 60 steps not all done
                assert client.num_running == 1 and backend.steps_done < 60
            messages, data, code = await _to_the_end(running)
    assert messages[-1]["type"] == "session.done" and messages[-1]["stopped"] is False and code == 1000
    assert probe_mp4(data).num_frames == 33


async def test_a_queued_session_is_refused_while_the_engine_is_inside_a_long_step(tmp_path):
    """The queued session's 503 comes within a poll of the SIGTERM even while the engine thread is inside a
    step it cannot leave (a long CPU step or decode): the audit saw it come only when the running request
    ended, 9-10 s later on the tiny model."""
    backend = FakeBackend(step_delay=4.0)
    start = {"type": "session.start", "prompt": "x", **SMALL, "num_inference_steps": 3}
    with graceful_uvicorn(tmp_path, 20.0, backend=backend) as (url, client, terminate):
        async with (websockets.connect(ws_url(url), max_size=None) as running,
                    websockets.connect(ws_url(url)) as queued):  # fmt: skip
            await _one_running_one_queued(running, queued, client, start)
            terminate()
            t0 = time.monotonic()
            messages, _, code = await _to_the_end(queued)
            assert messages[-1]["type"] == "error" and messages[-1]["code"] == 503 and code == 1012
            assert time.monotonic() - t0 < 3.0 and backend.steps_done < 3  # (a poll, not the running video)


async def test_a_stream_outlasting_the_grace_ends_with_an_error_and_1012(tmp_path):
    """The video still running at the --shutdown-timeout deadline is aborted: its session gets the error
    (503, the server is shutting down) and a 1012 close, before uvicorn would cancel it."""
    backend = FakeBackend(step_delay=0.2)
    start = {"type": "session.start", "prompt": "x", **SMALL, "num_inference_steps": 200}  # 40 s
    with graceful_uvicorn(tmp_path, 1.0, backend=backend) as (url, client, terminate):
        async with websockets.connect(ws_url(url)) as ws:
            await ws.send(json.dumps(start))
            assert (m := await _next_message(ws))["type"] == "video.start", m
            await asyncio.to_thread(wait_until, lambda: client.num_running == 1)
            terminate()
            t0 = time.monotonic()
            messages, _, code = await _to_the_end(ws)
            took, steps = time.monotonic() - t0, backend.steps_done
    assert [m["type"] for m in messages] == ["error"] and messages[0]["code"] == 503
    assert "the server is shutting down" in messages[0]["message"]
    assert code == 1012 and steps < 200  # aborted with its video still running (40 s of steps)
    assert took > 0.9  # not before the grace: a lower bound (timers do not fire early, so it cannot flake)


async def test_a_stream_decoding_at_the_deadline_gets_the_error_and_1012(tmp_path):
    """A session whose video is being decoded when --shutdown-timeout runs out: the decode stops at its next
    chunk and the session gets the 503 and a 1012 close (the decode ran on to its end, and the session was
    closed without an error by the socket's last-resort close)."""
    backend = FakeBackend(decode_chunk_delay=1.0)  # frame 0, then 5 chunks of a second
    start = {"type": "session.start", "prompt": "x", **SMALL, "num_frames": 81, "num_inference_steps": 1}
    with graceful_uvicorn(tmp_path, 1.0, backend=backend) as (url, client, terminate):
        async with websockets.connect(ws_url(url), max_size=None) as ws:
            await ws.send(json.dumps(start))
            assert (m := await _next_message(ws))["type"] == "video.start", m
            await asyncio.to_thread(wait_until, lambda: backend.decoded_chunks >= 1)
            terminate()
            messages, _, code = await _to_the_end(ws)  # (its waits are the hang guard)
    assert messages[-1]["type"] == "error" and messages[-1]["code"] == 503, messages
    assert "the server is shutting down" in messages[-1]["message"]
    assert code == 1012
    assert backend.decoded_chunks < 6  # the decode stopped at a next chunk, not at its end (then the error)


async def test_a_session_s_ended_tasks_are_reaped_quietly_unless_they_failed(caplog):
    """The control task ends with _Stop("gone") when its pong finds the client gone: that is the session's
    end, not an error; any other exception in a reaped task is logged (the suppress(BaseException) it
    replaced hid both)."""

    async def raising(exc):
        raise exc

    with caplog.at_level("ERROR", logger="worldserve.realtime"):
        await realtime._reaped(asyncio.ensure_future(raising(realtime._Stop("gone"))))
        assert not caplog.records
        await realtime._reaped(asyncio.ensure_future(raising(RuntimeError("a bug"))))
    assert [r.getMessage() for r in caplog.records] == [
        "a realtime session's task failed: RuntimeError('a bug')"
    ]

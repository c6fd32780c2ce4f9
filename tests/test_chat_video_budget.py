"""The decode budget of chat videos (media/decode_budget.py) and the stop of an abandoned request's decode.

A video whose decode work (each decoded frame its pixels, a sampled one 11 times) would take its request
past the budget is refused from the container's metadata before a frame is decoded, and, where metadata
undercounts, frame by frame as it decodes: a 400 naming the part, over HTTP on chat and /tokenize. A
container without a frame count (MKV) is counted from its packets, not decoded twice. A stop set mid-decode
ends the loop at the next frame; a client leaving sets it (media/work_pool.py) and the pool thread is
freed without a logged traceback.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import threading
import time

import av
import httpx
import numpy as np
import pytest
from PIL import Image
from serving_helpers import flat_clip, mp4_bytes, serve_reasoner, wait_until
from test_serve_compat_flags import config

from worldserve.api import chat, tokenize
from worldserve.chat_params import VideoSampling
from worldserve.commands import serve
from worldserve.media import video_input
from worldserve.media.decode_budget import (
    CONVERT_WEIGHT,
    DEFAULT_MAX_PIXELS,
    MIN_FRAME_PIXELS,
    DecodeBudget,
    DecodeCancelled,
)
from worldserve.media.video_input import decode_chat_frames, decode_chat_video
from worldserve.media.work_pool import on_request_pool
from worldserve.params import ParamError

PART = "messages[0].content[1].video_url"
BUDGET = 20_000_000
"""The test server's limit: 48 sampled frames of 32 x 32 fit (17.3 M, each counted as MIN_FRAME_PIXELS), 240
frames of 64 x 48 at 2 fps (27.5 M) do not."""


def _mkv(frames: int, width: int = 64, height: int = 48) -> bytes:
    """A Matroska H.264 clip at 8 fps: its container states no frame count."""
    return flat_clip(frames, width, height, container="matroska", codec="libx264", rate=8, step=10)


def _counting_frames(monkeypatch) -> list[int]:
    """Patch video_input._frames to record each decoding pass; returns the passes' frame counts."""
    passes: list[int] = []
    real = video_input._frames

    def frames(data, param):
        passes.append(0)
        for frame in real(data, param):
            passes[-1] += 1
            yield frame

    monkeypatch.setattr(video_input, "_frames", frames)
    return passes


def test_a_video_over_the_budget_is_refused_from_its_metadata_before_decoding(monkeypatch):
    passes = _counting_frames(monkeypatch)
    data = mp4_bytes(frames=40, width=64, height=48)  # 8 fps: 10 frames sampled at 2 fps
    needed = 40 * MIN_FRAME_PIXELS + 10 * MIN_FRAME_PIXELS * CONVERT_WEIGHT
    budget = DecodeBudget(needed - 1)
    with pytest.raises(ParamError) as exc:
        decode_chat_video(data, VideoSampling(), param=PART, budget=budget)
    assert exc.value.param == PART and passes == [] and budget.used == 0
    assert (
        f"{needed:,} pixels" in exc.value.message
        and "40 frames of 64x48, 10 of them sampled" in exc.value.message
    )
    assert "--max-video-decode-gpixels" in exc.value.message
    budget = DecodeBudget(needed)  # exactly enough: decoded once, charged what was planned
    assert len(decode_chat_video(data, VideoSampling(), param=PART, budget=budget).frames) == 10
    assert passes == [40] and budget.used == needed


def test_metadata_that_undercounts_is_caught_frame_by_frame(monkeypatch):
    """A container can lie: the frames are counted as they decode, and the one past the limit stops the
    decode (frames 0, 4 and 9 sampled: 11 + 3 + 11 + 4 + 11 frames' work passes 30 at the 10th of 40)."""
    passes = _counting_frames(monkeypatch)
    budget = DecodeBudget(30 * MIN_FRAME_PIXELS)
    budget.plan = lambda *a, **k: None  # as if the container claimed a clip that fits
    with pytest.raises(ParamError) as exc:
        decode_chat_video(
            mp4_bytes(frames=40, width=64, height=48), VideoSampling(), param=PART, budget=budget
        )
    assert exc.value.param == PART and "counted frame by frame" in exc.value.message
    assert passes == [10] and budget.used == 40 * MIN_FRAME_PIXELS


def test_a_container_without_a_frame_count_is_counted_from_its_packets(monkeypatch):
    """MKV states no frame count: its packets are counted undecoded (the clip had been decoded once to count
    it and once more to sample it), and a clip over the budget is refused before any frame is decoded."""
    passes = _counting_frames(monkeypatch)
    mkv = _mkv(frames=20)
    with av.open(io.BytesIO(mkv)) as container:
        assert container.streams.video[0].frames == 0
    video = decode_chat_video(mkv, VideoSampling(), budget=DecodeBudget(None))
    assert passes == [20] and video.indices == (0, 5, 10, 14, 19) and video.frames.shape[0] == 5
    with pytest.raises(ParamError, match="20 frames of 64x48"):
        decode_chat_video(mkv, VideoSampling(), param=PART, budget=DecodeBudget(20 * MIN_FRAME_PIXELS))
    assert passes == [20]


def test_frames_sent_as_images_are_planned_from_their_headers():
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (9, 99, 199)).save(buf, "JPEG")
    frames = [buf.getvalue()] * 8  # 24 fps: the 4 frames Qwen3-VL samples at least
    budget = DecodeBudget(4 * MIN_FRAME_PIXELS * (1 + CONVERT_WEIGHT) - 1)
    with pytest.raises(ParamError, match="4 frames of 64x48, 4 of them sampled") as exc:
        decode_chat_frames(frames, VideoSampling(), param=PART, budget=budget)
    assert exc.value.param == PART and budget.used == 0
    assert len(decode_chat_frames(frames, VideoSampling(), param=PART, budget=DecodeBudget(None)).frames) == 4


@pytest.mark.parametrize(("keep", "decoded"), [("last", 40), ("first", 5)])
def test_a_video_reference_is_planned_and_only_its_kept_frames_are_converted(keep, decoded):
    """Video-to-video references: the clip's decode ("last" reads it all, "first" up to the kept frames) and
    the kept frames' conversion are planned from the container before a frame decodes, and charged exactly
    (the old path converted every frame of a "last" clip to RGB, ~10x its decode, with no bound)."""
    data = mp4_bytes(frames=40, width=64, height=48)
    needed = decoded * MIN_FRAME_PIXELS + 5 * MIN_FRAME_PIXELS * CONVERT_WEIGHT
    budget = DecodeBudget(needed - 1)
    with pytest.raises(ParamError, match=f"{decoded} frames of 64x48, 5 of them sampled") as exc:
        video_input.decode_video(data, 5, keep, param="video_reference", budget=budget)
    assert exc.value.param == "video_reference" and budget.used == 0
    budget = DecodeBudget(needed)
    frames = video_input.decode_video(data, 5, keep, param="video_reference", budget=budget)
    assert budget.used == needed
    whole = video_input.decode_video(data, 40)  # (no budget: no limit)
    np.testing.assert_array_equal(frames, whole[-5:] if keep == "last" else whole[:5])


@pytest.mark.anyio
async def test_a_video_reference_over_the_budget_is_a_400_before_the_job(tmp_path):
    """POST /v1/videos with a video reference past --max-video-decode-gpixels: a 400 naming the reference,
    no job created."""
    from serving_helpers import SMALL_FORM, asgi_server

    clip = mp4_bytes(frames=40, width=64, height=48)
    async with asgi_server(tmp_path, app_kw={"video_decode_pixels": 40 * MIN_FRAME_PIXELS}) as http:
        extra = json.dumps({"condition_video_keep": "last"})
        r = await http.post("/v1/videos", data={"prompt": "x", **SMALL_FORM, "num_frames": "9", "extra_params": extra},
                            files={"input_reference": ("ref.mp4", clip, "video/mp4")})  # fmt: skip
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (400, "input_reference"), r.text
        assert "--max-video-decode-gpixels" in err["message"] and "40 frames of 64x48" in err["message"]
        assert (await http.get("/v1/videos")).json()["data"] == []


def test_a_stop_set_mid_decode_ends_the_loop_at_the_next_frame(monkeypatch):
    """Another thread sets the stop while the decode runs (as on_request_pool does when the client leaves):
    the loop ends at its next frame with DecodeCancelled, a few frames in, not at the clip's 48th."""
    passes = _counting_frames(monkeypatch)
    converting = threading.Event()
    real = video_input._resized

    def resized(*args):
        converting.set()
        time.sleep(0.01)
        return real(*args)

    monkeypatch.setattr(video_input, "_resized", resized)
    budget, outcome = DecodeBudget(None), []

    def decode():
        try:
            decode_chat_video(
                mp4_bytes(frames=48, width=32, height=32), VideoSampling(fps=1000.0), budget=budget
            )
        except BaseException as exc:  # (recorded for the main thread)
            outcome.append(exc)

    thread = threading.Thread(target=decode)
    thread.start()
    assert converting.wait(10)
    budget.stop.set()
    thread.join(10)
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], DecodeCancelled)
    assert 1 <= passes[0] <= 3, passes


def test_a_cancelled_request_pool_call_sets_its_stop_and_ends_quietly(caplog):
    stop, running, ended = threading.Event(), threading.Event(), threading.Event()

    def work():
        running.set()
        while not stop.wait(0.01):
            pass
        ended.set()
        raise DecodeCancelled

    async def main():
        task = asyncio.ensure_future(on_request_pool(work, stop=stop))
        assert await asyncio.to_thread(running.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stop.is_set() and await asyncio.to_thread(ended.wait, 10)
        await asyncio.sleep(0.05)  # (the thread's DecodeCancelled reaches the loop: dropped)

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_the_flag_reaches_the_app():
    assert serve.app_settings(config()).video_decode_pixels == DEFAULT_MAX_PIXELS == 48 * 10**9
    assert (
        serve.app_settings(config("--max-video-decode-gpixels", "2.5")).video_decode_pixels == 2_500_000_000
    )
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match="--max-video-decode-gpixels must be"):
            config("--max-video-decode-gpixels", bad)


def test_the_default_budget_takes_minutes_of_1080p_at_2_fps():
    """5 minutes of 1080p at 30 fps, sampled at Qwen3-VL's default 2 fps (600 frames), fit the default; the
    same at 30 fps sampled every frame (768: the most) does too; 10 minutes at 60 fps does not."""
    p1080 = 1920 * 1080
    DecodeBudget().plan(5 * 60 * 30, 600, 1920, 1080, PART)
    DecodeBudget().plan(5 * 60 * 30, 768, 1920, 1080, PART)
    with pytest.raises(ParamError, match="36,000 frames of 1920x1080, 768 of them sampled"):
        DecodeBudget().plan(10 * 60 * 60, 768, 1920, 1080, PART)
    assert 5 * 60 * 30 * p1080 + 600 * p1080 * CONVERT_WEIGHT < DEFAULT_MAX_PIXELS


def _chat(mp4: bytes, **options) -> dict:
    video = {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(mp4).decode()},
    }
    content = [{"type": "text", "text": "What happens?"}, video]
    return {
        "model": "test-model",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": content}],
        **options,
    }


@pytest.fixture(scope="module")
def budget_url(reasoner, tmp_path_factory):
    """The tiny Reasoner behind a real uvicorn whose videos may take BUDGET pixels of decoding."""
    folder = tmp_path_factory.mktemp("video-budget")
    with serve_reasoner(
        reasoner, folder, model="test-model", name="budget-uvicorn", video_decode_pixels=BUDGET
    ) as url:
        yield url


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_a_video_over_the_budget_is_a_400_naming_its_part(budget_url, monkeypatch, route):
    passes = _counting_frames(monkeypatch)
    body = _chat(mp4_bytes(frames=240, width=64, height=48))  # 27.5 M of work at 2 fps
    if route == "/tokenize":
        body.pop("max_tokens")
    r = httpx.post(budget_url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == PART, err
    assert "240 frames of 64x48" in err["message"] and "limit is 20,000,000 pixels" in err["message"], err
    assert passes == []  # refused from the container's metadata
    frames = 48 if route != "/tokenize" else 47  # (another clip: the processor cache would hold the first)
    fits = _chat(mp4_bytes(frames=frames, width=32, height=32), media_io_kwargs={"video": {"fps": 1000}})
    if route == "/tokenize":
        fits.pop("max_tokens")
    assert httpx.post(budget_url + route, json=fits, timeout=60).status_code == 200
    assert passes == [frames]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_a_client_leaving_stops_its_video_decode(budget_url, monkeypatch, caplog, route):
    """A chat (or /tokenize's chat form) whose ~40 frames take 0.1 s each to convert: the client gives up after
    0.5 s; the decode stops at the next frame (it ran to the end before), the request pool's call ends with
    DecodeCancelled, and nothing is logged above INFO."""
    converted, outcomes = [], []
    real_resized, real_build = video_input._resized, chat.build_params

    def slow(*args):
        converted.append(time.monotonic())
        time.sleep(0.1)
        return real_resized(*args)

    def build(*args, **kwargs):
        try:
            return real_build(*args, **kwargs)
        except BaseException as exc:
            outcomes.append(type(exc).__name__)
            raise

    monkeypatch.setattr(video_input, "_resized", slow)
    monkeypatch.setattr(chat, "build_params", build)
    monkeypatch.setattr(tokenize, "build_params", build)
    frames = 40 if route != "/tokenize" else 41  # (another clip: the processor cache would hold the first)
    body = _chat(mp4_bytes(frames=frames, width=32, height=48), media_io_kwargs={"video": {"fps": 1000}})
    if route == "/tokenize":
        body.pop("max_tokens")
    with caplog.at_level(logging.INFO), pytest.raises(httpx.ReadTimeout):
        httpx.post(budget_url + route, json=body, timeout=httpx.Timeout(30, read=0.5))
    left = time.monotonic()
    wait_until(lambda: outcomes, timeout=10)
    assert outcomes == ["DecodeCancelled"]
    assert 1 <= len(converted) < 20 and converted[-1] < left + 1.0, (len(converted), converted[-1] - left)
    time.sleep(0.3)
    assert not [r for r in caplog.records if r.levelno > logging.INFO], caplog.records


def test_a_client_leaving_stops_its_video_reference_decode(budget_url, monkeypatch):
    """POST /v1/videos with a 40-frame reference whose frames take 0.1 s each to count: the client gives up
    after 0.5 s; the decode stops at the next frame (it ran to the end and created the job before)."""
    from worldserve.media import decode_budget

    charged, real_charge = [], decode_budget.DecodeBudget.charge

    def slow(self, *args, **kwargs):
        charged.append(time.monotonic())
        time.sleep(0.1)
        return real_charge(self, *args, **kwargs)

    monkeypatch.setattr(decode_budget.DecodeBudget, "charge", slow)
    form = {"prompt": "x", "size": "64x48", "num_frames": "5", "num_inference_steps": "2",
            "extra_params": json.dumps({"condition_video_keep": "last"})}  # fmt: skip
    clip = mp4_bytes(frames=40, width=32, height=48)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(budget_url + "/v1/videos", data=form, files={"input_reference": ("ref.mp4", clip, "video/mp4")},
                   timeout=httpx.Timeout(30, read=0.5))  # fmt: skip
    left = time.monotonic()
    time.sleep(1.0)
    assert 1 <= len(charged) < 20 and charged[-1] < left + 0.5, (len(charged), charged[-1] - left)
    assert httpx.get(budget_url + "/v1/videos", timeout=10).json()["data"] == []  # no job for a gone client


def _noisy_faststart_mp4(frames: int, width: int = 64, height: int = 48) -> bytes:
    """An H.264 MP4 of noise frames with its index first (faststart): cut short, its header still says all."""
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        with av.open(path, "w", format="mp4", options={"movflags": "faststart"}) as out:
            stream = out.add_stream("libx264", rate=24)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            rng = np.random.default_rng(0)
            for _ in range(frames):
                noise = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
                out.mux(stream.encode(av.VideoFrame.from_ndarray(noise, format="rgb24")))
            out.mux(stream.encode())
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.remove(path)


def test_a_chat_clip_cut_short_samples_the_frames_that_decode():
    """A clip whose tail is cut (its header still says 60 frames) is sampled over the frames that decode, as
    a video reference keeps them (chat had refused the whole clip as not a video)."""
    full = _noisy_faststart_mp4(60)
    cut = full[: len(full) // 2]
    whole = decode_chat_video(full, VideoSampling(), param=PART)
    video = decode_chat_video(cut, VideoSampling(), param=PART)
    assert 0 < video.indices[-1] < whole.indices[-1] == 59
    assert len(video_input.decode_video(cut, 100)) == video.indices[-1] + 1  # the same frames as V2V decodes


def test_a_chat_clip_that_changes_shape_mid_stream_is_named_so():
    """Two MPEG-TS segments of other aspect ratios, one stream: a 400 saying the size changes (it was the
    generic 'not a valid video', from stacking frames of two sizes)."""
    seg = lambda w, h: flat_clip(12, w, h, container="mpegts", codec="mpeg2video", rate=24, step=40)  # noqa: E731
    with pytest.raises(ParamError, match="changes size mid-stream") as exc:
        decode_chat_video(seg(64, 64) + seg(96, 48), VideoSampling(fps=24.0), param=PART)
    assert exc.value.param == PART


def test_a_header_claiming_a_billion_frames_is_planned_by_the_file_s_size():
    """An 8-frame AVI whose header says 1e9 frames: planned as at most a frame a byte, then sampled over the
    frames it has (the budget had refused it, quoting 3.28e4 G pixels of a clip it is not)."""
    import struct

    clip = bytearray(flat_clip(8, 64, 48, container="avi", codec="mpeg4", rate=24, step=30))
    struct.pack_into("<I", clip, clip.find(b"avih") + 8 + 16, 10**9)  # dwTotalFrames
    struct.pack_into("<I", clip, clip.find(b"strh") + 8 + 32, 10**9)  # dwLength
    with av.open(io.BytesIO(bytes(clip))) as container:
        assert container.streams.video[0].frames == 10**9
    video = decode_chat_video(bytes(clip), VideoSampling(), param=PART, budget=DecodeBudget())
    assert video.indices[-1] == 7
    assert len(video_input.decode_video(bytes(clip), 5, "last", budget=DecodeBudget())) == 5

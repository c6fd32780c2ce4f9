"""Shared builders for the engine / API / server tests (not a test module).

`make_client` wires FakeBackend + JobStore + Engine + EngineClient the way `worldserve serve` does, with a
stub encoder by default (fast); `real_encoder=True` uses media.video.encode_mp4. `wait_until` polls a
condition with a deadline instead of sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from worldserve.config import SchedulerConfig
from worldserve.engine.client import EncodeOptions, EngineClient, JobSpec
from worldserve.engine.endings import default_encoder
from worldserve.engine.engine import Engine
from worldserve.engine.fake_backend import FakeBackend
from worldserve.engine.job_schema import new_job_id
from worldserve.engine.jobs import Job, JobStatus, JobStore
from worldserve.media.frame_stream import FrameStream
from worldserve.params import VideoParams


def stub_encoder(frames, fps, audio, sample_rate=48000, crf=18, codec_options=None) -> bytes:
    """A stand-in for encode_mp4 that records what it was given (JSON), in microseconds (a FrameStream is
    read to its end, as encode_mp4 reads it)."""
    if isinstance(frames, FrameStream):
        frames = frames.to_array()
    meta = {
        "frames": list(frames.shape), "fps": fps, "first_pixel": frames[0, 0, 0].tolist(),
        "audio": None if audio is None else list(audio.shape), "sample_rate": sample_rate, "crf": crf,
        "codec_options": codec_options,
    }  # fmt: skip
    return b"FAKEMP4" + json.dumps(meta).encode()


def make_client(
    storage: Path,
    *,
    backend: FakeBackend | None = None,
    max_batch_size: int = 1,
    max_queued_requests: int = 256,
    encode_workers: int = 2,
    encoder=stub_encoder,
    real_encoder: bool = False,
    job_ttl_s: float | None = None,
    sweep_interval_s: float | None = None,
    model_name: str = "test-model",
    observer=None,
    chat_backend=None,
    max_num_seqs: int = 32,
    upsampler=None,
) -> EngineClient:
    backend = backend or FakeBackend()
    store = JobStore(storage)
    config = SchedulerConfig(
        max_batch_size=max_batch_size, max_queued_requests=max_queued_requests, encode_workers=encode_workers
    )
    engine = Engine(
        backend, store, config, encoder=default_encoder if real_encoder else encoder, observer=observer,
        job_ttl_s=job_ttl_s,
    )  # fmt: skip
    return EngineClient(
        engine, store, model_name=model_name, max_queued_requests=max_queued_requests, job_ttl_s=job_ttl_s,
        sweep_interval_s=sweep_interval_s, chat_backend=chat_backend, max_num_seqs=max_num_seqs, upsampler=upsampler,
    )  # fmt: skip


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


@contextlib.asynccontextmanager
async def asgi_server(
    storage: Path,
    *,
    api_key: str | tuple[str, ...] | None = None,
    sync_timeout_s: float = 30.0,
    max_upload_bytes: int = 8 * 2**20,
    app_kw: dict | None = None,
    **client_kw,
) -> AsyncIterator[httpx.AsyncClient]:
    """The app over httpx.ASGITransport (no socket), its lifespan entered by hand; `app_kw`: more build_app
    options."""
    from worldserve.api.app import build_app

    client = make_client(storage, **client_kw)
    app = build_app(client, api_keys=_keys(api_key), sync_timeout_s=sync_timeout_s, max_upload_bytes=max_upload_bytes,
                    shutdown_timeout_s=0.3, **(app_kw or {}))  # fmt: skip
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
            http.engine_client = client  # type: ignore[attr-defined]
            yield http


async def poll_job(http: httpx.AsyncClient, job_id: str, timeout: float = 20.0, headers=None) -> dict:
    """GET the job until it is completed or failed; returns the last body."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = await http.get(f"/v1/videos/{job_id}", headers=headers)
        body = r.json()
        if body["status"] in ("completed", "failed"):
            return body
        await asyncio.sleep(0.01)
    raise AssertionError(f"job {job_id} did not finish in {timeout}s")


def served_port(log: Path, proc, timeout: float = 60.0) -> int:
    """The port a `worldserve serve --port 0` process bound, read from its log's start line (a port picked
    free beforehand could be another test's by the time the server binds it)."""
    import re

    found: list[int] = []

    def started() -> bool:
        assert proc.poll() is None, log.read_text() if log.exists() else "the server exited"
        m = re.search(
            r"Starting worldserve API server on https?://[^:]+:(\d+) ",
            log.read_text() if log.exists() else "",
        )
        found.extend([int(m[1])] if m else [])
        return bool(found)

    wait_until(started, timeout=timeout, interval=0.05)
    return found[0]


def served_url(log: Path, proc, timeout: float = 60.0) -> str:
    """The http URL of a `worldserve serve --port 0` process (served_port) once its /health answers 200; the
    process dying meanwhile fails with its log."""
    import httpx

    url = f"http://127.0.0.1:{served_port(log, proc, timeout)}"
    with httpx.Client(base_url=url, timeout=1) as http:
        wait_healthy(http, proc, timeout, log)
    return url


def wait_healthy(http, proc, timeout: float = 60.0, log: Path | None = None) -> None:
    """Until the served process's /health (through the httpx.Client `http`: TCP, TLS or a unix socket)
    answers 200; the process dying meanwhile fails (with its `log`, if given)."""
    import httpx

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text() if log is not None else "the server did not start"
        try:
            return http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy, timeout=timeout, interval=0.05)


def png_bytes(width: int = 24, height: int = 16, colour=(200, 30, 60)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def mp4_bytes(frames: int = 6, width: int = 32, height: int = 16) -> bytes:
    """A small H.264 clip (a brightness ramp) for video-to-video references."""
    import numpy as np

    from worldserve.media.video import encode_mp4

    ramp = (np.arange(frames) * 20 % 256).astype(np.uint8)[:, None, None, None]
    return encode_mp4(np.broadcast_to(ramp, (frames, height, width, 3)).copy(), fps=8.0, audio=None)


def flat_clip(
    frames: int, width: int, height: int, *, container: str, codec: str, rate: int, step: int
) -> bytes:
    """A clip of `frames` flat frames (frame i's grey level i * step) in `container` ("matroska": no frame
    count stated; "mpegts": segments concatenate into one stream), encoded with `codec` at `rate` fps."""
    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(
                np.full((height, width, 3), i * step % 256, np.uint8), format="rgb24"
            )
            out.mux(stream.encode(frame))
        out.mux(stream.encode())  # flush
    return buf.getvalue()


@contextlib.contextmanager
def serve_app(app, name: str = "test-uvicorn", **config):
    """Run an ASGI app under a real uvicorn on a loopback port in a background thread (`config`: more
    uvicorn.Config options over `worldserve serve`'s); yields its URL."""
    import argparse
    import threading

    import uvicorn

    from worldserve.commands.serve_http import uvicorn_options

    config = {**uvicorn_options(argparse.Namespace()), **config}
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **config))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive())
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


@contextlib.contextmanager
def uvicorn_thread(
    storage: Path,
    *,
    api_key: str | None = None,
    sync_timeout_s: float = 60.0,
    uvicorn_options=None,
    app_kw: dict | None = None,
    **client_kw,
):
    """A real uvicorn on a loopback port in a background thread (lifespan included; `uvicorn_options` over
    serve's, `app_kw`: more build_app options); yields (url, client)."""
    from worldserve.api.app import build_app

    client = make_client(storage, **client_kw)
    app = build_app(client, api_keys=_keys(api_key), sync_timeout_s=sync_timeout_s, shutdown_timeout_s=1.0,
                    **(app_kw or {}))  # fmt: skip
    with serve_app(app, **(uvicorn_options or {})) as url:
        yield url, client


@contextlib.contextmanager
def graceful_uvicorn(storage: Path, shutdown_timeout_s: float, **client_kw):
    """uvicorn_thread's server as `worldserve serve` runs it (GracefulServer, timeout_graceful_shutdown
    --shutdown-timeout + 10); yields (url, client, terminate): terminate() is SIGTERM's handler, on the
    server's loop."""
    import argparse
    import signal
    import threading

    import uvicorn

    from worldserve.api.app import build_app
    from worldserve.commands.serve_http import GracefulServer, uvicorn_options

    client = make_client(storage, **client_kw)
    app = build_app(client, shutdown_timeout_s=shutdown_timeout_s)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            timeout_graceful_shutdown=int(shutdown_timeout_s) + 10,
                            **uvicorn_options(argparse.Namespace()))  # fmt: skip
    server = GracefulServer(config, client, shutdown_timeout_s)
    thread = threading.Thread(target=server.run, name="test-graceful-uvicorn", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive())
    port = server.servers[0].sockets[0].getsockname()[1]

    def terminate() -> None:
        client._loop.call_soon_threadsafe(server.handle_exit, signal.SIGTERM, None)

    try:
        yield f"http://127.0.0.1:{port}", client, terminate
    finally:
        server.should_exit = True
        thread.join(20)


@contextlib.contextmanager
def serve_reasoner(reasoner, folder: Path, *, model: str, name: str, **app_options):
    """A real uvicorn serving a fake video backend and `reasoner` for chats (make_client + build_app, with
    `app_options`: build_app's server flags); yields its URL."""
    from worldserve.api.app import build_app

    client = make_client(folder, model_name=model, chat_backend=reasoner)
    with serve_app(build_app(client, shutdown_timeout_s=1.0, **app_options), name=name) as url:
        yield url


def job_params(
    prompt: str = "a cat", *, steps: int = 4, width: int = 64, frames: int = 5, seed: int = 1, **kw
) -> VideoParams:
    """A small video request for the engine's tests (64 px high, 8 fps)."""
    return VideoParams(prompt=prompt, width=width, height=64, num_frames=frames, num_inference_steps=steps,
                       seed=seed, fps=8.0, **kw)  # fmt: skip


def job_spec(p: VideoParams) -> JobSpec:
    """The job record a create route would write for `p`."""
    return JobSpec(model="test-model", prompt=p.prompt, size=f"{p.width}x{p.height}", seconds="1",
                   quality="default", fps=p.fps, num_frames=p.num_frames)  # fmt: skip


def stored_job(store: JobStore, reference: bytes | None = None, *, running: bool = True) -> Job:
    """A small job created in `store` (with `reference` as its reference file), marked in progress unless
    `running` is False: what the job store's own tests start from."""
    job = Job(id=new_job_id(), status=JobStatus.QUEUED, progress=0, created_at=time.time(),
              spec=job_spec(job_params()))  # fmt: skip
    store.create(job, {"params": {}}, reference)
    if running:
        assert store.mark_in_progress(job.id, time.time())
    return job


def submit_job(client: EngineClient, p: VideoParams, encode: EncodeOptions | None = None):
    return client.submit(p, job_spec(p), encode or EncodeOptions(), None)


SMALL_FORM = {"size": "64x48", "num_frames": "5", "num_inference_steps": "2", "fps": "8"}
"""Form fields of a small, quick video request."""
JOB_FIELDS = {
    "id", "object", "model", "prompt", "status", "progress", "size", "seconds", "quality", "fps", "num_frames",
    "duration_s", "created_at", "completed_at", "expires_at", "remixed_from_video_id", "error", "media_type",
    "file_name", "inference_time_s", "stage_durations", "peak_memory_mb", "action", "upsampled_prompt",
}  # fmt: skip
"""Every field of a video job's JSON."""


def stub_meta(content: bytes) -> dict:
    """What stub_encoder recorded in an "MP4" it made."""
    assert content.startswith(b"FAKEMP4")
    return json.loads(content[7:])


def _keys(api_key: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """build_app's api_keys from a test's one key, several or none."""
    return (api_key,) if isinstance(api_key, str) else tuple(api_key or ())


def ws_url(url: str) -> str:
    """The /v1/realtime/video socket of the server at `url`."""
    return url.replace("http://", "ws://") + "/v1/realtime/video"


async def realtime_session(
    url: str, start: dict | str, *, during=None, headers=None
) -> tuple[list[dict], bytes, list]:
    """Send `start`, then (after video.start) run `during(ws)`; read to session.done / error / close.
    Returns (JSON messages, the binary parts joined, the messages in order as (kind, size-or-type))."""
    import websockets

    messages, parts, order = [], [], []
    async with websockets.connect(ws_url(url), additional_headers=headers, max_size=None) as ws:
        await ws.send(start if isinstance(start, str) else json.dumps(start))
        with contextlib.suppress(websockets.ConnectionClosed):
            async for raw in ws:
                if isinstance(raw, bytes):
                    parts.append(raw)
                    order.append(("bytes", len(raw)))
                    continue
                msg = json.loads(raw)
                messages.append(msg)
                order.append(("json", msg["type"]))
                if msg["type"] == "video.start" and during is not None:
                    await during(ws)
                if msg["type"] in ("session.done", "error") and during is None:
                    break
    return messages, b"".join(parts), order

"""Shared builders for the engine / API / server tests (not a test module).

`make_client` wires FakeBackend + JobStore + Engine + EngineClient the way `worldserve serve` does, with a
stub encoder by default (fast); `real_encoder=True` uses media.mp4.encode_mp4. `wait_until` polls a
condition with a deadline instead of sleeping a fixed time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from worldserve.config import SchedulerConfig
from worldserve.engine.client import EngineClient
from worldserve.engine.engine import Engine, default_encoder
from worldserve.engine.fake_backend import FakeBackend
from worldserve.engine.jobs import JobStore


def stub_encoder(frames, fps, audio, sample_rate=48000, crf=18, codec_options=None) -> bytes:
    """A stand-in for encode_mp4 that records what it was given (JSON), in microseconds."""
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
    model_name: str = "test-model",
    observer=None,
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
        engine, store, model_name=model_name, max_queued_requests=max_queued_requests, job_ttl_s=job_ttl_s
    )


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")

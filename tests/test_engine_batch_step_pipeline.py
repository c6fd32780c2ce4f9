"""engine/batch.py's step_batch on the tiny checkpoint's real VideoPipeline (CPU float32): an out of memory in a
batched forward leaves every state as it was (the forward only reads them), so the members step alone to the
latents an unfailed batch makes (up to float rounding) and only the request that fails alone fails; a state
whose update stopped half way (its video stepped, its sound not) is stepped once, alone."""

from __future__ import annotations

import threading

import pytest
import torch
from pipeline_helpers import rel

from worldserve.engine.batch import step_batch
from worldserve.engine.request import Request
from worldserve.params import VideoParams

PROMPTS = ("a red fox", "a storm at sea", "a quiet street")
BAD = 1
"""The request an injected out of memory strikes (the middle one: a member before it and one after)."""
TOLERANCE = 1e-5
"""Relative L2 distance of latents stepped alone from the same step batched (the GEMMs sum in another order)."""


@pytest.fixture(scope="module")
def pipeline(tiny_ckpt):
    from worldserve.runner.video_pipeline import VideoPipeline

    return VideoPipeline.from_pretrained(tiny_ckpt, device="cpu", dtype=torch.float32, progress=False)


def prepared(pipeline) -> list[Request]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        params = VideoParams(
            prompt=prompt, width=64, height=48, num_frames=5, num_inference_steps=3, seed=i, fps=8.0
        )
        out.append(
            Request(job_id=f"r{i}", params=params, arrival_time=0.0, state=pipeline.prepare(f"r{i}", params))
        )
    return out


def reference(pipeline, steps: int) -> list[torch.Tensor]:
    """Each request's latents after `steps` steps, all three batched with no failure."""
    states = [r.prepared for r in prepared(pipeline)]
    for _ in range(steps):
        pipeline.denoise(states)
    out = [s.latents.clone() for s in states]
    for s in states:
        pipeline.release(s)
    return out


def test_out_of_memory_in_the_forward_fails_only_the_request_that_fails_alone(pipeline, monkeypatch):
    expected = reference(pipeline, 3)
    batch = prepared(pipeline)
    bad = batch[BAD].prepared
    forward = pipeline.forward

    def failing_forward(items, lora=None):
        if any(item.latents is bad.latents for item in items):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return forward(items, lora)

    monkeypatch.setattr(pipeline, "forward", failing_forward)
    states = [r.prepared for r in batch]
    before = [(s.latents, s.sound, s.video_solver, s.sound_solver, s.step_index) for s in states]
    with pytest.raises(torch.OutOfMemoryError):
        pipeline.denoise(states)
    after = [(s.latents, s.sound, s.video_solver, s.sound_solver, s.step_index) for s in states]
    assert all(x is y for b, a in zip(before, after, strict=True) for x, y in zip(b[:4], a[:4], strict=True))
    assert [b[4] for b in before] == [a[4] for a in after] == [0, 0, 0], "the failed forward changed no state"

    running, failed, lock = list(batch), [], threading.Lock()
    while running:
        outcome = step_batch(pipeline, running, lock)
        failed += [(r.job_id, exc) for r, exc in outcome.failed]
        running = [r for r in running if r not in {f for f, _ in outcome.failed} and not r.denoised]
    assert [(job, type(exc)) for job, exc in failed] == [("r1", torch.OutOfMemoryError)]
    for i in (0, 2):
        assert batch[i].steps_done == 3 and rel(batch[i].prepared.latents, expected[i]) < TOLERANCE


def test_a_request_whose_update_stopped_half_way_is_not_stepped_twice(pipeline, monkeypatch):
    """The sound's step of the middle request runs out of memory once, after its video stepped: the members
    before and after step once, and so does that request, alone, to the latents of one step (the pipeline
    commits a state's update whole; half updated, it had failed on its solver's step check)."""
    import worldserve.runner.video_pipeline as video_pipeline

    expected = reference(pipeline, 1)
    batch = prepared(pipeline)
    bad = batch[BAD].prepared
    unipc_step, struck = video_pipeline.unipc_step, []

    def failing_once(schedule, solver, step_index, velocity, sample):
        if sample is bad.sound and not struck:
            struck.append(step_index)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return unipc_step(schedule, solver, step_index, velocity, sample)

    monkeypatch.setattr(video_pipeline, "unipc_step", failing_once)
    assert bad.sound is not None, "the tiny checkpoint generates sound"
    outcome = step_batch(pipeline, batch, threading.Lock())
    assert struck == [0]
    stepped = sorted(r.job_id for r, _ in outcome.stepped)
    for i in (0, 2):
        assert batch[i].steps_done == 1 and rel(batch[i].prepared.latents, expected[i]) < TOLERANCE
    assert not outcome.failed and stepped == ["r0", "r1", "r2"]
    assert batch[BAD].steps_done == 1 and rel(bad.latents, expected[BAD]) < TOLERANCE

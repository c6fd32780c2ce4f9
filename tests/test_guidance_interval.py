"""Guidance interval (vLLM-Omni's `guidance_interval`): CFG only at the steps whose timestep lies in [lo, hi].

On the tiny checkpoint in float32: a window holding every timestep is plain CFG, bitwise; a window holding
none is a guidance-1 run (cond branch alone), bitwise; a window in between runs the uncond branch exactly at
its steps and lands between the two. CFG-parallel's handling of it: test_cfg_parallel.py.
"""

from __future__ import annotations

import dataclasses

import pytest
from pipeline_helpers import run_requests

from worldserve.params import ParamError, VideoParams

BASE = VideoParams(prompt="a red fox in snow", negative_prompt="blurry", width=80, height=48, num_frames=9,
                   num_inference_steps=4, seed=11, guidance_scale=6.0, generate_sound=True)  # fmt: skip


def run(pipe, params, monkeypatch=None):
    """Final latents, and the number of items in each step's forward."""
    sizes = []
    if monkeypatch is not None:
        forward = pipe.forward
        monkeypatch.setattr(
            pipe, "forward", lambda items, lora=None: sizes.append(len(items)) or forward(items, lora)
        )
    [(lat, snd, _)] = run_requests(pipe, [params])
    return lat, snd, sizes


def test_full_window_is_plain_cfg_and_empty_window_is_cond_only(ours_pipeline):
    full = run(ours_pipeline, dataclasses.replace(BASE, guidance_interval=(0.0, 1000.0)))
    plain = run(ours_pipeline, BASE)
    assert full[0].equal(plain[0]) and full[1].equal(plain[1])
    none = run(ours_pipeline, dataclasses.replace(BASE, guidance_interval=(1000.0, 1000.0)))
    cond_only = run(ours_pipeline, dataclasses.replace(BASE, guidance_scale=1.0))
    assert none[0].equal(cond_only[0]) and none[1].equal(cond_only[1])


def test_partial_window_runs_uncond_only_inside(ours_pipeline, monkeypatch):
    state = ours_pipeline.prepare("probe", BASE)
    timesteps = [int(t) for t in state.schedule.timesteps]
    ours_pipeline.release(state)
    lo = (timesteps[1] + timesteps[2]) / 2  # the first two steps guided, the last two not
    lat, snd, sizes = run(
        ours_pipeline, dataclasses.replace(BASE, guidance_interval=(lo, 1000.0)), monkeypatch
    )
    assert sizes == [2, 2, 1, 1]
    plain, cond_only = (
        run(ours_pipeline, BASE),
        run(ours_pipeline, dataclasses.replace(BASE, guidance_scale=1.0)),
    )
    assert not lat.equal(plain[0]) and not lat.equal(cond_only[0])


@pytest.mark.parametrize("interval", [(500.0, 400.0), (-1.0, 10.0), (0.0, 1001.0), (float("nan"), 1.0)])
def test_bad_windows_name_the_field(interval):
    with pytest.raises(ParamError) as err:
        dataclasses.replace(BASE, guidance_interval=interval).validate()
    assert err.value.param == "guidance_interval"

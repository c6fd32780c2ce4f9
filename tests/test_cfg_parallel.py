"""CFG-parallel over 2 gloo CPU ranks: the same final latents, sound and frames as one process.

Rank 0 is this pytest process (CfgParallelPipeline, one torch.distributed world per process, so the
pipeline is module-scoped and closed at the end); rank 1 is the spawned peer (cfg_worker_main).
The dead-peer case lives in test_cfg_parallel_peer.py (it needs its own world).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worldserve.config import ParallelConfig
from worldserve.params import VideoParams

BASE = dict(
    negative_prompt="blurry, distorted", num_inference_steps=3, num_frames=9, height=48, width=80,
)  # fmt: skip


@pytest.fixture(scope="module")
def cfgp(tiny_ckpt):
    from worldserve.runner.video_pipeline import load_pipeline

    pipe = load_pipeline(tiny_ckpt, cfg_parallel_size=2, device="cpu", dtype=torch.float32, progress=False)
    yield pipe
    pipe.close()
    assert not pipe.process.is_alive() and pipe.process.exitcode == 0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _run_all(pipe, params_list):
    """prepare every request, denoise them batched until done, decode, release."""
    states = [pipe.prepare(f"r{i}", p) for i, p in enumerate(params_list)]
    while not states[0].done:
        pipe.denoise(states)
    results = [pipe.decode(s) for s in states]
    out = [
        (s.latents.clone(), None if s.sound is None else s.sound.clone(), r)
        for s, r in zip(states, results, strict=True)
    ]
    for s in states:
        pipe.release(s)
    return out


@pytest.mark.parametrize("guidance", [6.0, 1.0])
def test_matches_single_process(cfgp, ours_pipeline, guidance):
    params = VideoParams(prompt="A red fox runs through snow.", guidance_scale=guidance, seed=3,
                         generate_sound=True, **BASE)  # fmt: skip
    [(lat, snd, res)] = _run_all(cfgp, [params])
    [(lat1, snd1, res1)] = _run_all(ours_pipeline, [params])
    assert snd is not None
    assert rel(lat, lat1) <= 1e-5 and rel(snd, snd1) <= 1e-5
    np.testing.assert_allclose(res.frames.astype(int), res1.frames.astype(int), atol=1)
    assert np.abs(res.audio - res1.audio).max() <= 1e-4
    assert "r0" not in cfgp._remote  # released on the peer too


def test_two_requests_batched_mixed_guidance(cfgp, ours_pipeline):
    a = VideoParams(prompt="a cat", seed=7, guidance_scale=6.0, generate_sound=True, **BASE)
    b = VideoParams(prompt="a dog on a skateboard", seed=8, guidance_scale=1.0, generate_sound=True, **BASE)
    c = VideoParams(prompt="a ship at sea", seed=9, guidance_scale=4.0, generate_sound=True, **BASE)
    got = _run_all(cfgp, [a, b, c])
    want = _run_all(ours_pipeline, [a, b, c])
    for (lat, snd, _), (lat1, snd1, _) in zip(got, want, strict=True):
        assert rel(lat, lat1) <= 1e-5 and rel(snd, snd1) <= 1e-5


def test_config_accepts_1_and_2_only():
    assert ParallelConfig(cfg_parallel_size=2).cfg_parallel_size == 2
    with pytest.raises(ValueError, match="use 1 or 2"):
        ParallelConfig(cfg_parallel_size=4)

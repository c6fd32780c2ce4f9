"""`--ulysses-degree 2` over 2 gloo CPU ranks, and `--cfg-parallel-size 2 --ulysses-degree 2` over 4: the same
final latents, sound and frames as one process, for CFG and guidance-1 requests batched together; a bad
degree is refused before anything is spawned.

Rank 0 is this pytest process (one torch.distributed world per process, so the pipeline is module-scoped and
closed at the end); rank 1 is the spawned peer (parallel_worker.BranchRank)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pipeline_helpers import rel, run_requests, two_rank_cpu_pipeline

from worldserve.params import VideoParams

BASE = dict(negative_prompt="blurry", num_inference_steps=3, num_frames=9, height=48, width=80)


@pytest.fixture(scope="module")
def usp(tiny_ckpt):
    yield from two_rank_cpu_pipeline(tiny_ckpt, ulysses_degree=2)


def test_matches_single_process(usp, ours_pipeline):
    batch = [
        VideoParams(
            prompt="A red fox runs through snow.", guidance_scale=6.0, seed=3, generate_sound=True, **BASE
        ),
        VideoParams(prompt="A boat at dusk.", guidance_scale=1.0, seed=4, generate_sound=False, **BASE),
        # CFG in a window: the peer must drop the uncond item at the same steps as rank 0 (else the
        # collective shapes part ways)
        VideoParams(prompt="A kite.", guidance_scale=5.0, guidance_interval=(700.0, 1000.0), seed=5, **BASE),
    ]
    assert usp.local.sp.size == 2 and usp.local.sp.rank == 0  # rank 0's forwards run sharded
    ours = run_requests(usp, batch)
    ref = run_requests(ours_pipeline, batch)
    for (lat, snd, res), (lat1, snd1, res1) in zip(ours, ref, strict=True):
        assert rel(lat, lat1) <= 1e-5
        assert (snd is None) == (snd1 is None) and (snd is None or rel(snd, snd1) <= 1e-5)
        np.testing.assert_allclose(res.frames.astype(int), res1.frames.astype(int), atol=1)


def test_lora_adapter_matches_single_process(usp, ours_pipeline, tiny_ckpt, tmp_path):
    """Both ranks project their blocks of the stream with the adapter's deltas (the peer loads it from the
    prefill message): the same result as one process."""
    from pipeline_helpers import write_random_adapter

    from worldserve.params import LoraRequest

    lora = LoraRequest("fox", write_random_adapter(tmp_path / "fox", tiny_ckpt, seed=8), 1.5)
    batch = [VideoParams(prompt="A red fox runs through snow.", guidance_scale=6.0, seed=3, generate_sound=True,
                         lora=lora, **BASE)]  # fmt: skip
    [(lat, snd, _)] = run_requests(usp, batch)
    [(lat1, snd1, _)] = run_requests(ours_pipeline, batch)
    assert rel(lat, lat1) <= 1e-5 and rel(snd, snd1) <= 1e-5


def test_cfg_times_ulysses_on_four_ranks(ours_pipeline, tiny_ckpt, usp):
    """Runs after the 2-rank pipeline is closed (one world per process): cond on ranks 0-1, uncond on 2-3."""
    usp.close()
    batch = [
        VideoParams(
            prompt="A red fox runs through snow.", guidance_scale=6.0, seed=5, generate_sound=True, **BASE
        ),
        VideoParams(prompt="A boat at dusk.", guidance_scale=1.0, seed=6, generate_sound=False, **BASE),
        VideoParams(
            prompt="The scene moves.",
            guidance_scale=4.0,
            seed=7,
            generate_sound=False,
            image=np.random.default_rng(7).integers(0, 256, (48, 80, 3), dtype=np.uint8),
            **BASE,
        ),
    ]  # an image-to-video request too (latent frame 0 held clean on every rank)
    gen = two_rank_cpu_pipeline(tiny_ckpt, cfg_parallel_size=2, ulysses_degree=2)
    pipe = next(gen)
    try:
        assert pipe.layout.world == 4 and len(pipe.peers.processes) == 3 and pipe.local.sp.size == 2
        ours = run_requests(pipe, batch)
    finally:
        next(gen, None)  # closes and checks the peers exited cleanly
    for (lat, snd, _), (lat1, snd1, _) in zip(ours, run_requests(ours_pipeline, batch), strict=True):
        assert rel(lat, lat1) <= 1e-5 and (snd is None or rel(snd, snd1) <= 1e-5)


def test_degree_must_divide_the_heads(tiny_ckpt):
    from worldserve.runner.video_pipeline import load_pipeline

    with pytest.raises(ValueError, match="--ulysses-degree 4 must divide"):
        load_pipeline(tiny_ckpt, ulysses_degree=4, device="cpu", dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match="--cfg-parallel-size 2 --ulysses-degree 2 needs 4 CUDA GPUs"):
        load_pipeline(tiny_ckpt, ulysses_degree=2, cfg_parallel_size=2, device="cuda", progress=False)

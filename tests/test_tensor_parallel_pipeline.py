"""`--tensor-parallel-size 2` over 2 gloo CPU ranks (float32): every weight matrix split in two, the peers
mirroring each prefill and forward; the same final latents and sound as one process for a CFG request with
sound, a guidance-1 request and an image-to-video request batched together. Bad layouts are refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from pipeline_helpers import rel, run_requests, two_rank_cpu_pipeline

from worldserve.params import VideoParams

BASE = dict(negative_prompt="blurry", num_inference_steps=3, num_frames=9, height=48, width=80)


@pytest.fixture(scope="module")
def tpp(tiny_ckpt):
    yield from two_rank_cpu_pipeline(tiny_ckpt, tensor_parallel_size=2)


def test_matches_single_process(tpp, ours_pipeline):
    blk = tpp.local.transformer.layers[0].gen
    assert blk.tp_size == 2 and blk.num_heads == tpp.local.config.num_attention_heads // 2
    batch = [
        VideoParams(prompt="A red fox runs through snow.", guidance_scale=6.0, seed=3, generate_sound=True, **BASE),
        VideoParams(prompt="A boat at dusk.", guidance_scale=1.0, seed=4, generate_sound=False, **BASE),
        VideoParams(prompt="The scene moves.", guidance_scale=4.0, seed=7, generate_sound=False,
                    image=np.random.default_rng(7).integers(0, 256, (48, 80, 3), dtype=np.uint8), **BASE),
    ]  # fmt: skip
    for (lat, snd, res), (lat1, snd1, res1) in zip(run_requests(tpp, batch), run_requests(ours_pipeline, batch),
                                                   strict=True):  # fmt: skip
        assert rel(lat, lat1) <= 1e-5
        assert (snd is None) == (snd1 is None) and (snd is None or rel(snd, snd1) <= 1e-5)
        np.testing.assert_allclose(res.frames.astype(int), res1.frames.astype(int), atol=1)


def test_layouts_that_cannot_run_are_refused(tiny_ckpt, tmp_path):
    from worldserve.config import ParallelConfig
    from worldserve.runner.video_pipeline import load_pipeline

    with pytest.raises(ValueError, match="--tensor-parallel-size 4 must divide"):
        load_pipeline(tiny_ckpt, tensor_parallel_size=4, device="cpu", progress=False)
    with pytest.raises(ValueError, match="runs alone"):
        ParallelConfig(tensor_parallel_size=2, ulysses_degree=2)
    # the config is checked before anything loads: it (and the model_index.json that marks a checkpoint
    # folder) is all the folder needs
    odd = tmp_path / "odd-mlp"
    (odd / "transformer").mkdir(parents=True)
    (odd / "model_index.json").write_text("{}")
    config = json.loads((Path(tiny_ckpt) / "transformer" / "config.json").read_text())
    (odd / "transformer" / "config.json").write_text(json.dumps({**config, "intermediate_size": 63}))
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 must divide intermediate_size=63"):
        load_pipeline(odd, tensor_parallel_size=2, device="cpu", progress=False)


def test_lora_adapter_matches_single_process(tpp, ours_pipeline, tiny_ckpt, tmp_path):
    """Each rank applies its slices of the adapter (B's rows for q|k|v and gate|up, A's columns for o_proj and
    down_proj, whose partial deltas join the all-reduce): the same result as one process."""
    from pipeline_helpers import write_random_adapter

    from worldserve.params import LoraRequest

    lora = LoraRequest("fox", write_random_adapter(tmp_path / "fox", tiny_ckpt, seed=5), 0.75)
    batch = [
        VideoParams(prompt="A red fox runs through snow.", guidance_scale=6.0, seed=3, generate_sound=True,
                    lora=lora, **BASE),
        VideoParams(prompt="A boat at dusk.", guidance_scale=1.0, seed=4, generate_sound=True, lora=lora, **BASE),
    ]  # fmt: skip
    plain = run_requests(ours_pipeline, [dataclasses.replace(batch[0], lora=None)])
    for (lat, snd, _), (lat1, snd1, _) in zip(run_requests(tpp, batch), run_requests(ours_pipeline, batch),
                                              strict=True):  # fmt: skip
        assert rel(lat, lat1) <= 1e-5 and rel(snd, snd1) <= 1e-5
    assert rel(plain[0][0], run_requests(ours_pipeline, batch[:1])[0][0]) > 1e-2  # (the adapter mattered)

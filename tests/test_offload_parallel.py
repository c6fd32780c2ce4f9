"""Layerwise offload on every rank of a ParallelPipeline (2 gloo CPU ranks, tensor parallel, which splits
every streamed block): the same latents as one process; each rank streams its own blocks."""

from __future__ import annotations

import pytest
from pipeline_helpers import rel, run_requests, two_rank_cpu_pipeline

from worldserve.params import VideoParams
from worldserve.runner.kernel_options import KernelOptions


@pytest.fixture(scope="module")
def tp_offload(tiny_ckpt):
    yield from two_rank_cpu_pipeline(
        tiny_ckpt, tensor_parallel_size=2, kernels=KernelOptions(layerwise_offload=True)
    )


def test_tensor_parallel_with_offload_matches_single_process(tp_offload, ours_pipeline):
    assert (
        tp_offload.transformer.gen_blocks is not None
    )  # rank 0's half-width blocks stream from host buffers
    params = VideoParams(prompt="a fox", seed=5, num_inference_steps=3, num_frames=9, height=48, width=80)
    [(lat, snd, _)] = run_requests(tp_offload, [params])
    [(lat1, snd1, _)] = run_requests(ours_pipeline, [params])
    assert rel(lat, lat1) <= 1e-5 and rel(snd, snd1) <= 1e-5

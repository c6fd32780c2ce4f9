"""GPU-only behaviour of the video path found in a review (gpu tests, tiny checkpoint, seconds each).

- A real CUDA out-of-memory error (the process capped with `set_per_process_memory_fraction`) in a job run
  by the Engine on the real VideoPipeline: the job fails with the allocator's message, the device memory the
  failed job took is given back (nothing keeps its tensors alive: tracebacks, frame pipes, futures) and the
  next job completes. (The CPU tests fake the OOM with a FakeBackend, test_engine_decode.py.)
- torch.compile guards on the gen layers: a request with another prompt length but the same video shape must
  not compile new graphs (GenAttentionBuffers rounds its K/V rows up to KV_ROWS_BUCKET for that).
- The compiled VAE decoder (`WanDecoder.compile`, static shapes) caches one graph per block shape per chunk
  length on the shared `ResidualBlock.forward` code object: with the limit of 64 it had, a server that saw 3
  sizes x 2 frame counts decoded every later shape eagerly (reproduced on the CPU with the eager backend);
  now every served shape keeps compiling (models/layers/compile_limits.py).

The dynamo checks use `backend="eager"`: guards and graph caches are the same as inductor's, without its
compile time.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch
from serving_helpers import make_client, submit_job

from worldserve.engine.client import JobStatus
from worldserve.params import VideoParams

CUDA = torch.device("cuda")


def _params(
    prompt: str = "a cat", *, width: int = 64, height: int = 48, frames: int = 9, **kw
) -> VideoParams:
    """A small request; guidance 1 by default (no uncond branch: no 3.5k-token negative prompt)."""
    kw.setdefault("guidance_scale", 1.0)
    kw.setdefault("fps", 8.0)
    return VideoParams(prompt=prompt, width=width, height=height, num_frames=frames, num_inference_steps=2,
                       seed=1, **kw)  # fmt: skip


def _pipeline(ckpt, device=None):
    from worldserve.runner.kernel_options import KernelOptions
    from worldserve.runner.video_pipeline import VideoPipeline

    kernels = KernelOptions(compile=False)
    return VideoPipeline.from_pretrained(ckpt, device=device or CUDA, kernels=kernels, progress=False)


def _run_jobs(client, params_list):
    """Submit each job in turn, wait for it; -> the finished Job records."""

    async def main():
        await client.start()
        done = []
        for p in params_list:
            job = submit_job(client, p)
            done.append(await asyncio.wait_for(client.wait(job.id), 120))
        await client.shutdown(10)
        return done

    return asyncio.run(main())


@pytest.mark.gpu
def test_a_cuda_oom_fails_its_job_frees_its_memory_and_the_next_job_runs(tiny_ckpt, tmp_path):
    """720p x 189 frames under a cap of 128 MiB above the warm process: the tiny model's decode alone needs
    GBs (a 16-channel 720p activation of 16 frames is 0.47 GB), so the job meets a genuine CUDA OOM."""
    pipe = _pipeline(tiny_ckpt)
    client = make_client(tmp_path / "warm", backend=pipe)
    (warm,) = _run_jobs(client, [_params()])
    assert warm.status is JobStatus.COMPLETED
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(CUDA)
    total = torch.cuda.get_device_properties(CUDA).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, (base + 128 * 2**20) / total), torch.cuda.current_device()
    )
    try:
        big = _params("a big one", width=1280, height=720, frames=189, fps=24.0)
        (failed,) = _run_jobs(make_client(tmp_path / "oom", backend=pipe), [big])  # (engine shut down)
        torch.cuda.synchronize()
        unreached = torch.cuda.memory_allocated(CUDA) - base  # freed by reference counts alone?
        gc.collect()
        held = torch.cuda.memory_allocated(CUDA) - base
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
    assert failed.status is JobStatus.FAILED, failed
    assert "out of memory" in failed.error_message.lower(), failed.error_message
    assert held < 16 * 2**20, (
        f"{held / 2**20:.1f} MiB still allocated after the failed job and a gc (a leak); "
        f"{unreached / 2**20:.1f} MiB before the gc"
    )
    (after,) = _run_jobs(make_client(tmp_path / "after", backend=pipe), [_params("after")])
    assert after.status is JobStatus.COMPLETED, after


@pytest.mark.gpu
def test_a_new_prompt_length_compiles_no_new_gen_graphs(tiny_ckpt):
    """Same video shape, prompts of different lengths (both CFG layouts inside one KV_ROWS_BUCKET): the
    compiled gen layers' graphs serve both; a third request of another shape does compile (the counter
    works)."""
    from torch._dynamo.utils import counters

    pipe = _pipeline(tiny_ckpt)
    torch._dynamo.reset()  # graphs other tests compiled for these functions do not count
    pipe.transformer.compile_gen_layers(backend="eager")

    def run(p: VideoParams) -> int:
        before = counters["stats"]["unique_graphs"]
        s = pipe.prepare("r", pipe.validate(p))
        while not s.done:
            pipe.denoise([s])
        pipe.release(s)
        return counters["stats"]["unique_graphs"] - before

    assert run(_params("a cat")) > 0
    assert run(_params("a small grey cat sleeps on a warm red sofa by the window")) == 0
    assert run(_params("a cat", width=80)) > 0


def _served_latents() -> list[tuple[int, int, int]]:
    """(T, h, w) latents of the decodes a server might see, all tiny: 8 sizes, frame counts with an odd and
    an even number of latent frames after the first (a shorter last chunk at the default 2 a chunk)."""
    sizes = ((3, 5), (2, 4), (4, 3), (5, 6), (6, 5), (2, 3), (3, 2), (4, 5))
    return [(48 if i % 2 else 47, h, w) for i, (h, w) in enumerate(sizes)]


@pytest.mark.gpu
def test_compiled_vae_decode_stays_compiled_for_the_shapes_a_server_sees(tiny_ckpt):
    """Every new (size, frame count) adds graphs to ResidualBlock.forward (it compiled): none falls back to
    eager at dynamo's limit, under the limits the decode itself sets."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from worldserve.models.cosmos3.vae import VideoVAE
    from worldserve.models.cosmos3.wan_decoder_blocks import ResidualBlock

    vae = VideoVAE.from_pretrained(tiny_ckpt / "vae", dtype=torch.bfloat16, device=CUDA)
    torch._dynamo.reset()
    vae.decoder.compile(backend="eager")
    code = ResidualBlock.forward.__code__
    graphs = 0
    for t, h, w in _served_latents():  # 9-13 graphs a shape: past dynamo's default limit of 64 by the 8th
        for _ in vae.decode_frames(torch.randn(48, t, h, w, device=CUDA)):
            pass
        before, graphs = graphs, len(_debug_get_cache_entry_list(code))
        assert graphs > before, f"latents {(t, h, w)} decoded without compiling (eager fallback at {before})"

"""--max-lora-rank is part of how every rank's LoRA cache is made, not a field set on rank 0's after the load: a
CFG-parallel pipeline over 2 gloo CPU ranks (rank 0 this process, rank 1 the spawned peer, runner/
parallel_worker.py BranchRank) built with `max_lora_rank=8` holds the bound on both ranks, so the adapter a peer
reads is refused above it as rank 0's is. The bound is read-only: nothing patches it after the load.
"""

from __future__ import annotations

import shutil

import pytest
from pipeline_helpers import run_requests, two_rank_cpu_pipeline, write_random_adapter

from worldserve.params import LoraRequest, ParamError, VideoParams

BASE = dict(num_inference_steps=1, num_frames=5, height=48, width=64, seed=3, generate_sound=False)


@pytest.fixture(scope="module")
def bounded(tiny_ckpt):
    """CFG-parallel on 2 gloo CPU ranks, every rank's cache made with --max-lora-rank 8."""
    yield from two_rank_cpu_pipeline(tiny_ckpt, cfg_parallel_size=2, max_lora_rank=8)


def test_the_peer_refuses_an_adapter_above_the_bound(bounded, tiny_ckpt, tmp_path, monkeypatch):
    """Rank 0 reads a rank-8 adapter (within the bound); its folder is then replaced by a rank-16 one before the
    peer reads it. The peer's own cache refuses it in vLLM's words (without a bound there, it read the rank-16
    adapter and only its changed identity stopped it), the request alone fails with a 400 naming `lora`, the
    peer stays in step and the next request runs with the rank-8 adapter on both ranks."""
    folder = write_random_adapter(tmp_path / "style", tiny_ckpt, rank=8, alpha=8.0, seed=1)
    wide = write_random_adapter(tmp_path / "wide", tiny_ckpt, rank=16, alpha=16.0, seed=2)
    assert bounded.loras.max_rank == 8
    read = bounded.local.loras.get

    def read_then_widen(request):
        held = read(request)
        shutil.rmtree(folder)
        shutil.copytree(wide, folder)
        return held

    monkeypatch.setattr(bounded.local.loras, "get", read_then_widen)
    params = VideoParams(prompt="a fox", guidance_scale=6.0, lora=LoraRequest("style", folder, 1.0), **BASE)
    with pytest.raises(ParamError) as err:
        bounded.prepare("widened", params)
    monkeypatch.undo()
    assert err.value.param == "lora", err.value
    assert "rank 1 could not load LoRA adapter" in err.value.message, err.value.message
    assert "LoRA rank 16 is greater than max_lora_rank 8" in err.value.message, err.value.message
    assert bounded.peers.alive() and "widened" not in bounded._cfg_remote
    with pytest.raises(ParamError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        bounded.validate(params)  # (rank 0's bound, the same)
    shutil.rmtree(folder)
    write_random_adapter(folder, tiny_ckpt, rank=8, alpha=8.0, seed=1)
    [(latents, _, _)] = run_requests(bounded, [params])
    assert latents.isfinite().all()


def test_the_bound_is_fixed_when_the_cache_is_made(bounded):
    """No rank's bound is patched after the load: the cache's max_rank cannot be set."""
    with pytest.raises(AttributeError):
        bounded.loras.max_rank = None  # type: ignore[misc]
    assert bounded.loras.max_rank == 8

"""CFG-parallel over 2 gloo CPU ranks: the same final latents, sound and frames as one process.

Rank 0 is this pytest process (ParallelPipeline, one torch.distributed world per process, so the
pipeline is module-scoped and closed at the end); rank 1 is the spawned uncond peer (parallel_worker.BranchRank).
The dead-peer case lives in test_cfg_parallel_peer.py (it needs its own world).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from pipeline_helpers import rel, run_requests, two_rank_cpu_pipeline

from worldserve.config import ParallelConfig
from worldserve.params import VideoParams

BASE = dict(
    negative_prompt="blurry, distorted", num_inference_steps=3, num_frames=9, height=48, width=80,
)  # fmt: skip


@pytest.fixture(scope="module")
def cfgp(tiny_ckpt):
    yield from two_rank_cpu_pipeline(tiny_ckpt, cfg_parallel_size=2)


@pytest.mark.parametrize("guidance", [6.0, 1.0])
def test_matches_single_process(cfgp, ours_pipeline, guidance):
    params = VideoParams(prompt="A red fox runs through snow.", guidance_scale=guidance, seed=3,
                         generate_sound=True, **BASE)  # fmt: skip
    [(lat, snd, res)] = run_requests(cfgp, [params])
    [(lat1, snd1, res1)] = run_requests(ours_pipeline, [params])
    assert snd is not None
    assert rel(lat, lat1) <= 1e-5 and rel(snd, snd1) <= 1e-5
    np.testing.assert_allclose(res.frames.astype(int), res1.frames.astype(int), atol=1)
    assert np.abs(res.audio - res1.audio).max() <= 1e-4
    assert "r0" not in cfgp._cfg_remote  # released on the peer too


def test_two_requests_batched_mixed_guidance(cfgp, ours_pipeline):
    a = VideoParams(prompt="a cat", seed=7, guidance_scale=6.0, generate_sound=True, **BASE)
    b = VideoParams(prompt="a dog on a skateboard", seed=8, guidance_scale=1.0, generate_sound=True, **BASE)
    c = VideoParams(prompt="a ship at sea", seed=9, guidance_scale=4.0, generate_sound=True, **BASE)
    got = run_requests(cfgp, [a, b, c])
    want = run_requests(ours_pipeline, [a, b, c])
    for (lat, snd, _), (lat1, snd1, _) in zip(got, want, strict=True):
        assert rel(lat, lat1) <= 1e-5 and rel(snd, snd1) <= 1e-5


def test_config_accepts_1_and_2_only():
    assert ParallelConfig(cfg_parallel_size=2).cfg_parallel_size == 2
    with pytest.raises(ValueError, match="use 1 or 2"):
        ParallelConfig(cfg_parallel_size=4)


def test_guidance_interval_matches_single_process(cfgp, ours_pipeline):
    """CFG only in a timestep window (the 3 steps sit at 999, 856, 599: the last is outside): steps outside
    run the cond branch alone, here and on the uncond peer (which then gets no work); equal to one process."""
    params = VideoParams(prompt="a fox", seed=3, guidance_scale=6.0, guidance_interval=(700.0, 1000.0),
                         generate_sound=True, **BASE)  # fmt: skip
    [(lat, snd, _)] = run_requests(cfgp, [params])
    [(lat1, snd1, _)] = run_requests(ours_pipeline, [params])
    assert rel(lat, lat1) <= 1e-5 and rel(snd, snd1) <= 1e-5  # semantics: test_guidance_interval.py


def test_lora_adapter_matches_single_process(cfgp, ours_pipeline, tiny_ckpt, tmp_path):
    """The uncond peer loads the request's adapter itself (asked before the prefill) and runs its branch with
    it: the same result as one process."""
    from pipeline_helpers import write_random_adapter

    from worldserve.params import LoraRequest

    lora = LoraRequest("fox", write_random_adapter(tmp_path / "fox", tiny_ckpt, seed=6), 1.0)
    params = VideoParams(prompt="A red fox runs through snow.", guidance_scale=6.0, seed=3, generate_sound=True,
                         lora=lora, **BASE)  # fmt: skip
    [(lat, snd, _)] = run_requests(cfgp, [params])
    [(lat1, snd1, _)] = run_requests(ours_pipeline, [params])
    assert rel(lat, lat1) <= 1e-5 and rel(snd, snd1) <= 1e-5
    assert cfgp.local.loras is not None and "r0" not in cfgp._cfg_remote


@pytest.mark.parametrize("change", ["removed", "rewritten"])
def test_an_adapter_changed_before_the_peer_reads_it_fails_that_request_alone(cfgp, tiny_ckpt, tmp_path,
                                                                               monkeypatch, change):  # fmt: skip
    """Rank 0 read the adapter; its files go, or are rewritten (another adapter to the peer), before the peer
    reads them: that request is a 400 naming `lora` (the peer's reason), the peers stay up and in step, and the
    next request runs."""
    import shutil

    from pipeline_helpers import write_random_adapter

    from worldserve.params import LoraRequest, ParamError

    folder = write_random_adapter(tmp_path / "fox", tiny_ckpt, seed=9)
    weights = os.path.join(folder, "adapter_model.safetensors")
    read = cfgp.local.loras.get

    def read_then_change(request):
        held = read(request)
        if change == "removed":
            shutil.rmtree(folder)
        else:  # the same bytes written again: a new file to anyone reading it now
            data = open(weights, "rb").read()
            os.remove(weights)
            open(weights, "wb").write(data)
        return held

    monkeypatch.setattr(cfgp.local.loras, "get", read_then_change)
    params = VideoParams(prompt="A red fox runs through snow.", guidance_scale=6.0, seed=3, generate_sound=False,
                         lora=LoraRequest("fox", folder, 1.0), **BASE)  # fmt: skip
    with pytest.raises(ParamError) as err:
        cfgp.prepare("changed", params)
    assert err.value.param == "lora" and "rank 1 could not load LoRA adapter" in err.value.message
    assert ("no such file" in err.value.message) == (change == "removed"), err.value.message
    monkeypatch.undo()
    assert cfgp.peers.alive() and "changed" not in cfgp._cfg_remote
    [(lat, _, _)] = run_requests(cfgp, [dataclasses.replace(params, lora=None)])  # (the peers answer)
    assert torch.isfinite(lat).all()


def test_rank_0_runs_the_adapter_its_peers_loaded(cfgp, ours_pipeline, tiny_ckpt, tmp_path, monkeypatch):
    """Files replaced by another adapter's after the peers answered: rank 0 does not read them again (its prepare
    takes the adapter it read first), so both branches run the adapter the peers loaded: one process's result
    with the old files."""
    import shutil

    from pipeline_helpers import write_random_adapter

    from worldserve.params import LoraRequest

    folder = write_random_adapter(tmp_path / "fox", tiny_ckpt, seed=9)
    other = write_random_adapter(tmp_path / "other", tiny_ckpt, seed=10)
    weights = os.path.join(folder, "adapter_model.safetensors")
    params = VideoParams(prompt="A red fox runs through snow.", guidance_scale=6.0, seed=3, generate_sound=False,
                         lora=LoraRequest("fox", folder, 1.0), **BASE)  # fmt: skip
    [(expected, _, _)] = run_requests(ours_pipeline, [params])
    answered = cfgp._peers_load_lora

    def answered_then_replaced(*args):
        answered(*args)
        os.remove(weights)
        shutil.copy(os.path.join(other, "adapter_model.safetensors"), weights)

    monkeypatch.setattr(cfgp, "_peers_load_lora", answered_then_replaced)
    [(lat, _, _)] = run_requests(cfgp, [params])
    assert rel(lat, expected) <= 1e-5


def test_a_failed_prepare_releases_the_peers_adapter(cfgp, ours_pipeline, tiny_ckpt, tmp_path, monkeypatch):
    """Rank 0's own prepare fails after the peers loaded the request's adapter: they are told to release it, so
    a later request of the same id runs without it."""
    from pipeline_helpers import write_random_adapter

    from worldserve.params import LoraRequest, ParamError

    params = VideoParams(prompt="A red fox runs through snow.", guidance_scale=6.0, seed=3, generate_sound=False,
                         lora=LoraRequest("fox", write_random_adapter(tmp_path / "fox", tiny_ckpt, seed=9), 1.0),
                         **BASE)  # fmt: skip

    def fails(*args, **kwargs):
        raise ParamError("image", "an image that would not decode")

    monkeypatch.setattr(cfgp.local, "prepare", fails)
    with pytest.raises(ParamError, match="would not decode"):
        cfgp.prepare("r0", params)
    monkeypatch.undo()
    plain = dataclasses.replace(params, lora=None)
    [(lat, _, _)] = run_requests(cfgp, [plain])  # (the same id, r0)
    [(expected, _, _)] = run_requests(ours_pipeline, [plain])
    assert rel(lat, expected) <= 1e-5

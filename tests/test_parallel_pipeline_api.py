"""ParallelPipeline (2 gloo CPU ranks, CFG-parallel, tiny checkpoint) as a Python user meets it: loaded from the
embedded tiny checkpoint with no path (resolved once on rank 0, the peer handed the folder), used as a context
manager whose exit stops the peer, also when the block raises, and a close() after that doing nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worldserve.params import ParamError, VideoParams
from worldserve.weights.checkpoint import TINY_LAYOUT, TINY_SEED


def test_context_manager_stops_the_peers_and_close_is_idempotent(tiny_ckpt, tmp_path, monkeypatch):
    from worldserve.runner.parallel_layout import ParallelLayout
    from worldserve.runner.parallel_pipeline import ParallelPipeline

    cache = tmp_path / "cache"
    (cache / "worldserve").mkdir(parents=True)
    (cache / "worldserve" / f"tiny-cosmos3-v{TINY_LAYOUT}-seed{TINY_SEED}").symlink_to(tiny_ckpt)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    pipe = ParallelPipeline.from_pretrained(
        None, ParallelLayout(cfg=2), device="cpu", dtype=torch.float32, progress=False
    )
    params = VideoParams(prompt="a fox", num_frames=5, width=32, height=32, num_inference_steps=2,
                         guidance_scale=6.0, generate_sound=False)  # fmt: skip
    with pytest.raises(RuntimeError, match="inside the block"):
        with pipe as entered:
            assert entered is pipe
            with pytest.raises(ParamError) as info:  # (shared with VideoPipeline.generate)
                pipe.generate(dataclasses.replace(params, upsample_prompt=True))
            assert info.value.param == "upsample_prompt"
            result, _ = pipe.generate(params)
            assert result.frames.shape == (5, 32, 32, 3) and result.prompt_tokens > 0
            raise RuntimeError("inside the block")
    assert pipe.peers.closed and not pipe.process.is_alive() and pipe.process.exitcode == 0
    assert pipe.problem() is not None
    pipe.close()  # (again: nothing left to stop)
    with pipe:
        pass

"""CFG-parallel: a dead peer rank gives a clear error, quickly, instead of a hang; close() still works."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from worldserve.params import VideoParams


def test_dead_peer_raises_instead_of_hanging(tiny_ckpt):
    from worldserve.parallel.comm import PeerError
    from worldserve.runner.video_pipeline import load_pipeline

    pipe = load_pipeline(tiny_ckpt, cfg_parallel_size=2, device="cpu", dtype=torch.float32, progress=False)
    try:
        params = VideoParams(prompt="a fox", num_inference_steps=3, num_frames=5, height=32, width=32,
                             guidance_scale=6.0, generate_sound=False)  # fmt: skip
        state = pipe.prepare("r0", params)
        pipe.denoise([state])
        # the peer dies while rank 0 blocks on it (here: waiting for a message that never comes)
        threading.Timer(0.5, pipe.process.kill).start()
        t0 = time.monotonic()
        with pytest.raises(PeerError, match="gone"):
            pipe.peers.recv_object(1)
        assert time.monotonic() - t0 < 5
        pipe.process.join(10)
        t0 = time.monotonic()
        with pytest.raises(PeerError, match="peer .*(exited|gone)"):
            pipe.denoise([state])
        assert time.monotonic() - t0 < 5
        # guidance-1 requests never touch the peer: they still run
        solo = pipe.prepare("r1", VideoParams(prompt="a fox", num_inference_steps=2, num_frames=5, height=32,
                                              width=32, guidance_scale=1.0, generate_sound=False))  # fmt: skip
        pipe.denoise([solo])
        assert solo.step_index == 1
    finally:
        pipe.close()
    assert not pipe.process.is_alive()

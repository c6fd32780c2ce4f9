"""`worldserve.Engine` over a multi-GPU layout: `cfg_parallel_size=2` on 2 gloo CPU ranks (the tiny checkpoint,
float32; rank 0 is this process, the uncond branch's rank a spawned peer, runner/parallel_pipeline.py). A list
of two same-shape videos is batched and its frames are a single-rank Engine's; get_metrics() counts the batched
steps and both requests; the Reasoner, on rank 0, answers a chat with n=2; close() stops the peer process.
"""

from __future__ import annotations

import numpy as np
import psutil
import pytest
from media_probe import probe_mp4
from offline_engines import OPTIONS, TINY

PROMPTS = ["A red fox runs through fresh snow", "A cat sleeps by the fire"]
VIDEO = {**TINY, "guidance_scale": 6.0, "seed": 3, "generate_sound": False}
"""Guidance above 1: every step's uncond branch runs on the peer rank."""


def spawned_children() -> set[int]:
    """The pids of this process's children, but multiprocessing's resource tracker (started with the first
    spawned process, it lives as long as this process)."""
    children = psutil.Process().children(recursive=True)
    return {c.pid for c in children if "resource_tracker" not in " ".join(_cmdline(c))}


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        # (gone meanwhile, or a zombie: nothing of it to tell apart)
        return []


@pytest.fixture(scope="module")
def children_before() -> set[int]:
    """This process's children before the 2-rank Engine is made."""
    return spawned_children()


@pytest.fixture(scope="module")
def engine(tiny_ckpt, children_before):
    """The tiny checkpoint on 2 CPU ranks (CFG-parallel), two requests a batch."""
    from worldserve import Engine

    with Engine(tiny_ckpt, cfg_parallel_size=2, **OPTIONS) as engine:
        yield engine


def series(metrics: list, name: str) -> list:
    return [m for m in metrics if m.name == name]


def totals(metrics: list, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram family, or (value, 0) of a counter's, over its series; zeros before its
    first observation."""
    found = series(metrics, name)
    count = sum(getattr(m, "count", getattr(m, "value", 0)) for m in found)
    return count, sum(getattr(m, "sum", 0.0) for m in found)


def decoded(video: bytes) -> np.ndarray:
    probe = probe_mp4(video, decode=True)
    assert probe.frames is not None
    return np.stack(probe.frames).astype(np.int16)


def test_a_list_batches_and_matches_a_single_rank_engine(engine, tiny_ckpt):
    """Two same-shape videos: two MP4s in order, every step a batch of two (get_metrics(): the step batch size
    summing to twice the steps, both requests counted a success), whose frames are those of the same list on
    one rank within a level on average, not byte for byte: one rank runs the batch's cond and uncond rows in
    one forward of 4, the 2 ranks 2 cond rows here and 2 uncond rows on the peer, which round differently
    (test_cfg_parallel.py: latents within 1e-5). Here the second video is 0.1 levels apart on average (a few
    pixels by up to 6), the other prompt's video about 10."""
    from worldserve import Engine

    before = engine.get_metrics()
    outputs = engine.generate_video(PROMPTS, **VIDEO)
    after = engine.get_metrics()
    assert [o.prompt for o in outputs] == PROMPTS and [o.seed for o in outputs] == [3, 3]

    steps, batched = (a - b for a, b in zip(totals(after, "worldserve:step_batch_size"),
                                            totals(before, "worldserve:step_batch_size"), strict=True))  # fmt: skip
    assert steps == TINY["num_inference_steps"] and batched == 2 * steps
    succeeded = (
        totals(after, "worldserve:request_success")[0] - totals(before, "worldserve:request_success")[0]
    )
    assert succeeded == 2

    with Engine(tiny_ckpt, **OPTIONS) as single:
        alone = single.generate_video(PROMPTS, **VIDEO)
    for output, reference in zip(outputs, alone, strict=True):
        probe = probe_mp4(output.video)
        assert (probe.width, probe.height, probe.num_frames) == (64, 64, TINY["num_frames"])
        frames, want = decoded(output.video), decoded(reference.video)
        assert frames.shape == want.shape
        assert np.abs(frames - want).mean() < 1
    # (the two prompts' videos differ: the comparison above tells them apart)
    assert np.abs(decoded(outputs[0].video) - decoded(alone[1].video)).mean() > 1


def test_the_reasoner_on_rank_0_answers_n_samples(engine):
    """A chat on the 2-rank Engine: the Reasoner shares rank 0's und tower; n=2 gives two samples."""
    answer = engine.chat("What does a fox eat?", n=2, max_tokens=4, temperature=1.0, seed=5)
    assert [o.index for o in answer.outputs] == [0, 1]
    assert all(o.token_ids and o.finish_reason in ("length", "stop") for o in answer.outputs)
    assert answer.usage.completion_tokens == sum(len(o.token_ids) for o in answer.outputs)


def test_close_stops_the_peer_process(engine, children_before):
    """The peer rank is a child process while the Engine is open; close() leaves none of the Engine's."""
    peer = engine._parts.backend.process  # (private: the spawned peer rank)
    assert peer.is_alive() and peer.pid in spawned_children() - children_before
    engine.close()
    assert not peer.is_alive() and peer.exitcode == 0
    assert spawned_children() <= children_before

"""Test helpers shared by the multi-rank pipeline tests (CFG-parallel, Ulysses): run requests to the end."""

from __future__ import annotations

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of a from b, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_requests(pipe, params_list):
    """prepare every request, denoise them batched until done, decode, release ->
    [(final latents, final sound or None, VideoResult)]."""
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


def two_rank_cpu_pipeline(ckpt, **parallel):  # also more ranks: cfg x ulysses
    """Generator for a module fixture: load_pipeline(ckpt, **parallel) on 2 gloo CPU ranks in float32, yielded,
    then closed; the peer must have exited cleanly."""
    from worldserve.runner.video_pipeline import load_pipeline

    pipe = load_pipeline(ckpt, device="cpu", dtype=torch.float32, progress=False, **parallel)
    yield pipe
    pipe.close()
    assert not pipe.process.is_alive() and pipe.process.exitcode == 0


def write_random_adapter(folder, ckpt, **kwargs) -> str:
    """weights/lora_adapter.py's random PEFT adapter for the checkpoint at `ckpt` (every module LoRA applies to)."""
    from pathlib import Path

    from worldserve.models.cosmos3.config import Cosmos3Config
    from worldserve.weights.lora_adapter import write_random_adapter as write

    return write(folder, Cosmos3Config.from_json(Path(ckpt) / "transformer" / "config.json"), **kwargs)

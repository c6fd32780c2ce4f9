"""Rank 1 of CFG-parallel: `cfg_worker_main` is the spawned process's whole life (design.md anti-pattern 10:
an explicit worker_main, not a constructor that never returns).

It joins the process group, loads the transformer on its own device, says ("ready",), then serves rank 0's
messages (see runner/cfg_parallel.py) until ("stop",): "prefill" keeps one uncond und cache per request id,
"denoise" receives the latents (+ sound) of each planned request, runs one batched uncond forward with the
same GenItem / forward code as VideoPipeline and sends the velocities back, "release" drops a cache.
Any error is logged with its traceback and the process exits non-zero, which rank 0 sees as a dead peer.
It also exits when rank 0 dies (its parent process changes). Start-up and shutdown: runner/peers.py.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from worldserve.parallel import comm
from worldserve.runner.kernel_options import KernelOptions
from worldserve.runner.peers import LEADER, recv_step, run_peer
from worldserve.runner.video_pipeline import VideoPipeline, gen_item

log = logging.getLogger("worldserve.cfg_worker")


class UncondBranch:
    """The peer's model and per-request uncond caches; `forward` is VideoPipeline.forward's code path."""

    def __init__(self, transformer, device: torch.device):
        self.transformer = transformer
        self.device = device
        self.config = transformer.config
        self.caches: dict[str, object] = {}

    forward = VideoPipeline.forward  # GenBatch.pack over self.config / self.device -> transformer
    sp = VideoPipeline.sp  # no sequence parallelism here

    def prefill(self, request_id: str, ids: list[int]) -> None:
        self.caches[request_id] = self.transformer.prefill_und([torch.tensor(ids, dtype=torch.long)])[0]


def load_transformer_for(model_path: str, dtype: torch.dtype, kernels: KernelOptions, device: torch.device):
    """A peer's transformer: loaded on `device`, then `kernels` applied (as VideoPipeline.from_pretrained)."""
    from worldserve.weights.loader import load_transformer

    transformer = load_transformer(Path(model_path), dtype=dtype, device=device, progress=False)
    log.info("transformer kernels: %s", kernels.apply(transformer))
    return transformer


def _load(model_path: str, dtype: torch.dtype, kernels: KernelOptions, device: torch.device) -> UncondBranch:
    return UncondBranch(load_transformer_for(model_path, dtype, kernels, device), device)


def cfg_worker_main(
    rank: int, init_method: str, world_size: int, model_path: str, device: str,
    dtype: torch.dtype, kernels: KernelOptions,
) -> None:  # fmt: skip
    """Entry point of the spawned rank; returns after ("stop",), exits with code 1 on any error."""
    load = functools.partial(_load, model_path, dtype, kernels)
    run_peer(rank, init_method, world_size, device, "cfg", load, _serve)


@torch.inference_mode()
def _serve(branch: UncondBranch, group, dev: torch.device, leader_alive) -> None:
    while True:
        msg = comm.recv_object(LEADER, group, dev, leader_alive)
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "prefill":
            branch.prefill(msg[1], msg[2])
        elif kind == "release":
            branch.caches.pop(msg[1], None)
        elif kind == "denoise":
            _denoise(branch, msg[1], group, dev, leader_alive)
        else:
            raise ValueError(f"unknown CFG-parallel message {kind!r}")


def _denoise(branch: UncondBranch, plan, group, dev: torch.device, leader_alive) -> None:
    inputs = recv_step(plan, group, dev, leader_alive)
    items = [
        gen_item(lat, ts, branch.caches[rid], fps, clean, snd) for rid, ts, fps, clean, lat, snd in inputs
    ]
    out = branch.forward(items)
    for i, (*_, snd) in enumerate(inputs):
        comm.send_tensor(out.video[i], LEADER, group, leader_alive)
        if snd is not None:
            comm.send_tensor(out.sound[i], LEADER, group, leader_alive)

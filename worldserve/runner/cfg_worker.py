"""Rank 1 of CFG-parallel: `cfg_worker_main` is the spawned process's whole life (design.md anti-pattern 10:
an explicit worker_main, not a constructor that never returns).

It joins the process group, loads the transformer on its own device, says ("ready",), then serves rank 0's
messages (see runner/cfg_parallel.py) until ("stop",): "prefill" keeps one uncond und cache per request id,
"denoise" receives the latents (+ sound) of each planned request, runs one batched uncond forward with the
same GenItem / forward code as VideoPipeline and sends the velocities back, "release" drops a cache.
Any error is logged with its traceback and the process exits non-zero, which rank 0 sees as a dead peer.
It also exits when rank 0 dies (its parent process changes).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path

import torch

from worldserve.parallel import comm
from worldserve.runner.kernel_options import KernelOptions
from worldserve.runner.video_pipeline import VideoPipeline, gen_item

log = logging.getLogger("worldserve.cfg_worker")
LEADER = 0


class UncondBranch:
    """The peer's model and per-request uncond caches; `forward` is VideoPipeline.forward's code path."""

    def __init__(self, transformer, device: torch.device):
        self.transformer = transformer
        self.device = device
        self.config = transformer.config
        self.caches: dict[str, object] = {}

    forward = VideoPipeline.forward  # GenBatch.pack over self.config / self.device -> transformer

    def prefill(self, request_id: str, ids: list[int]) -> None:
        self.caches[request_id] = self.transformer.prefill_und([torch.tensor(ids, dtype=torch.long)])[0]


def _load(model_path: str, device: torch.device, dtype: torch.dtype, kernels: KernelOptions) -> UncondBranch:
    from worldserve.weights.loader import load_transformer

    transformer = load_transformer(Path(model_path), dtype=dtype, device=device, progress=False)
    log.info("transformer kernels: %s", kernels.apply(transformer))
    return UncondBranch(transformer, device)


def cfg_worker_main(
    rank: int, init_method: str, world_size: int, model_path: str, device: str,
    dtype: torch.dtype, kernels: KernelOptions,
) -> None:  # fmt: skip
    """Entry point of the spawned rank; returns after ("stop",), exits with code 1 on any error."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s [cfg rank {rank}] %(message)s")
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    parent = os.getppid()

    def leader_alive() -> bool:
        return os.getppid() == parent

    try:
        group = comm.init_world(
            "nccl" if dev.type == "cuda" else "gloo", init_method, rank, world_size, 1800.0
        )
        branch = _load(model_path, dev, dtype, kernels)
        comm.send_object(("ready",), LEADER, group, dev, leader_alive)
        _serve(branch, group, dev, leader_alive)
    except comm.PeerError as exc:
        log.error("rank 0 is gone (%s); exiting", exc)
        sys.exit(1)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
    finally:
        comm.destroy_world()
    # A clean stop: nothing left to flush but the logs. Skip the interpreter's teardown (torch.compile's
    # worker pools, CUDA context) that kept a 2-GPU peer alive past the leader's 30 s join.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    items = []
    for request_id, timestep, fps, clean, latent_shape, sound_shape in plan:
        latents = comm.recv_tensor(
            torch.empty(latent_shape, dtype=torch.float32, device=dev), LEADER, group, leader_alive
        )
        sound = None
        if sound_shape is not None:
            sound = comm.recv_tensor(
                torch.empty(sound_shape, dtype=torch.float32, device=dev), LEADER, group, leader_alive
            )
        ts = torch.tensor(timestep, dtype=torch.int64)
        items.append(gen_item(latents, ts, branch.caches[request_id], fps, clean, sound))
    out = branch.forward(items)
    for i, (*_, sound_shape) in enumerate(plan):
        comm.send_tensor(out.video[i], LEADER, group, leader_alive)
        if sound_shape is not None:
            comm.send_tensor(out.sound[i], LEADER, group, leader_alive)

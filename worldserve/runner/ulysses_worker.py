"""Ranks 1..P-1 of Ulysses sequence parallelism (started by runner/peers.py `peer_worker_main`).

Each peer holds a full transformer on its own GPU and mirrors rank 0's und caches (it prefills the same
prompts: "prefill" with the request's cond [, uncond] token ids). On "denoise" it receives the step inputs
(runner/peers.py `send_step`), builds exactly rank 0's GenItems (per request: one item per CFG branch, in
rank 0's order) and runs the same forward with its Ulysses group, which is where the work is shared
(parallel/ulysses.py); the velocities are gathered on every rank and rank 0 uses its own copy. "release"
drops a request's caches.
"""

from __future__ import annotations

import torch

from worldserve.parallel.groups import ParallelGroup
from worldserve.runner.peers import recv_step
from worldserve.runner.video_pipeline import VideoPipeline, gen_item


class UlyssesRank:
    """A peer's model, its Ulysses group and per-request und caches (cond, then uncond)."""

    def __init__(self, transformer, device: torch.device):
        self.transformer = transformer
        self.device = device
        self.config = transformer.config
        self.caches: dict[str, list] = {}
        self.sp: ParallelGroup | None = None

    forward = VideoPipeline.forward  # GenBatch.pack over self.config / self.device -> transformer(batch, sp)

    def prefill(self, request_id: str, prompts: list[list[int]]) -> None:
        self.caches[request_id] = self.transformer.prefill_und(
            [torch.tensor(p, dtype=torch.long) for p in prompts]
        )

    def denoise(self, plan, group, dev: torch.device, leader_alive) -> None:
        inputs = recv_step(plan, group, dev, leader_alive)
        items = [
            gen_item(lat, ts, cache, fps, clean, snd)
            for rid, ts, fps, clean, lat, snd in inputs
            for cache in self.caches[rid]
        ]
        self.forward(items)  # rank 0 keeps the (gathered) velocities

    def handlers(self, group: ParallelGroup, dev: torch.device, leader_alive) -> dict:
        self.sp = group
        return {
            "prefill": self.prefill,
            "release": lambda request_id: self.caches.pop(request_id, None),
            "denoise": lambda plan: self.denoise(plan, group, dev, leader_alive),
        }

"""Rank 1 of CFG-parallel: the uncond branch (started by runner/peers.py `peer_worker_main`).

Rank 0's messages (see runner/cfg_parallel.py) until ("stop",): "prefill" keeps one uncond und cache per
request id, "denoise" receives the latents (+ sound) of each planned request, runs one batched uncond
forward with the same GenItem / forward code as VideoPipeline and sends the velocities back, "release"
drops a cache. Any error is logged with its traceback and the process exits non-zero, which rank 0 sees
as a dead peer; it also exits when rank 0 dies.
"""

from __future__ import annotations

import torch

from worldserve.parallel import comm
from worldserve.runner.peers import LEADER, recv_step
from worldserve.runner.video_pipeline import VideoPipeline, gen_item


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

    def denoise(self, plan, group, dev: torch.device, leader_alive) -> None:
        inputs = recv_step(plan, group, dev, leader_alive)
        items = [
            gen_item(lat, ts, self.caches[rid], fps, clean, snd) for rid, ts, fps, clean, lat, snd in inputs
        ]
        out = self.forward(items)
        for i, (*_, snd) in enumerate(inputs):
            comm.send_tensor(out.video[i], LEADER, group, leader_alive)
            if snd is not None:
                comm.send_tensor(out.sound[i], LEADER, group, leader_alive)

    def handlers(self, group, dev: torch.device, leader_alive) -> dict:
        return {
            "prefill": self.prefill,
            "release": lambda request_id: self.caches.pop(request_id, None),
            "denoise": lambda plan: self.denoise(plan, group, dev, leader_alive),
        }

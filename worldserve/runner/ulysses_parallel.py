"""Ulysses sequence parallelism (`--ulysses-degree P`): every denoising forward split over P GPUs by tokens
(and by heads around attention, parallel/ulysses.py); rank 0 is this process, ranks 1..P-1 are spawned
peers (runner/ulysses_worker.py), each holding the full model on cuda:r.

`UlyssesPipeline` is the engine's VideoBackend on rank 0. Its local VideoPipeline runs everything as one
process does (prompts, noise, conditioning, CFG combine, UniPC, decode) except that its transformer
forwards run with the Ulysses group; the peers mirror each request's und caches and join every forward:
- prepare: ("prefill", request_id, [cond ids(, uncond ids)]) to every peer, then rank 0's own prepare;
- denoise: ("denoise", plan) + each request's latents (+ sound) to every peer (runner/peers.py
  `send_step`), then rank 0's own denoise; the collectives inside the forward keep the ranks in step;
- release: ("release", request_id); close: ("stop",). A dead peer raises PeerError, never a hang.
The query and KV head counts must be multiples of P (Cosmos3-Nano: 32 / 8 heads, so P in 1, 2, 4, 8).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.parallel.ulysses import check_degree
from worldserve.params import VideoParams
from worldserve.runner.kernel_options import KernelOptions
from worldserve.runner.peer_pipeline import PeerPipeline
from worldserve.runner.peers import PeerRanks, peer_worker_main, rank_devices, send_step
from worldserve.runner.video_pipeline import VideoPipeline, VideoRequestState
from worldserve.sampling.guidance import needs_uncond

log = logging.getLogger("worldserve.ulysses")


class UlyssesPipeline(PeerPipeline):
    """VideoBackend on rank 0 of a Ulysses group of P ranks."""

    def __init__(self, local: VideoPipeline, peers: PeerRanks):
        super().__init__(local, peers)
        local.sp = peers.group  # rank 0 of the world: every forward now runs sharded

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        ulysses_degree: int,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        kernels: KernelOptions | None = None,
        **kwargs,
    ) -> UlyssesPipeline:
        """Check the degree against the checkpoint's heads, spawn the peers (each loads the transformer on
        its GPU), load the full pipeline here, connect and wait for every peer's "ready"."""
        from worldserve.runner.ulysses_worker import UlyssesRank

        config = Cosmos3Config.from_json(Path(path) / "transformer" / "config.json")
        check_degree(ulysses_degree, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads)
        devices = rank_devices(device, ulysses_degree, "--ulysses-degree")
        if dtype is None:
            dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
        kernels = kernels or KernelOptions()
        peers, local = PeerRanks.start(
            "Ulysses", peer_worker_main,
            lambda r, init: (r, init, ulysses_degree, str(path), str(devices[r]), dtype, kernels, UlyssesRank,
                             "ulysses"),
            devices,
            lambda: VideoPipeline.from_pretrained(path, device=devices[0], dtype=dtype, kernels=kernels, **kwargs),
        )  # fmt: skip
        log.info("Ulysses degree %d on %s", ulysses_degree, ", ".join(map(str, devices)))
        return cls(local, peers)

    def prepare(self, request_id: str, params: VideoParams) -> VideoRequestState:
        cond, uncond = self.local.encoder.encode_params(
            params, with_uncond=needs_uncond(params.guidance_scale)
        )
        prompts = [list(cond)] + ([list(uncond)] if uncond is not None else [])
        with self._lock:
            state = self.local.prepare(request_id, params)  # first: a bad input leaves nothing on the peers
            self.peers.send(("prefill", request_id, prompts))
        return state

    @torch.inference_mode()
    def denoise(self, states: Sequence[VideoRequestState]) -> None:
        """Send the step to every peer, then run it here; the sharded forward keeps all ranks together."""
        with self._lock:
            send_step(self.peers, states)
            self.local.denoise(states)

    def release(self, state: VideoRequestState) -> None:
        self.local.release(state)
        with self._lock:
            if not self.peers.closed and self.peers.alive():
                self.peers.send(("release", state.request_id))

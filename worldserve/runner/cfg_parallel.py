"""CFG-parallel (`--cfg-parallel-size 2`): the cond branch on rank 0 (this process), the uncond branch on
rank 1 (a spawned peer, `cfg_worker.UncondBranch` behind `peers.peer_worker_main`), each holding the full model on its own device.

`CfgParallelPipeline` is the engine's VideoBackend on rank 0. It wraps a local VideoPipeline (the cond
branch, the VAEs, the tokenizer) and drives the peer with small pickled messages plus tensors, all
through parallel/comm.py:
- prepare: ("prefill", request_id, uncond ids) -> the peer prefills its own und cache for the request,
  while rank 0 prefills the cond prompt and draws the noise;
- denoise: ("denoise", plan) + each CFG request's latents (+ sound) -> both ranks run their branch's
  forward at once -> the peer sends back its velocities (model dtype) -> rank 0 does the float32 CFG
  combine and UniPC step with VideoPipeline's own code (the same numbers as one process);
- release: ("release", request_id); close: ("stop",). guidance == 1 requests never touch the peer.
Every wait polls the peer process, so a dead peer raises `PeerError` (a RuntimeError) instead of hanging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from worldserve.params import VideoParams
from worldserve.runner.kernel_options import KernelOptions
from worldserve.runner.peer_pipeline import PeerPipeline
from worldserve.runner.peers import PeerRanks, peer_worker_main, rank_devices, send_step
from worldserve.runner.video_pipeline import VideoPipeline, VideoRequestState, branch_items
from worldserve.sampling.guidance import needs_uncond

log = logging.getLogger("worldserve.cfg_parallel")
PEER = 1


def cfg_devices(device: str | torch.device | None) -> tuple[torch.device, torch.device]:
    """(rank 0, rank 1) devices: cuda:0 / cuda:1 by default; cpu / cpu only when asked explicitly."""
    dev0, dev1 = rank_devices(device, 2, "--cfg-parallel-size")
    return dev0, dev1


class CfgParallelPipeline(PeerPipeline):
    """VideoBackend on rank 0: local cond branch + one peer rank for the uncond branch."""

    def __init__(self, local: VideoPipeline, peers: PeerRanks):
        super().__init__(local, peers)
        self._remote: set[str] = set()  # request ids whose uncond branch lives on the peer

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        kernels: KernelOptions | None = None,
        **kwargs,
    ) -> CfgParallelPipeline:
        """Spawn the peer (it loads the transformer on the second device), load the full local pipeline on
        the first, connect (NCCL on CUDA, gloo on CPU) and wait for the peer's "ready"."""
        from worldserve.runner.cfg_worker import UncondBranch

        devices = list(cfg_devices(device))
        if dtype is None:
            dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
        kernels = kernels or KernelOptions()
        peers, local = PeerRanks.start(
            "CFG-parallel", peer_worker_main,
            lambda r, init: (r, init, 2, str(path), str(devices[r]), dtype, kernels, UncondBranch, "cfg"), devices,
            lambda: VideoPipeline.from_pretrained(path, device=devices[0], dtype=dtype, kernels=kernels, **kwargs),
        )  # fmt: skip
        log.info(
            "CFG-parallel: cond branch on %s, uncond branch on %s (pid %d)", *devices, peers.processes[0].pid
        )
        return cls(local, peers)

    # ------------------------------------------------------------------ VideoBackend
    def prepare(self, request_id: str, params: VideoParams) -> VideoRequestState:
        if not needs_uncond(params.guidance_scale):
            return self.local.prepare(request_id, params)
        _, uncond_ids = self.local.encoder.encode_params(params, with_uncond=True)
        with self._lock:
            self.peers.send(("prefill", request_id, list(uncond_ids)))
            self._remote.add(request_id)
        return self.local.prepare(request_id, params, prefill_uncond=False)

    @torch.inference_mode()
    def denoise(self, states: Sequence[VideoRequestState]) -> None:
        """Send the CFG requests' step to the peer, run the cond (and guidance-1) branches here, combine."""
        t0 = time.perf_counter()
        remote = [s for s in states if s.request_id in self._remote]
        with self._lock:
            if remote:
                send_step(self.peers, remote)
            out = self.local.forward([it for s in states for it in branch_items(s, s.und_caches)])
            peer: dict[str, tuple] = {}
            for s in remote:  # the peer sends in plan order: video velocity, then sound velocity
                dt = self.local.transformer.dtype
                dev = self.peers.comm_device
                v = self.peers.recv_tensor(torch.empty(s.latents.shape, dtype=dt, device=dev), PEER)
                vs = None
                if s.sound is not None:
                    vs = self.peers.recv_tensor(torch.empty(s.sound.shape, dtype=dt, device=dev), PEER)
                peer[s.request_id] = (v, vs)
        row = 0
        for s in states:
            n = len(s.und_caches)
            v_video = list(out.video[row : row + n])
            v_sound = list(out.sound[row : row + n]) if s.sound is not None else None
            if s.request_id in peer:
                v, vs = peer[s.request_id]
                v_video.append(v)
                if v_sound is not None:
                    v_sound.append(vs)
            self.local.combine_and_step(s, v_video, v_sound)
            row += n
        self.local.finish_step(states, t0)

    def release(self, state: VideoRequestState) -> None:
        self.local.release(state)
        with self._lock:
            if state.request_id in self._remote:
                self._remote.discard(state.request_id)
                if not self.peers.closed and self.peers.alive():
                    self.peers.send(("release", state.request_id))

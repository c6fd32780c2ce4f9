"""CFG-parallel (`--cfg-parallel-size 2`): the cond branch on rank 0 (this process), the uncond branch on
rank 1 (a spawned peer, `cfg_worker.cfg_worker_main`), each holding the full model on its own device.

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
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from worldserve.parallel import comm
from worldserve.params import VideoParams
from worldserve.runner.kernel_options import KernelOptions
from worldserve.runner.video_pipeline import VideoPipeline, VideoRequestState, branch_items, default_device
from worldserve.sampling.guidance import needs_uncond

log = logging.getLogger("worldserve.cfg_parallel")
PEER = 1
INIT_TIMEOUT_S = 1800.0
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
"""Set (setdefault) before the peer is spawned: no NVLink multicast on the lent H200 hosts."""


def cfg_devices(device: str | torch.device | None) -> tuple[torch.device, torch.device]:
    """(rank 0, rank 1) devices: cuda:0 / cuda:1 by default; cpu / cpu only when asked explicitly."""
    if device is not None and torch.device(device).type == "cpu":
        return torch.device("cpu"), torch.device("cpu")
    if device is not None and str(device) != "cuda":
        raise ValueError(f"--cfg-parallel-size 2 runs on cuda:0 and cuda:1; use --device cuda, got {device}")
    if default_device().type != "cuda" or torch.cuda.device_count() < 2:
        raise ValueError(
            "--cfg-parallel-size 2 needs 2 CUDA GPUs (cuda:0, cuda:1); "
            f"{torch.cuda.device_count()} visible. Run with --cfg-parallel-size 1"
        )
    return torch.device("cuda", 0), torch.device("cuda", 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CfgParallelPipeline:
    """VideoBackend on rank 0: local cond branch + one peer rank for the uncond branch."""

    def __init__(self, local: VideoPipeline, process, group: comm.ParallelGroup):
        self.local = local
        self.process = process
        self.group = group
        self.comm_device = local.device  # NCCL: rank 0's GPU; gloo: cpu
        self._remote: set[str] = set()  # request ids whose uncond branch lives on the peer
        self._lock = threading.Lock()  # one conversation with the peer at a time
        self._closed = False

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
        import torch.multiprocessing as mp

        from worldserve.runner.cfg_worker import cfg_worker_main

        if comm.world_initialized():
            raise RuntimeError(
                "a torch.distributed world already exists in this process (one CfgParallelPipeline at a time)"
            )
        dev0, dev1 = cfg_devices(device)
        if dtype is None:
            dtype = torch.bfloat16 if dev0.type == "cuda" else torch.float32
        for k, v in NCCL_ENV.items():
            os.environ.setdefault(k, v)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        proc = mp.get_context("spawn").Process(
            target=cfg_worker_main, name="worldserve-cfg-rank1", daemon=True,
            args=(PEER, init_method, 2, str(path), str(dev1), dtype, kernels or KernelOptions()),
        )  # fmt: skip
        proc.start()
        try:
            local = VideoPipeline.from_pretrained(path, device=dev0, dtype=dtype, kernels=kernels, **kwargs)
            if dev0.type == "cuda":
                torch.cuda.set_device(dev0)
            if not proc.is_alive():
                raise comm.PeerError(f"CFG-parallel peer exited during start-up (exit code {proc.exitcode})")
            group = comm.init_world(
                "nccl" if dev0.type == "cuda" else "gloo", init_method, 0, 2, INIT_TIMEOUT_S
            )
            self = cls(local, proc, group)
            ready = self._recv_object()
            if ready != ("ready",):
                raise comm.PeerError(f"unexpected first message from the CFG-parallel peer: {ready!r}")
        except BaseException:
            proc.kill()
            proc.join(5)
            comm.destroy_world()
            raise
        log.info("CFG-parallel: cond branch on %s, uncond branch on %s (pid %d)", dev0, dev1, proc.pid)
        return self

    # ------------------------------------------------------------------ peer messages
    def _alive(self) -> bool:
        return self.process.is_alive()

    def _check_peer(self) -> None:
        if self._closed:
            raise RuntimeError("CfgParallelPipeline is closed")
        if not self._alive():
            raise comm.PeerError(
                f"CFG-parallel peer (rank 1, pid {self.process.pid}) exited with code {self.process.exitcode}; "
                "see its log above. Restart the server"
            )

    def _send(self, msg) -> None:
        self._check_peer()
        try:
            comm.send_object(msg, PEER, self.group, self.comm_device, self._alive)
        except comm.PeerError as exc:
            raise comm.PeerError(f"CFG-parallel peer (rank 1) is gone: {exc}") from exc

    def _recv_object(self):
        try:
            return comm.recv_object(PEER, self.group, self.comm_device, self._alive)
        except comm.PeerError as exc:
            raise comm.PeerError(
                f"CFG-parallel peer (rank 1) is gone (exit code {self.process.exitcode}): {exc}"
            ) from exc

    def _recv_tensor(self, out: torch.Tensor) -> torch.Tensor:
        try:
            return comm.recv_tensor(out, PEER, self.group, self._alive)
        except comm.PeerError as exc:
            raise comm.PeerError(
                f"CFG-parallel peer (rank 1) is gone (exit code {self.process.exitcode}): {exc}"
            ) from exc

    # ------------------------------------------------------------------ VideoBackend
    @property
    def has_sound(self) -> bool:
        return self.local.has_sound

    @property
    def transformer(self):
        """Rank 0's transformer (the Reasoner shares its und tower)."""
        return self.local.transformer

    @property
    def encoder(self):
        return self.local.encoder

    @property
    def device(self) -> torch.device:
        return self.local.device

    def validate(self, params: VideoParams) -> VideoParams:
        return self.local.validate(params)

    def sound_enabled(self, params: VideoParams) -> bool:
        return self.local.sound_enabled(params)

    def prepare(self, request_id: str, params: VideoParams) -> VideoRequestState:
        if not needs_uncond(params.guidance_scale):
            return self.local.prepare(request_id, params)
        _, uncond_ids = self.local.encoder.encode_params(params, with_uncond=True)
        with self._lock:
            self._send(("prefill", request_id, list(uncond_ids)))
            self._remote.add(request_id)
        return self.local.prepare(request_id, params, prefill_uncond=False)

    @torch.inference_mode()
    def denoise(self, states: Sequence[VideoRequestState]) -> None:
        """Send the CFG requests' step to the peer, run the cond (and guidance-1) branches here, combine."""
        t0 = time.perf_counter()
        remote = [s for s in states if s.request_id in self._remote]
        with self._lock:
            if remote:
                plan = [
                    (s.request_id, int(s.schedule.timesteps[s.step_index]), float(s.params.fps), s.clean_frames,
                     tuple(s.latents.shape), None if s.sound is None else tuple(s.sound.shape))
                    for s in remote
                ]  # fmt: skip
                self._send(("denoise", plan))
                for s in remote:
                    self._send_tensor(s.latents)
                    if s.sound is not None:
                        self._send_tensor(s.sound)
            out = self.local.forward([it for s in states for it in branch_items(s, s.und_caches)])
            peer: dict[str, tuple] = {}
            for s in remote:  # the peer sends in plan order: video velocity, then sound velocity
                dt = self.local.transformer.dtype
                v = self._recv_tensor(torch.empty(s.latents.shape, dtype=dt, device=self.comm_device))
                vs = None
                if s.sound is not None:
                    vs = self._recv_tensor(torch.empty(s.sound.shape, dtype=dt, device=self.comm_device))
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

    def _send_tensor(self, x: torch.Tensor) -> None:
        try:
            comm.send_tensor(x.to(self.comm_device), PEER, self.group, self._alive)
        except comm.PeerError as exc:
            raise comm.PeerError(f"CFG-parallel peer (rank 1) is gone: {exc}") from exc

    def decode(self, state: VideoRequestState):
        return self.local.decode(state)

    def release(self, state: VideoRequestState) -> None:
        self.local.release(state)
        with self._lock:
            if state.request_id in self._remote:
                self._remote.discard(state.request_id)
                if not self._closed and self._alive():
                    self._send(("release", state.request_id))

    generate = VideoPipeline.generate  # validate -> prepare -> denoise... -> decode, through this class

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the peer ("stop"), destroy the process group (both ranks tear it down at once, so
        neither waits on the other), then join the peer (killed after `timeout_s`)."""
        if self._closed:
            return
        with self._lock:
            try:
                if self._alive():
                    self._send(("stop",))
            except comm.PeerError:
                pass
            self._closed = True
            comm.destroy_world()
            self.process.join(timeout_s)
            if self.process.is_alive():
                log.warning("CFG-parallel peer did not stop within %gs; killing it", timeout_s)
                self.process.kill()
                self.process.join(5)

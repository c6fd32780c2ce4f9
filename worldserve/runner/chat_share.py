"""Chat decoding alongside video denoising on one GPU: the Reasoner's stream and the SMs video leaves free.

Without this, chat and video take the model lock step by step, so while a 720p video denoises a chat gets
one token per 5.3 s step. With it (CUDA, one rank of the und tower, no layerwise offload, the decode step
captured at start), the Reasoner's work runs on its own high-priority CUDA stream from the chat worker's
thread without the model lock (the und weights are read-only to both; the chats' paged K/V, the decode
graphs' buffers and the sampler belong to the chat side, the video's und caches to the video side), and
while chats are live the video's FA3 calls leave `sm_margin` SMs idle (FA3's persistent kernels otherwise
hold every SM for ~50 ms; the gen tower's FA4 cluster kernel, which has no margin, hands its calls to FA3
meanwhile: models/layers/fa4_cluster.py). cuBLAS is asked to do the same (`torch._C._set_sm_carveout_experimental`), which
PyTorch applies to its cuBLASLt GEMMs only (with bias, fp8); the plain bf16 GEMMs (cublasGemmEx, 35 % of a
step) still take every SM, and chat kernels get in between them. Measured (bench/chat_during_video.py, one
H200, full-size Nano, 8 chats of 300 tokens against a 720p x 189 + audio step,
bench/results/chat-during-video-20261130-h200.json):

| margin | video step alone | video step with chats | chat decode step | tokens/s per chat |
|---|---|---|---|---|
| 0 | 5.38 s | 5.42 s | 261 ms | 3.8 |
| 16 (default) | 5.64 s | 5.92 s | 38 ms | 26.5 |
| 32 | 5.97 s | 6.66 s | 18 ms | 57.0 |

(the lock gave one token per step: 0.19 tokens/s; the decode step alone takes 6.2 ms). The margin applies
only while a chat is live; `--chat-sm-margin 0` keeps video at full speed and chats at ~4 tokens/s.
The margin is process-wide state (FA3's argument, cuBLAS's carve-out), raised before a chat's prefill and
dropped with the last chat, read by the video thread when it launches a kernel; the video forward queues at
most LAUNCH_WINDOW_LAYERS layers ahead of the GPU (transformer.LaunchWindow), so a change reaches the GPU
within ~0.3 s at 720p instead of a queued 5 s step later. The chat's own prefill kernels see it too.
Under CFG-parallel / Ulysses serving only rank 0 (where the Reasoner lives) applies the margin.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from worldserve.models.layers import flash_attention

DEFAULT_CHAT_SM_MARGIN = 16
LAUNCH_WINDOW_LAYERS = 2
"""Gen layers a video forward may queue ahead of the GPU while chats can run beside it (~0.3 s at 720p):
a margin switched on or off reaches the video's kernels that soon, not a whole queued step later."""


def set_sm_margin(margin: int) -> None:
    """SMs the next FA3 and cuBLAS kernels leave free for other streams (0: use them all)."""
    flash_attention.set_fa3_sm_margin(margin)
    if hasattr(torch._C, "_set_sm_carveout_experimental"):
        torch._C._set_sm_carveout_experimental(margin if margin else None)


class ChatGpuShare:
    """The Reasoner's side of sharing the GPU with video steps (see the module docstring)."""

    def __init__(self, transformer: Any, *, sm_margin: int = DEFAULT_CHAT_SM_MARGIN) -> None:
        if sm_margin < 0:
            raise ValueError(f"--chat-sm-margin must be >= 0, got {sm_margin}")
        device = transformer.device
        self.transformer = transformer
        self.sm_margin = sm_margin
        self.why_not = self._why_not(transformer)
        self.stream = torch.cuda.Stream(device, priority=-1) if self.why_not is None else None
        self.ready = False  # mark_ready(): the decode graphs are captured (no capture may run beside video)
        self._margin_on = False

    @staticmethod
    def _why_not(transformer: Any) -> str | None:
        if transformer.device.type != "cuda":
            return "not on a CUDA device"
        if transformer.und_blocks is not None:
            return "layerwise offload streams the und blocks through slots the video step also uses"
        if transformer.layers[0].und.tp_size != 1:
            return "tensor parallel und layers take collectives in the video step's order"
        return None

    def mark_ready(self) -> None:
        """The decode graphs are captured: from now on chat work may run on the stream (ordered after all
        the work queued so far on the current one, e.g. the pool's and the graphs' buffers)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self.transformer.launch_window = LAUNCH_WINDOW_LAYERS
            self.ready = True

    @property
    def concurrent(self) -> bool:
        """Whether chat calls may run without the model lock, alongside video steps."""
        return self.stream is not None and self.ready

    def context(self) -> contextlib.AbstractContextManager[object]:
        """Where the Reasoner's GPU work runs: its own stream when concurrent."""
        return torch.cuda.stream(self.stream) if self.concurrent else contextlib.nullcontext()

    def chats_live(self, live: int) -> None:
        """The Reasoner's live chat count changed: hold the SM margin while any is live."""
        want = self.concurrent and live > 0 and self.sm_margin > 0
        if want != self._margin_on:
            set_sm_margin(self.sm_margin if want else 0)
            self._margin_on = want

"""`PeerPipeline`: rank 0's VideoBackend when peer ranks share the work (CFG-parallel, Ulysses).

It wraps a local VideoPipeline (which keeps the tokenizer, the VAEs, the sampler state and rank 0's
transformer, whose und tower the Reasoner shares) and a `PeerRanks` handle; subclasses decide what the
peers do in `prepare` / `denoise` / `release`. One conversation with the peers at a time (`_lock`).
"""

from __future__ import annotations

import threading

import torch

from worldserve.params import VideoParams
from worldserve.runner.peers import PeerRanks
from worldserve.runner.video_pipeline import VideoPipeline, VideoRequestState


class PeerPipeline:
    """The VideoBackend calls that only rank 0 serves, plus peer bookkeeping."""

    def __init__(self, local: VideoPipeline, peers: PeerRanks):
        self.local = local
        self.peers = peers
        self._lock = threading.Lock()

    @property
    def process(self):
        """The rank 1 process."""
        return self.peers.processes[0]

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

    def decode(self, state: VideoRequestState):
        return self.local.decode(state)

    generate = VideoPipeline.generate  # validate -> prepare -> denoise... -> decode, through the subclass

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the peers and tear the process group down (runner/peers.py)."""
        with self._lock:
            self.peers.close(timeout_s)

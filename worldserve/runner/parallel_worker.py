"""Ranks 1.. of a multi-GPU pipeline (runner/parallel_layout.py): one branch group's share of each forward.

A `BranchRank` holds the full transformer on its GPU and mirrors the und caches its branch needs: the cond
group keeps what rank 0 keeps (cond, plus uncond when both branches share the group), the uncond group keeps
the uncond prompt of CFG requests. On "denoise" it receives the step inputs (runner/peers.py `send_step`),
builds its branch's GenItems in rank 0's order and runs the forward with its Ulysses group (with tensor
parallelism its transformer holds 1/T of every weight, and prefill and forward are collectives that rank 0
runs at the same time); the first rank
of the uncond group sends the uncond velocities (video, then sound, per CFG request in plan order) to rank
0. "lora" loads a request's unmerged adapter before its prefill and answers rank 0 (None, or why it could not:
rank 0 then fails that request alone); its cache is made with rank 0's --max-lora-rank, so the adapter a peer
reads is held to the bound rank 0's was. "release" drops a request's caches. Started by runner/peers.py
`peer_worker_main`, which handles errors and shutdown: it builds the BranchRank right after joining the world
(its Ulysses group is created with every rank's, before any of them loads), then loads the transformer into it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from worldserve.models.cosmos3.batch import GenBatch, GenItem, GenOutput
from worldserve.models.layers.lora import LoraWeights
from worldserve.parallel import comm
from worldserve.parallel.groups import ParallelGroup
from worldserve.params import LoraRequest
from worldserve.runner.lora_cache import DEFAULT_MAX_LOADED, LoraCache
from worldserve.runner.parallel_layout import COND, ParallelLayout
from worldserve.runner.peers import LEADER, recv_step
from worldserve.runner.video_state import gen_item

if TYPE_CHECKING:
    from worldserve.models.cosmos3.config import Cosmos3Config
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer


class BranchRank:
    """A peer's model (whole, or its tensor-parallel slices), branch, Ulysses group and per-request und caches."""

    def __init__(
        self, device: torch.device, layout: ParallelLayout, rank: int, max_loras: int = DEFAULT_MAX_LOADED,
        max_lora_rank: int | None = None,
    ):  # fmt: skip
        self.device = device
        self.layout, self.rank = layout, rank
        self.branch = layout.branch(rank)
        self.caches: dict[str, list] = {}
        # (rank 0's bounds: --max-cpu-loras, --max-lora-rank; the cache is made with them in `load`)
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.loras: LoraCache | None = None  # (made with the transformer it loads adapters for)
        self.lora_of: dict[str, LoraWeights | None] = {}  # request id -> its adapter, as rank 0's
        self.sp: ParallelGroup = layout.branch_group(rank)  # collective: every rank, right after joining
        self.transformer: Cosmos3Transformer | None = None
        self.config: Cosmos3Config | None = None

    def load(self, transformer: Cosmos3Transformer) -> BranchRank:
        """Take the loaded transformer (whole, or this rank's tensor-parallel slices)."""
        self.transformer, self.config = transformer, transformer.config
        self.loras = LoraCache(transformer, self.max_loras, self.max_lora_rank)
        return self

    def _loaded(self) -> tuple[Cosmos3Transformer, LoraCache]:
        """The transformer and its adapters (peers.py loads them before this rank takes any message)."""
        if self.transformer is None or self.loras is None:
            raise RuntimeError(f"rank {self.rank} got a request before its transformer was loaded")
        return self.transformer, self.loras

    def forward(self, items: Sequence[GenItem], lora: LoraWeights | None = None) -> GenOutput:
        """One forward over `items` with this rank's Ulysses group (as VideoPipeline.forward on rank 0)."""
        transformer, _ = self._loaded()
        return transformer(GenBatch.pack(items, config=transformer.config, device=self.device), self.sp, lora)

    def prefill(
        self, request_id: str, cond: list[int], uncond: list[int] | None, lora: LoraRequest | None = None
    ) -> None:
        if self.branch == COND:
            prompts = [cond] + ([uncond] if uncond is not None and self.layout.cfg == 1 else [])
        elif uncond is not None:
            prompts = [uncond]
        else:
            return  # a guidance-1 request: nothing for the uncond group
        # (loaded on "lora" for an unmerged adapter; else the merged one's und deltas, or none)
        transformer, loras = self._loaded()
        weights = self.lora_of[request_id] if request_id in self.lora_of else loras.get(lora)
        self.caches[request_id] = transformer.prefill_und(
            [torch.tensor(p, dtype=torch.long) for p in prompts], lora=weights
        )
        self.lora_of[request_id] = weights

    def load_lora(
        self, request_id: str, lora: LoraRequest, identity: tuple | None, group: ParallelGroup,
        dev: torch.device, leader_alive: Callable[[], bool],
    ) -> None:  # fmt: skip
        """Load the request's adapter (this rank's slices) and answer rank 0: None, or why not. Rank 0 read the
        files first; they may have gone or changed since (`identity`: what rank 0 read; None when rank 0 merged
        it), and this rank must run the adapter rank 0 runs. Merged here, it takes its merge's rest."""
        try:
            transformer, loras = self._loaded()
            weights = loras.get(lora)
            unmerged = transformer.merged_lora is None
            if unmerged and identity is not None and (weights is None or weights.key[0] != identity):
                raise ValueError("its files changed while the request was being prepared; send it again")
            self.lora_of[request_id] = weights
            answer = None
        except Exception as exc:  # (anything: rank 0 fails this request alone, the peers stay in step)
            answer = (
                f"rank {self.rank} could not load LoRA adapter {lora.path}: {getattr(exc, 'message', exc)}"
            )
        comm.send_object(answer, LEADER, group, dev, leader_alive)

    def denoise(
        self, plan: Sequence[tuple], group: ParallelGroup, dev: torch.device, leader_alive: Callable[[], bool]
    ) -> None:
        inputs = [x for x in recv_step(plan, group, dev, leader_alive) if x[0] in self.caches]
        items = [
            gen_item(lat, ts, cache, fps, clean, snd)
            for rid, ts, fps, clean, lat, snd, is_guided in inputs
            for cache in (self.caches[rid] if is_guided else self.caches[rid][:1])  # cond alone: no CFG now
        ]
        if not items:
            return
        out = self.forward(items, self.lora_of.get(inputs[0][0]))  # (rank 0 batches one adapter a step)
        if self.branch != COND and self.rank == self.layout.uncond_leader:
            for i, (*_, snd, _guided) in enumerate(inputs):  # one uncond item per CFG request
                comm.send_tensor(out.video[i], LEADER, group, leader_alive)
                if snd is not None:
                    comm.send_tensor(out.sound[i], LEADER, group, leader_alive)

    def release(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
        self.lora_of.pop(request_id, None)

    def handlers(
        self, group: ParallelGroup, dev: torch.device, leader_alive: Callable[[], bool]
    ) -> dict[str, Callable[..., None]]:
        return {
            "prefill": self.prefill,
            "lora": lambda rid, lora, identity: self.load_lora(rid, lora, identity, group, dev, leader_alive),
            "release": self.release,
            "denoise": lambda plan: self.denoise(plan, group, dev, leader_alive),
        }

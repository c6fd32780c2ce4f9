"""Which rank does what when several GPUs share one request: CFG branches x Ulysses shards.

With `--tensor-parallel-size T` alone, T ranks hold 1/T of every weight matrix (both towers; the und tower's
collectives too, so the peers mirror every prefill) and run every transformer call together.
With `--cfg-parallel-size C` (1 or 2) and `--ulysses-degree U`, C x U ranks (one GPU each, cuda:r) form C
branch groups of U consecutive ranks: ranks [0, U) run the cond branch (and guidance-1 requests), ranks
[U, 2U) the uncond branch of CFG requests. Inside a branch group every forward is split by tokens (Ulysses,
parallel/ulysses.py); across groups nothing is exchanged but the uncond velocities, which the first rank of
the uncond group sends to rank 0. Rank 0 is the process that serves (runner/parallel_pipeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from worldserve.parallel.groups import SINGLE, ParallelGroup

COND, UNCOND = 0, 1
COLLECTIVE_TIMEOUT_S = 300.0
"""Timeout of the branch groups' all-to-alls: a forward that waits this long on a rank is a dead rank (the
world group keeps the long start-up timeout that model loading needs)."""
GROUP_SETUP_TIMEOUT_S = 60.0
"""Timeout of a branch group's creation: every rank creates it right after joining, before any loads, so a
wait this long is a rank that died meanwhile (rank 0 then names it: runner/peers.py)."""


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    cfg: int = 1
    """CFG branch groups: 1 (both branches batched in one forward) or 2 (one group a branch)."""
    ulysses: int = 1
    """Ranks per branch group (the Ulysses degree)."""
    tp: int = 1
    """Tensor-parallel degree: every weight matrix of both towers split over this many ranks (alone only)."""

    def __post_init__(self) -> None:
        for flag, value in (("--ulysses-degree", self.ulysses), ("--tensor-parallel-size", self.tp)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.cfg not in (1, 2):
            raise ValueError(
                f"--cfg-parallel-size {self.cfg} is not supported: use 1 or 2 (the two CFG branches)"
            )
        if self.tp > 1 and self.cfg * self.ulysses > 1:
            raise ValueError(
                "--tensor-parallel-size > 1 runs alone in this version: drop --cfg-parallel-size / --ulysses-degree"
            )

    @property
    def world(self) -> int:
        return self.cfg * self.ulysses * self.tp

    @property
    def flags(self) -> str:
        """The command-line flags that asked for this layout, for error messages."""
        asked = (("--cfg-parallel-size", self.cfg), ("--ulysses-degree", self.ulysses),
                 ("--tensor-parallel-size", self.tp))  # fmt: skip
        return " ".join(f"{flag} {n}" for flag, n in asked if n > 1) or "--cfg-parallel-size 1"

    def tp_group(self, rank: int) -> ParallelGroup:
        """`rank`'s tensor-parallel group: the whole world (tp runs alone), or none."""
        return ParallelGroup(rank=rank, size=self.tp) if self.tp > 1 else SINGLE

    @property
    def per_branch(self) -> int:
        """Ranks of one branch group (Ulysses or tensor-parallel ranks)."""
        return self.ulysses * self.tp

    def branch(self, rank: int) -> int:
        """COND or UNCOND: the branch group of `rank`."""
        return rank // self.per_branch

    @property
    def uncond_leader(self) -> int:
        """The rank that sends the uncond velocities to rank 0 (cfg == 2 only)."""
        return self.per_branch

    def branch_group(self, rank: int) -> ParallelGroup:
        """`rank`'s Ulysses group (its own process group: created within GROUP_SETUP_TIMEOUT_S, its collectives
        COLLECTIVE_TIMEOUT_S). Collective: every rank of the world calls it once, right after connecting,
        before any other collective."""
        if self.ulysses == 1:
            return SINGLE
        from worldserve.parallel import comm  # (torch: this module is imported by config.py)

        groups = [
            comm.new_group(
                list(range(b * self.ulysses, (b + 1) * self.ulysses)),
                GROUP_SETUP_TIMEOUT_S,
                COLLECTIVE_TIMEOUT_S,
            )
            for b in range(self.cfg)
        ]
        return ParallelGroup(rank=rank % self.ulysses, size=self.ulysses, group=groups[self.branch(rank)])

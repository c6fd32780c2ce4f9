"""Process-group handles passed to the model: which rank of how many, and the torch.distributed group.

Only the tensor-parallel seam exists so far. At size 1 (the default, `SINGLE`) nothing is distributed,
the layers are plain linears and `comm` calls return their input untouched. Creating real groups
(`torch.distributed.new_group`) is the runner's job; this module only describes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelGroup:
    rank: int = 0
    """This process's index in the group."""
    size: int = 1
    """Number of ranks in the group."""
    group: Any = None
    """torch.distributed ProcessGroup (None when size == 1)."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad parallel group rank={self.rank} size={self.size}")


SINGLE = ParallelGroup()
"""The world-size-1 group: no communication at all."""

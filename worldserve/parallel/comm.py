"""Collectives used by the model layers; the only module that calls torch.distributed.

Every function is the identity when the group has one rank, so single-device code pays nothing and
tests can fake a world by handing in a group whose `size` is 1.
"""

from __future__ import annotations

from torch import Tensor

from worldserve.parallel.groups import ParallelGroup


def all_reduce(x: Tensor, group: ParallelGroup) -> Tensor:
    """Sum `x` over the ranks of `group` (in place) and return it."""
    if group.size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=group.group)
    return x

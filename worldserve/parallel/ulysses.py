"""Ulysses sequence parallelism (`--ulysses-degree P`): the gen stream split by tokens, attention by heads.

Each of the P ranks holds the whole model and 1/P of the packed gen tokens (padded to a multiple of P).
Around attention, one all-to-all turns "my tokens, all heads" into "all tokens, my heads" (q [N/P, H, D] ->
[N, H/P, D]; k, v likewise with the KV heads), so every rank attends over the full sequence for its heads
(and the matching GQA KV heads, since H/P query heads map onto Hkv/P KV heads when P divides Hkv); a second
all-to-all brings the output back to "my tokens, all heads" for o_proj and the MLP. Per layer that is 4
all-to-alls of (N/P) x (H + 2 Hkv) x D / P elements each way: no weights move and nothing is replicated
except the model itself. The text K/V of each prompt are computed in full on every rank (und prefill is
tiny) and sliced to the rank's KV heads.

`shard` / `gather` split and rebuild the packed stream; the all-to-alls are `seq_to_heads` / `heads_to_seq`.
All are the identity at size 1. The collectives themselves are comm.py's (NCCL on GPU, gloo on CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from worldserve.parallel import comm
from worldserve.parallel.groups import ParallelGroup


def padded_len(n: int, sp: ParallelGroup) -> int:
    """n rounded up to a multiple of the group size."""
    return -(-n // sp.size) * sp.size


def shard(x: Tensor, sp: ParallelGroup) -> Tensor:
    """Rows [N, ...] -> this rank's contiguous block of the rows padded (zeros) to a multiple of P."""
    if sp.size == 1:
        return x
    n_pad = padded_len(x.shape[0], sp)
    if n_pad != x.shape[0]:
        x = torch.cat([x, x.new_zeros(n_pad - x.shape[0], *x.shape[1:])])
    per = n_pad // sp.size
    return x[sp.rank * per : (sp.rank + 1) * per]


def gather(x: Tensor, n: int, sp: ParallelGroup) -> Tensor:
    """Every rank's block [N_pad / P, ...] -> the first n rows of their concatenation [n, ...], on every rank."""
    if sp.size == 1:
        return x
    return comm.all_gather_rows(x, sp)[:n]


def seq_to_heads(x: Tensor, sp: ParallelGroup) -> Tensor:
    """[N/P, H, D] (my tokens, all heads) -> [N, H/P, D] (all tokens in order, my heads)."""
    if sp.size == 1:
        return x
    n, h, d = x.shape
    p = sp.size
    send = x.reshape(n, p, h // p, d).transpose(0, 1).contiguous()  # [P, N/P, H/P, D]: block j -> rank j
    recv = comm.all_to_all_blocks(send, sp)  # block j: rank j's tokens, my heads
    return recv.reshape(p * n, h // p, d)


def heads_to_seq(x: Tensor, sp: ParallelGroup) -> Tensor:
    """[N, H/P, D] (all tokens, my heads) -> [N/P, H, D] (my tokens, all heads in order)."""
    if sp.size == 1:
        return x
    n_all, hp, d = x.shape
    p = sp.size
    send = x.reshape(p, n_all // p, hp, d).contiguous()  # block j: rank j's tokens
    recv = comm.all_to_all_blocks(send, sp)  # block j: my tokens, rank j's heads
    return recv.transpose(0, 1).reshape(n_all // p, p * hp, d)


def head_slice(x: Tensor, sp: ParallelGroup) -> Tensor:
    """[L, H, D] -> this rank's heads [L, H/P, D] (the text K/V of the und cache)."""
    if sp.size == 1:
        return x
    per = x.shape[1] // sp.size
    return x[:, sp.rank * per : (sp.rank + 1) * per]


def check_degree(degree: int, *, heads: int, kv_heads: int, flag: str = "--ulysses-degree") -> None:
    """ValueError unless `degree` divides the query and KV head counts (each rank owns whole KV heads; the
    same holds for tensor parallelism, `flag` names which)."""
    if degree < 1 or heads % degree or kv_heads % degree:
        raise ValueError(
            f"{flag} {degree} must divide num_attention_heads={heads} and "
            f"num_key_value_heads={kv_heads} (Cosmos3-Nano: 1, 2, 4 or 8)"
        )

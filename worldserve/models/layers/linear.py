"""Linear layers and embeddings with a tensor-parallel seam; at tp size 1 they are plain `F.linear`.

- `ColumnParallelLinear`: weight [out / tp, in]. Each rank computes its own output columns; no
  communication. Fused projections (q|k|v, gate|up) are column-parallel and hold each part's rank slice
  back to back, so a rank's output splits into its local q, k, v (or gate, up).
- `RowParallelLinear`: weight [out, in / tp]. It takes rank-local inputs and all-reduces the partial
  sums; the bias is added once, after the reduction.
- `Embedding`: a replicated lookup table.
Parameters are created with `torch.empty` (no init kernels), so a model builds on the meta device for
free and is filled by the checkpoint loader. Which checkpoint dim is split across ranks for each
parameter is recorded in models/cosmos3/weights.py, not on the tensors (`to_empty` drops attributes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldserve.models.layers.lora import LoraPair, with_lora
from worldserve.parallel.comm import all_reduce
from worldserve.parallel.groups import SINGLE, ParallelGroup


def _param(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _split(n: int, tp: ParallelGroup, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {tp.size}")
    return n // tp.size


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W [out_features / tp, in_features] on each rank."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype | None = None,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = _split(out_features, tp, "out_features")
        self.weight = _param((self.out_features, in_features), dtype)
        self.bias = _param((self.out_features,), dtype) if bias else None

    def forward(self, x: Tensor, lora: LoraPair | None = None) -> Tensor:
        """`lora`: an adapter's (A, B) for this layer (B: this rank's rows), its delta added."""
        return with_lora(F.linear(x, self.weight, self.bias), x, lora)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out_local={self.out_features}, bias={self.bias is not None}"


class RowParallelLinear(nn.Module):
    """y = allreduce(x_local W_local^T) + b with W [out_features, in_features / tp] on each rank."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype | None = None,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = _split(in_features, tp, "in_features")
        self.out_features = out_features
        self.weight = _param((out_features, self.in_features), dtype)
        self.bias = _param((out_features,), dtype) if bias else None

    def forward(self, x: Tensor, lora: LoraPair | None = None) -> Tensor:
        """`lora`: an adapter's (A, B) for this layer (A: this rank's columns): its partial delta joins the
        partial product before the all-reduce."""
        if self.tp.size == 1:
            return with_lora(F.linear(x, self.weight, self.bias), x, lora)
        y = all_reduce(with_lora(F.linear(x, self.weight), x, lora), self.tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_local={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Embedding(nn.Module):
    """Replicated lookup table [num_embeddings, dim]."""

    def __init__(self, num_embeddings: int, dim: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = _param((num_embeddings, dim), dtype)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class ReplicatedLinear(ColumnParallelLinear):
    """The full weight on every rank (modality heads, time embedder, lm_head for now)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype, tp=SINGLE)

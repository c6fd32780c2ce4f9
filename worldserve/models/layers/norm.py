"""RMSNorm (Qwen / Cosmos3 style), shared by the und and gen towers and the per-head q/k norms.

`y = (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype) * weight`: the statistics are computed in
float32, the normalised value is cast back to the input dtype, then multiplied by the weight. This is
bit-for-bit the diffusers `RMSNorm` (weight in the activation dtype) and Qwen3-VL's `Qwen3VLTextRMSNorm`.
The weight is created uninitialised (`torch.empty`) so the module builds on the meta device for free;
the checkpoint loader fills it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalise over the last dim of `x` (any leading shape), fp32 statistics, result in x.dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype) * weight


class RMSNorm(nn.Module):
    """Learned-scale RMSNorm over the last dim (`dim` wide)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

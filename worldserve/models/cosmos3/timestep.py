"""The gen pathway's timestep embedding: sinusoidal features of the network timestep through two float32 linears
(Cosmos3Transformer.time_embedder; its weights stay float32 whatever the model dtype).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldserve.models.layers.linear import ReplicatedLinear
from worldserve.models.layers.lora import LoraWeights

TIMESTEP_FREQ_DIM = 256
"""Width of the sinusoidal timestep features (cos half first, then sin)."""


class TimestepEmbedder(nn.Module):
    """t_net [B] -> linear_2(silu(linear_1(cat(cos(t f), sin(t f))))) [B, dim], all in float32."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear_1 = ReplicatedLinear(TIMESTEP_FREQ_DIM, dim, bias=True, dtype=torch.float32)
        self.linear_2 = ReplicatedLinear(dim, dim, bias=True, dtype=torch.float32)

    def forward(self, t_net: Tensor, lora: LoraWeights | None = None) -> Tensor:
        """`lora`: an adapter whose `time_embedder.linear_1` / `_2` deltas (float32) apply."""
        top = {} if lora is None else lora.top
        half = TIMESTEP_FREQ_DIM // 2
        exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t_net.device)
        freqs = torch.exp(exponent / half)  # [half]
        args = t_net.float()[:, None] * freqs[None, :]  # [B, half]
        features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # [B, 256]
        hidden = F.silu(self.linear_1(features, top.get("time_embedder.linear_1")))
        return self.linear_2(hidden, top.get("time_embedder.linear_2"))

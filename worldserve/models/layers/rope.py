"""Interleaved 3-D multimodal RoPE (Qwen3-VL / Cosmos3 "mRoPE"), cos/sin in float32.

Each token has a position (p_t, p_h, p_w), possibly fractional (fps modulation). Frequency slot j of the
half head uses `inv_freq[j] = theta ** (-2j / head_dim)` and takes its position from one axis:
slot j with j % 3 == 1 and j < 3 * sections[1] reads p_h, j % 3 == 2 and j < 3 * sections[2] reads p_w,
every other slot reads p_t (so the last slots are temporal). `emb = cat(f, f)`; rotation is the half-split
`x * cos + rotate_half(x) * sin`. The position x inv_freq product is always done in float32 (bf16 cannot
hold consecutive integers past 256) and only the final cos/sin are cast to the activation dtype.
`inv_freq` and the axis map are non-persistent buffers: call `reset_buffers()` after `to_empty()`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    """[..., D] -> [..., D]: cat(-x[D/2:], x[:D/2])."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [N, H, D] rotated by cos/sin [N, D] (broadcast over heads)."""
    cos = cos.unsqueeze(1)  # [N, 1, D]
    sin = sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def mrope_axis_of_slot(head_dim: int, sections: tuple[int, ...]) -> Tensor:
    """[head_dim/2] long: which position axis (0=t, 1=h, 2=w) frequency slot j reads (`sections`: t, h, w)."""
    axis = torch.zeros(head_dim // 2, dtype=torch.long)
    for a, offset in ((1, 1), (2, 2)):
        axis[offset : sections[a] * 3 : 3] = a
    return axis


class MRotaryEmbedding(nn.Module):
    """Holds inv_freq and the slot->axis map; `cos_sin(positions)` gives the per-token tables."""

    def __init__(self, head_dim: int, theta: float, sections: tuple[int, int, int]) -> None:
        super().__init__()
        if sum(sections) != head_dim // 2:
            raise ValueError(f"mRoPE sections {sections} must sum to head_dim/2 = {head_dim // 2}")
        self.head_dim = head_dim
        self.theta = float(theta)
        self.sections = tuple(sections)
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, dtype=torch.float32), persistent=False)
        self.register_buffer("axis_of_slot", torch.empty(head_dim // 2, dtype=torch.long), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the buffers on their current device (a no-op on meta)."""
        device = self.inv_freq.device
        if device.type == "meta":
            return
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        self.inv_freq.copy_(1.0 / (self.theta**exponent))
        self.axis_of_slot.copy_(mrope_axis_of_slot(self.head_dim, self.sections))

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [3, N] (t, h, w; any real dtype) -> cos, sin [N, head_dim] in `dtype`."""
        pos = positions.to(device=self.inv_freq.device, dtype=torch.float32)
        with torch.autocast(device_type=pos.device.type, enabled=False):
            slot_pos = pos.index_select(0, self.axis_of_slot)  # [D/2, N]: the axis each slot reads
            freqs = (slot_pos * self.inv_freq[:, None]).t()  # [N, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
            return emb.cos().to(dtype), emb.sin().to(dtype)

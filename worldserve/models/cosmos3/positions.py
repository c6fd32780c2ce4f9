"""3-D mRoPE position ids (t, h, w) for Cosmos3's joint text + media sequence, float32 [3, N].

Reference layout (cosmos3-model.md §3.3; diffusers `get_3d_mrope_ids_*`):
- text token k is at (k, k, k); a prompt of L tokens leaves the temporal cursor at L;
- media start at the origin O = L + unified_3d_mrope_temporal_modality_margin (15000), video and sound both;
- video latent frame i of a (T, Hp, Wp) patch grid: p_t = O + i / (fps/4) * (base_fps/4) when fps
  modulation is on and T > 1 (integer O + i otherwise, T = 1 included, as in diffusers); p_h, p_w the
  patch row/column, restarting at 0 for each vision item (reset_spatial_ids);
- sound frame j: p_t = O + j / sound_latent_fps * base_fps (audio advances 24 units/s, video 6: trained so).
The float arithmetic follows diffusers op for op (fp32 divide, multiply, add) and runs on the CPU (a CUDA
divide by a scalar multiplies by its reciprocal), so the ids are bit-identical; callers move them once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from worldserve.models.cosmos3.config import Cosmos3Config

VIDEO_TEMPORAL_COMPRESSION = 4
"""Pixel frames per latent frame of the Wan2.2 VAE; the fps-modulation formula is written in its units."""


def text_positions(num_tokens: int, *, start: int = 0) -> Tensor:
    """[3, L] float32: token k at (start + k) on all three axes."""
    ids = torch.arange(num_tokens, dtype=torch.float32) + start
    return ids.unsqueeze(0).expand(3, -1).contiguous()  # [3, L]


def media_origin(text_len: int, config: Cosmos3Config) -> int:
    """Temporal origin of every media stream that follows a `text_len`-token prompt."""
    return text_len + config.unified_3d_mrope_temporal_modality_margin


def _grid_positions(
    grid: tuple[int, int, int],
    *,
    origin: int,
    frame_rate: tuple[float, float] | None,
    reset_spatial: bool,
) -> Tensor:
    """[3, T*H*W] float32 for a T-major (t, row, col) grid; frame_rate=(tps, base_tps) enables modulation."""
    t, h, w = grid
    if frame_rate is not None and t > 1:
        tps, base_tps = frame_rate
        frames = torch.arange(t, dtype=torch.float32)
        t_ids = frames / tps * base_tps + origin  # same op order as the reference
    else:
        t_ids = (torch.arange(t, dtype=torch.long) + int(origin)).float()
    t_ids = t_ids.view(-1, 1).expand(-1, h * w).flatten()  # [T*H*W]
    h_ids = torch.arange(h, dtype=torch.float32).view(1, -1, 1).expand(t, -1, w).flatten()
    w_ids = torch.arange(w, dtype=torch.float32).view(1, 1, -1).expand(t, h, -1).flatten()
    if not reset_spatial:
        h_ids = h_ids + int(origin)
        w_ids = w_ids + int(origin)
    return torch.stack([t_ids, h_ids, w_ids], dim=0)  # [3, T*H*W]


def video_positions(
    grid: tuple[int, int, int],
    *,
    origin: int,
    fps: float,
    config: Cosmos3Config,
) -> Tensor:
    """[3, T*Hp*Wp] for one video (or image, T=1) patch grid starting at `origin`."""
    rate = None
    if config.enable_fps_modulation:
        tcf = VIDEO_TEMPORAL_COMPRESSION
        rate = (fps / tcf, float(config.base_fps) / tcf)
    return _grid_positions(
        grid, origin=origin, frame_rate=rate, reset_spatial=config.unified_3d_mrope_reset_spatial_ids
    )


def sound_positions(num_frames: int, *, origin: int, config: Cosmos3Config) -> Tensor:
    """[3, T_s] for a sound latent of `num_frames` frames starting at `origin` (p_h = p_w = 0)."""
    rate = None
    if config.enable_fps_modulation:
        rate = (float(config.sound_latent_fps), float(config.base_fps))
    return _grid_positions(
        (num_frames, 1, 1),
        origin=origin,
        frame_rate=rate,
        reset_spatial=config.unified_3d_mrope_reset_spatial_ids,
    )

"""The Qwen3-VL ViT's forward, ours, over the weights of transformers' `Qwen3VLVisionModel` (vision.py loads it).

The reference forward is written for training and many backends: per layer it reads the items' lengths back
from the GPU (`cu_seqlens.tolist()`, a host sync each of the 27 layers), runs q / k RoPE in float32 through
unfused elementwise ops and the patch embedding as a Conv3d. Here, for inference:

- `VisionGeometry` (host only, from grid_thw): the items' lengths (each item attends within itself), then on
  the device once per forward the learned position embeddings resampled to each grid (bilinear,
  align_corners, as `F.interpolate` gives it, computed as two small GEMMs) and the 2-D RoPE angles, both in
  merge-window patch order.
- the patch embedding as one GEMM (a Conv3d whose kernel equals its stride is a linear map of the patch).
- each block: LayerNorm, fused qkv, RoPE, attention per item (SDPA, or the model's attention function),
  o-proj, residual, LayerNorm, tanh-GELU MLP, residual; the math around attention `torch.compile`d on a GPU
  (`compile_math`: dynamic token counts, one graph for every image size).
- the deepstack mergers after their layers and the final merger, as the reference.

`VisionTower.forward(pixel_values [P, C*T*p*p], grid_thw [n, 3]) -> (merged [P/4, d_llm], deepstack tuple)`,
the reference's (pooler_output, deepstack_features) (tests hold them to it at float32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from worldserve.models.layers.attention import any_shape_sdpa_attention

if TYPE_CHECKING:
    from worldserve.models.layers.flash_attention import AttentionFn


@dataclass(frozen=True)
class VisionGeometry:
    """Where each patch of a batch of items sits: host-side facts of grid_thw."""

    grids: tuple[tuple[int, int, int], ...]
    """(t, h, w) in patches per item."""
    merge: int

    @classmethod
    def of(cls, grid_thw: Tensor, merge: int) -> VisionGeometry:
        return cls(tuple((int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()), merge)

    @property
    def lengths(self) -> list[int]:
        """Patches per attention item: each temporal patch of a video attends to itself only (Qwen3-VL's
        cu_seqlens repeat h * w per t)."""
        return [h * w for t, h, w in self.grids for _ in range(t)]

    def rows_cols(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """(row [P], col [P]) long: each patch's grid coordinates in merge-window order, frames repeated."""
        rows, cols = [], []
        m = self.merge
        for t, h, w in self.grids:
            r = (
                torch.arange(h, device=device).view(h // m, m, 1, 1).expand(-1, -1, w // m, m)
            )  # [h/m, m, w/m, m]
            c = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, -1, -1)
            # merge-window order: [h/m, w/m, m(row), m(col)]
            rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
            cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        return torch.cat(rows), torch.cat(cols)


def bilinear_matrix(n_out: int, n_in: int, device: torch.device) -> Tensor:
    """[n_out, n_in] float32: linear interpolation along one axis with corners aligned (F.interpolate's
    align_corners=True), as a matrix: output o reads inputs floor(s) and floor(s) + 1, s = o (n_in-1)/(n_out-1)."""
    scale = torch.tensor((n_in - 1) / max(n_out - 1, 1), dtype=torch.float32)  # float32 steps, as its kernel
    src = torch.arange(n_out, dtype=torch.float32) * scale
    lo = src.floor().long().clamp(max=n_in - 1)
    hi = (lo + 1).clamp(max=n_in - 1)
    frac = src - lo
    lo, hi, frac = lo.to(device), hi.to(device), frac.to(device)
    m = torch.zeros(n_out, n_in, device=device)
    rows = torch.arange(n_out, device=device)
    m.index_put_((rows, lo), 1 - frac)
    m.index_put_((rows, hi), frac, accumulate=True)
    return m


def position_embeddings(table: Tensor, geometry: VisionGeometry) -> Tensor:
    """The learned [side*side, d] position table resampled to each item's (h, w) grid (bilinear, corners
    aligned), in merge-window order and repeated over t: [P, d] in the table's dtype. Two small GEMMs per grid
    (rows, then columns): F.interpolate's kernel loops over the 1,152 channels per output pixel (1.5 ms at
    720p on an H200)."""
    side = int(table.shape[0] ** 0.5)
    grid = table.float().view(side, side, -1)  # [side, side, d]
    m, out = geometry.merge, []
    for t, h, w in geometry.grids:
        rows = bilinear_matrix(h, side, table.device)  # [h, side]
        cols = bilinear_matrix(w, side, table.device)  # [w, side]
        x = torch.einsum("hi,ijd->hjd", rows, grid)  # [h, side, d]
        x = torch.einsum("wj,hjd->hwd", cols, x)  # [h, w, d]
        x = x.view(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)  # [h*w, d] merge order
        out.append(x.repeat(t, 1))
    return torch.cat(out).to(table.dtype)


def rope_cos_sin(inv_freq: Tensor, geometry: VisionGeometry, device: torch.device) -> tuple[Tensor, Tensor]:
    """2-D RoPE angles [P, head_dim] float32: (row freqs, col freqs) twice over, as Qwen3-VL's ViT lays them."""
    rows, cols = geometry.rows_cols(device)
    f = inv_freq.to(device=device, dtype=torch.float32)
    ang = torch.cat([rows[:, None] * f, cols[:, None] * f], dim=-1)  # [P, head_dim / 2]
    ang = torch.cat([ang, ang], dim=-1)  # [P, head_dim]
    return ang.cos(), ang.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE of x [P, H, D] in float32 (rotate-half pairing), back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]).to(x.dtype)


def pre_attention(
    h: Tensor, cos: Tensor, sin: Tensor, ln_w: Tensor, ln_b: Tensor, qkv_w: Tensor, qkv_b: Tensor, heads: int
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm, fused qkv, RoPE on q and k: h [P, d] -> q, k, v [P, H, D]."""
    x = F.layer_norm(h, (h.shape[-1],), ln_w, ln_b, eps=1e-6)
    q, k, v = F.linear(x, qkv_w, qkv_b).view(h.shape[0], 3, heads, -1).unbind(1)  # [P, H, D] each
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def post_attention(
    h: Tensor, attn: Tensor, proj_w: Tensor, proj_b: Tensor, ln_w: Tensor, ln_b: Tensor, fc1_w: Tensor,
    fc1_b: Tensor, fc2_w: Tensor, fc2_b: Tensor,
) -> Tensor:  # fmt: skip
    """o-proj + residual, LayerNorm, tanh-GELU MLP + residual: h [P, d], attn [P, H, D] -> [P, d]."""
    h = h + F.linear(attn.flatten(1), proj_w, proj_b)
    x = F.layer_norm(h, (h.shape[-1],), ln_w, ln_b, eps=1e-6)
    return h + F.linear(F.gelu(F.linear(x, fc1_w, fc1_b), approximate="tanh"), fc2_w, fc2_b)


def merge_patches(x: Tensor, merger: Any, *, postshuffle: bool) -> Tensor:
    """A patch merger: [P, d] -> [P/4, d_llm] (LayerNorm before or after grouping the 2x2 windows)."""
    width = merger.linear_fc1.in_features
    x = merger.norm(x.view(-1, width) if postshuffle else x).view(-1, width)
    return merger.linear_fc2(F.gelu(merger.linear_fc1(x)))


class VisionTower:
    """Our inference forward of one `Qwen3VLVisionModel` (its modules hold the weights)."""

    def __init__(self, model: Any, attention: AttentionFn = any_shape_sdpa_attention) -> None:
        cfg = model.config
        if cfg.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(
                f"VisionTower runs tanh-GELU blocks; this ViT's hidden_act is {cfg.hidden_act!r}"
            )
        self.model = model
        self.heads = cfg.num_heads
        self.merge = cfg.spatial_merge_size
        self.deepstack = {layer: i for i, layer in enumerate(cfg.deepstack_visual_indexes)}
        self.attention = attention
        self.math = (pre_attention, post_attention)

    def compile_math(self) -> None:
        """torch.compile the blocks' math around attention (dynamic token counts: one graph serves all)."""
        self.math = tuple(torch.compile(fn, dynamic=True) for fn in (pre_attention, post_attention))

    @torch.inference_mode()
    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        m = self.model
        geo = VisionGeometry.of(grid_thw, self.merge)
        proj = m.patch_embed.proj
        w = proj.weight.view(proj.out_channels, -1)  # Conv3d kernel == stride: [d, C*T*p*p]
        h = F.linear(pixel_values.to(w.dtype), w, proj.bias)  # [P, d]
        h = h + position_embeddings(m.pos_embed.weight, geo)
        cos, sin = rope_cos_sin(m.rotary_pos_emb.inv_freq, geo, h.device)
        lengths = geo.lengths
        pre, post = self.math
        deepstack: list[Tensor] = [None] * len(self.deepstack)  # type: ignore[list-item]
        for i, blk in enumerate(m.blocks):
            a = blk.attn
            q, k, v = pre(h, cos, sin, blk.norm1.weight, blk.norm1.bias, a.qkv.weight, a.qkv.bias, self.heads)
            out = torch.empty_like(q)
            self._attend(q, k, v, lengths, out)
            h = post(h, out, a.proj.weight, a.proj.bias, blk.norm2.weight, blk.norm2.bias,
                     blk.mlp.linear_fc1.weight, blk.mlp.linear_fc1.bias, blk.mlp.linear_fc2.weight,
                     blk.mlp.linear_fc2.bias)  # fmt: skip
            if i in self.deepstack:
                j = self.deepstack[i]
                deepstack[j] = merge_patches(h, m.deepstack_merger_list[j], postshuffle=True)
        return merge_patches(h, m.merger, postshuffle=False), tuple(deepstack)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, lengths: Sequence[int], out: Tensor) -> None:
        """Full attention within each item, written into out [P, H, D]."""
        start = 0
        for n in lengths:
            s = slice(start, start + n)
            self.attention(q[s], k[s], v[s], out=out[s])
            start += n

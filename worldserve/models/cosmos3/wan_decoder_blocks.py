"""Building blocks of our Wan2.2 VAE decoder (`wan_decoder.py`), written for chunked causal decoding.

Every block's `forward` is a pure tensor function: the time context of each causal conv (the last 2 frames
of its input in the previous chunk) comes in as an argument and the updated context goes out as a result,
so `torch.compile(block)` traces one graph with no Python side effects. `CausalConvCache` keeps those
contexts between chunks; each block's `run(x, cache)` reads and writes it around `forward`.

Parameter names and shapes equal diffusers' `AutoencoderKLWan` decoder (`norm1.gamma`, `conv1`,
`upsampler.resample.1`, `upsampler.time_conv`, ...), so its state dict loads unchanged. Activations keep
one memory format end to end (channels_last_3d on CUDA: cuDNN runs NDHWC convs with no NCHW<->NHWC
transposes, and every per-frame [B*T, C, H, W] view of them is channels_last for free).

The convolutions live in `wan_decoder_convs.py`: the residual blocks' 3x3x3 convs run as Winograd F(2, 3)
along time (`TimeWinogradConv3d`, 1.5x fewer FLOPs) and the spatial upsampler sub-pixel (`SubpixelUp2xConv`,
2.25x fewer), both exact in real arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldserve.models.cosmos3.wan_decoder_convs import (
    CausalConv3d,
    SubpixelUp2xConv,
    TimeWinogradConv3d,
    frames_2d,
    memory_format_of,
)

CONTEXT_FRAMES = 2  # time kernel 3 - 1: what each causal conv sees of the previous chunk (diffusers CACHE_T)


def causal_input(ctx: Tensor, x: Tensor) -> Tensor:
    """A causal conv's input [B, C, 2 + T, H, W]: the context frames, then x, in ctx's memory format (a bare
    cat falls back to contiguous when a one-frame x has ambiguous channels_last strides)."""
    a = torch.cat([ctx, x], dim=2)
    fmt = memory_format_of(ctx)
    return a if a.is_contiguous(memory_format=fmt) else a.contiguous(memory_format=fmt)


def last_frames(a: Tensor) -> Tensor:
    """The next chunk's context of a conv whose (context-prefixed) input is `a` [B, C, 2 + T, H, W]: its
    last 2 frames, copied so that the big input can be freed, with the canonical strides of a fresh
    2-frame tensor (as the zero context has: a compiled block then sees the same strides every chunk)."""
    return a[:, :, -CONTEXT_FRAMES:].clone(memory_format=memory_format_of(a))


class CausalConvCache:
    """Per causal conv (keyed by the module), the last 2 frames of its input from the previous chunk.

    Before a conv's first write its context is zeros: exactly the causal zero padding of diffusers'
    `WanCausalConv3d` (2 frames on the left). One cache belongs to one decode call; nothing else is kept.
    """

    def __init__(self, memory_format: torch.memory_format) -> None:
        self.memory_format = memory_format
        self._frames: dict[nn.Module, Tensor] = {}

    def context(self, conv: nn.Conv3d, x: Tensor) -> Tensor:
        """[B, conv.in_channels, 2, H, W] context for `conv`, whose new input frames are shaped like `x`."""
        ctx = self._frames.get(conv)
        if ctx is None:
            b, _, _, h, w = x.shape
            shape = (b, conv.in_channels, CONTEXT_FRAMES, h, w)
            ctx = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=self.memory_format).zero_()
        return ctx

    def update(self, conv: nn.Conv3d, frames: Tensor) -> None:
        self._frames[conv] = frames

    def __len__(self) -> int:
        return len(self._frames)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._frames.values())


class RMSNorm(nn.Module):
    """Wan's "RMS_norm" (diffusers `WanRMS_norm`, bias-free as every decoder norm is): L2-normalise over the
    channels (dim 1) in float32, round to the activation dtype, then `* sqrt(C) * gamma`. `gamma` keeps
    diffusers' shape, [C, 1, 1, 1] for 5-D input or [C, 1, 1] for per-frame 4-D input."""

    def __init__(self, dim: int, ndim: int = 5) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *(1,) * (ndim - 2)))

    def forward(self, x: Tensor) -> Tensor:
        # = F.normalize(x.float(), dim=1).to(x.dtype): float32 norm and quotient, rounded once to x's dtype.
        norm = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float32).clamp_min(1e-12)
        if torch.compiler.is_compiling():  # fused with the SiLU and context concat: no float32 buffer
            y = (x / norm).to(x.dtype)
        else:  # eager: rounded to x's dtype on store, no float32 copy of x (dynamo rejects this out=)
            y = torch.div(x, norm, out=torch.empty_like(x))
        return y.mul_(self.scale).mul_(self.gamma)


class ResidualBlock(nn.Module):
    """norm1, SiLU, causal conv1, norm2, SiLU, causal conv2, plus a 1x1x1 shortcut when the width changes."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(in_dim)
        self.conv1 = TimeWinogradConv3d(in_dim, out_dim)
        self.norm2 = RMSNorm(out_dim)
        self.conv2 = TimeWinogradConv3d(out_dim, out_dim)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, (1, 1, 1)) if in_dim != out_dim else None

    def forward(self, x: Tensor, ctx1: Tensor, ctx2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, Cin, T, H, W], contexts [B, Cin | Cout, 2, H, W] -> ([B, Cout, T, H, W], new contexts)."""
        h = x if self.conv_shortcut is None else self.conv_shortcut(x)
        a = causal_input(ctx1, F.silu(self.norm1(x), inplace=True))  # [B, Cin, 2 + T, H, W]
        y, ctx1 = self.conv1(a), last_frames(a)
        del a  # the widest tensor of the block: free it before norm2 (eager peak memory)
        b = causal_input(ctx2, F.silu(self.norm2(y), inplace=True))  # [B, Cout, 2 + T, H, W]
        del y
        return self.conv2(b) + h, ctx1, last_frames(b)

    def run(self, x: Tensor, cache: CausalConvCache, *, eager: bool = False) -> Tensor:
        """`forward` with the contexts taken from and put back into `cache`; `eager` bypasses a compiled
        wrapper (the one-frame first chunk runs once a decode: not worth a graph of its own)."""
        fn = self.forward if eager else self
        y, ctx1, ctx2 = fn(x, cache.context(self.conv1, x), cache.context(self.conv2, x))
        cache.update(self.conv1, ctx1)
        cache.update(self.conv2, ctx2)
        return y


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H*W pixels of each frame (1x1 conv q|k|v and projection)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, ndim=4)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, C, T, H, W] -> same shape."""
        b, c, t, h, w = x.shape
        fmt = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last_3d) else None
        frames = frames_2d(x)  # [B*T, C, H, W]
        qkv = self.to_qkv(self.norm(frames))  # [B*T, 3C, H, W]
        # [B*T, 1, H*W, 3C]: a free view when channels_last, a copy otherwise (as diffusers makes it)
        qkv = qkv.permute(0, 2, 3, 1).reshape(b * t, 1, h * w, 3 * c).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)  # [B*T, 1, H*W, C] each
        o = F.scaled_dot_product_attention(q, k, v)  # [B*T, 1, H*W, C]
        o = o.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w)  # a channels_last view
        o = self.proj(o if fmt is None else o.contiguous(memory_format=fmt))
        return o.view(b, t, c, h, w).permute(0, 2, 1, 3, 4) + x


def interleave_time(y: Tensor) -> Tensor:
    """The upsample3d time conv output [B, 2C, T, H, W] -> [B, C, 2T, H, W]: channel half s of step t
    becomes frame 2t + s (diffusers' reshape + stack), written in y's memory format."""
    b, c2, t, h, w = y.shape
    fmt = torch.channels_last_3d if y.is_contiguous(memory_format=torch.channels_last_3d) else None
    out = torch.empty((b, c2 // 2, 2 * t, h, w), dtype=y.dtype, device=y.device)
    if fmt is not None:
        out = out.contiguous(memory_format=fmt)
    # [B, 2, C, T, H, W] -> [B, C, T, 2, H, W] into the matching split view of the output
    out.view(b, c2 // 2, t, 2, h, w).copy_(y.unflatten(1, (2, c2 // 2)).permute(0, 2, 3, 1, 4, 5))
    return out


class Upsample(nn.Module):
    """diffusers `WanResample` "upsample2d" / "upsample3d": with `temporal`, a causal time conv C -> 2C
    doubles the frame count first (skipped on the first chunk: diffusers' "Rep"); then, per frame,
    nearest 2x + Conv2d 3x3, computed sub-pixel (`SubpixelUp2xConv`)."""

    def __init__(self, dim: int, *, temporal: bool) -> None:
        super().__init__()
        self.resample = SubpixelUp2xConv(dim, dim)
        self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1)) if temporal else None

    def forward(
        self, x: Tensor, ctx: Tensor | None, shortcut: Tensor | None = None, factor_t: int = 1,
        first_chunk: bool = False,
    ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """x [B, C, T, H, W] -> ([B, C, T', 2H, 2W], new context); T' = 2T with a time context, else T.
        `shortcut`: the up block's input, added as DupUp3D (`add_dup_up`, time factor `factor_t`) in the
        same graph, so compiled it fuses with the phase-interleaving copy (no extra pass over the output);
        `first_chunk`: the one-frame first chunk (see add_dup_up)."""
        new_ctx = None
        if ctx is not None:
            assert self.time_conv is not None, "a time context needs the temporal upsampler's time conv"
            a = causal_input(ctx, x)  # [B, C, 2 + T, H, W]
            x = interleave_time(self.time_conv(a))  # [B, C, 2T, H, W]
            new_ctx = last_frames(a)
        b, c, t = x.shape[:3]
        y = self.resample(frames_2d(x))  # [B*T', C, 2H, 2W]
        y = y.view(b, t, c, y.shape[2], y.shape[3]).transpose(1, 2)  # [B, C, T', 2H, 2W]
        if shortcut is not None:
            y = add_dup_up(y, shortcut, factor_t, 2, first_chunk=first_chunk)
        return y, new_ctx

    def run(
        self, x: Tensor, cache: CausalConvCache, *, first_chunk: bool, shortcut: Tensor | None = None,
        factor_t: int = 1,
    ) -> Tensor:  # fmt: skip
        """`forward` with the time conv's context from `cache`. On the first chunk the time conv is skipped
        and its context stays zeros, so the time conv sees the frames after the first chunk as a sequence
        of its own, left-padded with zeros: exactly diffusers' "Rep" then `[0, x1]` cache handling."""
        if self.time_conv is None or first_chunk:
            fn = self.forward if first_chunk else self
            return fn(x, None, shortcut, factor_t, first_chunk)[0]
        y, ctx = self(x, cache.context(self.time_conv, x), shortcut, factor_t)
        cache.update(self.time_conv, ctx)
        return y


def add_dup_up(out: Tensor, x: Tensor, factor_t: int, factor_s: int, *, first_chunk: bool) -> Tensor:
    """out + DupUp3D(x) (diffusers' parameter-free shortcut of a residual up block): in place in eager
    mode, as a new tensor under torch.compile (inductor fuses the broadcast into the producer of `out`;
    an in-place add through a view of a view is what compiled graphs handle least safely).

    DupUp3D repeats every channel of x [B, Cin, T, H, W] r = Cout*ft*fs*fs / Cin times and folds the copies
    into ft x fs x fs sub-positions: out[b, o, t*ft + i, h*fs + j, w*fs + k] gets channel
    (((o*ft + i)*fs + j)*fs + k) // r of x. Written as a broadcast view (no copy for the Wan2.2 widths);
    on the first chunk (one frame) only the last time sub-position is kept, as in diffusers."""
    b, cin, t, h, w = x.shape
    cout = out.shape[1]
    r = cout * factor_t * factor_s * factor_s // cin
    s = x.unsqueeze(2).expand(b, cin, r, t, h, w)  # channel j of repeat_interleave = x channel j // r
    s = s.reshape(b, cout, factor_t, factor_s, factor_s, t, h, w)
    s = s.permute(0, 1, 5, 2, 6, 3, 7, 4)  # [B, Cout, T, ft, H, fs, W, fs]
    if first_chunk:
        assert t == 1, "the first chunk is one latent frame"
        s = s[:, :, :, factor_t - 1 :]
    if torch.compiler.is_compiling():
        return out + s.reshape(out.shape)  # [B, Cout, T*ft', H*fs, W*fs]: indexing, fused by inductor
    out.view(b, cout, t, s.shape[3], h, factor_s, w, factor_s).add_(s)
    return out

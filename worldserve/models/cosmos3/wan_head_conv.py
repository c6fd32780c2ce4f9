"""The Wan2.2 decoder's head conv (`conv_out`: 256 -> 12 channels, 3x3x3, causal) as an implicit GEMM of its own.

At 720p the head runs on [1, 256, 2 + 8, 360, 640] per two-latent-frame chunk (24 chunks a 189-frame decode).
cuDNN runs it at ~85 TFLOP/s (3.6 ms a chunk on an H100) whatever its output padding (bench/vae_head.py).
`HeadConv3d` runs it as one Triton kernel: program (b, t, h-tile, w-tile) computes a BH x BW patch of output
pixels as a [BH*BW, 16] fp32 accumulator (the 12 channels padded to 16, a wgmma's N), looping over the 27 taps
x C/BC channel slices of the context-prefixed input (channels last: each pixel's channels are one contiguous
row), zero-masked at the H / W borders (the conv's padding); the bias and the clamp to [-1, 1] (the decoder's
next step) in its epilogue. The same sums as cuDNN's implicit GEMM in another order (fp32 accumulation, one
rounding of the output).

Measured (fifty-second session, H100): 3.47 ms a chunk against cuDNN's 3.62 (1.04x), a compiled 720p x 189
decode 18 ms faster (4.020 vs 4.038 s, every one of 20 alternating rounds). Both kernels are bound by the
same thing: each tap re-reads its shifted input slice from L2 (27 x 0.94 GB a chunk, ~7.3 TB/s), so neither
the N tile nor the autotuner's tiles matter much (pipelined 3 deep or more; 2 stages is 2x slower). The next
gain needs the input's halo tile kept in shared memory across the 9 (kh, kw) taps (3 reads instead of 27),
which Triton's blocks cannot shift: a CUDA or Gluon kernel.

Where the kernel cannot run (CPU, no Triton, float32, channels not a multiple of 16) the op runs the conv
(`F.conv3d`) and the clamp as before. `torch.ops.worldserve.wan_head_conv` is a custom op so that the
compiled head (WanDecoder.compile) calls it as one opaque node.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from worldserve.models.cosmos3.wan_decoder_convs import CausalConv3d, memory_format_of

PADDED_OUT = 16
"""The accumulator's channels: the output channels rounded up to this (a wgmma's N; 12 for Wan2.2)."""

TILES = ((2, 128), (4, 64))
"""(BH, BW) output patches the autotuner tries (BH*BW pixels: the GEMM's M tile). 128-pixel patches (1 x 128
... 8 x 16) were 4 % slower, 2-stage pipelines 2x; these 4 with 3 stages were within 1 % of each other
(bench/results/README.md, fifty-second session)."""


def channel_slice(c: int) -> int | None:
    """The channels one K step reads (BC), or None where the kernel does not take `c` input channels."""
    return next((bc for bc in (64, 32, 16) if c % bc == 0), None)


@cache
def triton_kernels() -> tuple[Any, Any] | None:
    """(the raw Triton kernel, its autotuned form), or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # (Triton reads a kernel's annotations: its arguments keep none but tl.constexpr)
    @triton.jit
    def head_conv_kernel(  # type: ignore[no-untyped-def]
        a_ptr, w_ptr, bias_ptr, out_ptr, T, H, W,
        sa_b, sa_c, sa_t, sa_h, sa_w, so_b, so_c, so_t, so_h, so_w,
        C: tl.constexpr, CO: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr,
        BW: tl.constexpr,
    ):  # fmt: skip
        pid_w = tl.program_id(0)
        pid_h = tl.program_id(1)
        pid_bt = tl.program_id(2)
        b = pid_bt // T
        t = pid_bt % T
        m = tl.arange(0, BH * BW)
        # the patch's pixels, row-major: [BH*BW]
        hh = pid_h * BH + m // BW
        ww = pid_w * BW + m % BW
        cc = tl.arange(0, BC)
        nn = tl.arange(0, NP)
        a_b = a_ptr + b.to(tl.int64) * sa_b
        acc = tl.zeros((BH * BW, NP), dtype=tl.float32)
        chunks: tl.constexpr = C // BC
        for k in range(27 * chunks):
            tap = k // chunks
            c0 = (k % chunks) * BC
            hi = hh + (tap // 3) % 3 - 1
            wi = ww + tap % 3 - 1
            ok = (hi >= 0) & (hi < H) & (wi >= 0) & (wi < W)
            # input frame t + kt (the first two are the causal context)
            pix = (t + tap // 9) * sa_t + hi * sa_h + wi * sa_w
            x = tl.load(a_b + pix[:, None] + (c0 + cc)[None, :] * sa_c, mask=ok[:, None], other=0.0)
            # taps [27, C, NP]: this tap's channel slice [BC, NP]
            wt = tl.load(w_ptr + ((tap * C + c0 + cc) * NP)[:, None] + nn[None, :])
            acc = tl.dot(x, wt, acc)
        y = acc + tl.load(bias_ptr + nn)[None, :]
        y = tl.minimum(tl.maximum(y, -1.0), 1.0)
        keep = (hh < H) & (ww < W)
        o = out_ptr + b.to(tl.int64) * so_b + t * so_t + hh * so_h + ww * so_w
        o_mask = keep[:, None] & (nn < CO)[None, :]
        tl.store(o[:, None] + nn[None, :] * so_c, y.to(out_ptr.dtype.element_ty), mask=o_mask)

    configs = [
        triton.Config({"BH": bh, "BW": bw}, num_warps=nw, num_stages=ns)
        for bh, bw in TILES
        for nw in (4, 8)
        for ns in (3,)
    ]
    tuned = triton.autotune(configs, key=["H", "W", "C", "CO"])(head_conv_kernel)
    return head_conv_kernel, tuned


def packed_taps(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """[O, C, 3, 3, 3] weight -> taps [27, C, NP] (tap = kt*9 + kh*3 + kw; output channels zero-padded to NP,
    the weight's dtype) and the bias [NP] float32 (zeros where None)."""
    o, c = weight.shape[:2]
    np_ = -(-o // PADDED_OUT) * PADDED_OUT
    taps = weight.new_zeros((27, c, np_))
    taps[:, :, :o] = weight.permute(2, 3, 4, 1, 0).reshape(27, c, o)  # [kt, kh, kw, C, O] -> [27, C, O]
    b = torch.zeros(np_, dtype=torch.float32, device=weight.device)
    if bias is not None:
        b[:o] = bias.float()
    return taps, b


def _output_like(a: Tensor, out_channels: int) -> Tensor:
    """An empty [B, O, T, H, W] output for the context-prefixed input a [B, C, 2 + T, H, W], in a's format."""
    bsz, _, tp, h, w = a.shape
    shape = (bsz, out_channels, tp - 2, h, w)
    return torch.empty(shape, dtype=a.dtype, device=a.device, memory_format=memory_format_of(a))


def kernel_runs(a: Tensor, weight: Tensor) -> bool:
    """Whether the Triton kernel computes this head conv (else the op runs F.conv3d)."""
    return (
        a.is_cuda
        and a.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == a.dtype
        and tuple(weight.shape[2:]) == (3, 3, 3)
        and weight.shape[0] <= PADDED_OUT
        and channel_slice(a.shape[1]) is not None
        and a.shape[2] >= 3
        and a[0].numel() < 2**31
        and triton_kernels() is not None
    )


def triton_head_conv(a: Tensor, weight: Tensor, bias: Tensor | None, *, config: Any = None) -> Tensor:
    """The kernel's conv_out(a).clamp(-1, 1): a [B, C, 2 + T, H, W] -> [B, O, T, H, W] in a's memory format.
    `config`: a triton.Config to run instead of the autotuned choice (bench/vae_head.py)."""
    kernels = triton_kernels()
    assert kernels is not None
    raw, tuned = kernels
    bsz, c, tp, h, w = a.shape
    o = weight.shape[0]
    taps, b = packed_taps(weight, bias)
    out = _output_like(a, o)
    args = (a, taps, b, out, tp - 2, h, w, *a.stride(), *out.stride())
    meta = {"C": c, "CO": o, "NP": taps.shape[2], "BC": channel_slice(c)}
    if config is None:
        tuned[lambda cfg: (-(-w // cfg["BW"]), -(-h // cfg["BH"]), bsz * (tp - 2))](*args, **meta)
    else:
        bh, bw = config.kwargs["BH"], config.kwargs["BW"]
        raw[(-(-w // bw), -(-h // bh), bsz * (tp - 2))](
            *args, **meta, BH=bh, BW=bw, num_warps=config.num_warps, num_stages=config.num_stages
        )
    return out


@torch.library.custom_op("worldserve::wan_head_conv", mutates_args=())
def wan_head_conv(a: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """conv3d(a, weight, bias, padding (0, 1, 1)) clamped to [-1, 1], in a's memory format."""
    if kernel_runs(a, weight):
        return triton_head_conv(a, weight, bias)
    y = F.conv3d(a, weight, bias, padding=(0, 1, 1)).clamp_(-1.0, 1.0)
    return y.contiguous(memory_format=memory_format_of(a))


@wan_head_conv.register_fake
def _(a: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _output_like(a, weight.shape[0])


class HeadConv3d(CausalConv3d):
    """The decoder's conv_out: a causal 3x3x3 conv to few channels, its output clamped to [-1, 1]
    (`wan_head_conv`, inference only: with autograd on for its input, weight or bias it runs conv + clamp as
    separate torch ops, as it does with `fused = False`, the GPU test's oracle). Same parameters and keys as
    CausalConv3d."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__(in_dim, out_dim, (3, 3, 3))
        self.fused = True

    def forward(self, a: Tensor) -> Tensor:
        """a [B, C, 2 + T, H, W] (context frames first) -> clamped [B, O, T, H, W]."""
        differentiable = any(t is not None and t.requires_grad for t in (a, self.weight, self.bias))
        if self.fused and not (torch.is_grad_enabled() and differentiable):
            return torch.ops.worldserve.wan_head_conv(a, self.weight, self.bias)
        return super().forward(a).clamp_(-1.0, 1.0)

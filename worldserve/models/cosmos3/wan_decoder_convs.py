"""The convolutions of our Wan2.2 VAE decoder, two of them computed with fewer FLOPs than they are written.

- `CausalConv3d`: Conv3d, causal in time (the caller prepends the context frames).
- `TimeWinogradConv3d`: a causal 3x3x3 conv (the residual blocks' conv1 / conv2: ~90 % of a decode's FLOPs)
  computed as Winograd F(2, 3) along time. Two output frames y0 = g0 d0 + g1 d1 + g2 d2 and
  y1 = g0 d1 + g1 d2 + g2 d3 (d0..d3: four consecutive input frames, g0..g2: the kernel's time taps, each
  a 3x3 spatial conv) need 6 spatial convs written out, 4 as
      m0 = g0 (d0 - d2),   m1 = (g0 + g1 + g2)/2 (d1 + d2),   m2 = (g0 - g1 + g2)/2 (d2 - d1),   m3 = g2 (d1 - d3)
      y0 = m0 + m1 + m2,   y1 = m1 - m2 - m3
  so a chunk of T (even) output frames costs 2T frame-convs instead of 3T: 1.5x fewer FLOPs. Each m is one
  cuDNN 3x3 Conv2d over T/2 frames (an implicit GEMM as large as the 3-D one's, K = 9 C instead of 27 C);
  the input and output transforms are elementwise and fuse, compiled, into the norm / SiLU / residual
  kernels around the conv. Exact in real arithmetic. In bfloat16 the transformed frames, the transformed
  taps and the 4 partial convs are each rounded once, where the direct conv rounds only its output: the
  decode's error against float32 grows a little (bench/vae_decode.py measures both); float32 matches the
  direct conv to ~1e-7. Odd frame counts (the one-frame first chunk, a short last chunk at the latent
  resolution) run the direct conv.
- `SubpixelUp2xConv`: diffusers' spatial upsampler (nearest-exact 2x, then Conv2d 3x3) as ONE 2x2 conv with
  4x the output channels on the low-res frame padded by 1, then one interleaving copy: each of the 4
  output phases (row, column parity) of the 3x3 conv on the nearest-2x image is a 2x2 conv on the low-res
  image whose taps are sums of the 3x3 taps landing on the same low-res pixel. 4 taps instead of 9 per
  output pixel (2.25x fewer FLOPs there, ~240 of a 720p x 189 decode's 3.21 PFLOP) and no 4x upsampled
  input in memory. Exact in real arithmetic; in float32 ~1e-7 relative from diffusers' summation order.

Both derive their kernels from the checkpoint's own parameters (`DerivedKernels`), so the state dict keys and
shapes stay diffusers'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._inductor import inductor_prims  # registers torch.ops.prims.inductor_force_stride_order


def memory_format_of(x: Tensor) -> torch.memory_format:
    """channels_last_3d (5-D x) / channels_last (4-D x) if x is laid out so (and not also plain contiguous),
    else contiguous_format."""
    cl = torch.channels_last_3d if x.ndim == 5 else torch.channels_last
    return cl if x.is_contiguous(memory_format=cl) and not x.is_contiguous() else torch.contiguous_format


def frames_2d(x: Tensor) -> Tensor:
    """[B, C, T, H, W] -> [B*T, C, H, W] (free for channels_last_3d: the result is channels_last)."""
    b, c, t, h, w = x.shape
    return x.transpose(1, 2).reshape(b * t, c, h, w)


def laid_out(x: Tensor, fmt: torch.memory_format) -> Tensor:
    """x in memory format `fmt`, inductor's own buffers included. Under torch.compile an intermediate gets
    the layout inductor picks (plain contiguous unless a consumer requires a stride order) whatever its eager
    strides, and `.contiguous(memory_format=)` on a tensor whose traced strides already match is no op at
    all. cuDNN convs require channels-last inputs, elementwise ops require nothing, so a tensor only they
    touch (the Winograd transforms' input and output) would be written NCDHW and read transposed: its
    stride order is pinned with inductor's `force_stride_order` (free where the layout already holds)."""
    if not torch.compiler.is_compiling():
        return x.contiguous(memory_format=fmt)
    strides = torch.empty(x.shape, device="meta", memory_format=fmt).stride()
    return inductor_prims.force_stride_order(x, strides)


def _version_key(t: Tensor | None) -> tuple:
    """What changes when a parameter's values may have: its storage, in-place version, dtype, device, layout
    (inference tensors keep no version counter)."""
    if t is None:
        return ()
    return (t.data_ptr(), -1 if t.is_inference() else t._version, t.dtype, t.device, t.stride())


class DerivedKernels:
    """Kernels derived from a conv's weight and bias by `derive(weight, bias)`, cached while they stay.

    Not a buffer: nothing new in the state dict, nothing to load on a meta-built model. The cache is rebuilt
    whenever the parameters' storage, in-place version, dtype, device or layout changed (`.to()`,
    `load_state_dict`, `set_memory_format`, in-place edits); owners `clear()` it on `_apply` and state dict
    loads. Under torch.compile the kernels are derived inside the graph instead (dynamo cannot read data
    pointers or version counters without a graph break): one small fused pointwise kernel per call, never
    stale; so are they when autograd needs them (weight requiring grad, grad mode on)."""

    def __init__(self, derive: Callable[[Tensor, Tensor | None], tuple]) -> None:
        self.derive = derive
        self._cached: tuple[tuple, tuple] | None = None  # (version key, derived)

    def get(self, weight: Tensor, bias: Tensor | None) -> tuple:
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and weight.requires_grad):
            return self.derive(weight, bias)  # traced / differentiable: never cached
        key = (_version_key(weight), _version_key(bias))
        if self._cached is None or self._cached[0] != key:
            with torch.no_grad():
                self._cached = (key, self.derive(weight, bias))
        return self._cached[1]

    def clear(self) -> None:
        self._cached = None


class _DerivedKernelsOwner(nn.Module):
    """Clears its `_kernels` (a `DerivedKernels`) whenever the parameters may be replaced."""

    _kernels: DerivedKernels

    # .to() / .cuda() / .half() / to_empty(): rebuild lazily
    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Self:
        self._kernels.clear()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._kernels.clear()
        super()._load_from_state_dict(*args, **kwargs)


def _widened(weight: Tensor) -> Tensor:
    """The weight in at least float32, for summing taps before one rounding to its own dtype."""
    return weight.to(torch.promote_types(weight.dtype, torch.float32))


class CausalConv3d(nn.Conv3d):
    """Conv3d, causal in time: the caller prepends kt - 1 context frames (the previous chunk's, or zeros at
    the start); H and W are zero-padded by the conv itself (same numbers as diffusers' explicit F.pad)."""

    def __init__(self, in_dim: int, out_dim: int, kernel: tuple[int, int, int]) -> None:
        super().__init__(in_dim, out_dim, kernel, padding=(0, kernel[1] // 2, kernel[2] // 2))


def time_winograd_kernels(weight: Tensor, bias: Tensor | None) -> tuple[tuple[Tensor, ...], Tensor | None]:
    """A [O, I, 3, kh, kw] kernel's time taps g0, g1, g2 -> the F(2, 3) kernels (g0, (g0 + g1 + g2)/2,
    (g0 - g1 + g2)/2, g2), each [O, I, kh, kw] (summed in float32 at least, rounded once to the weight's
    dtype, channels_last when the weight is channels_last_3d), and the bias (carried by m1)."""
    g0, g1, g2 = _widened(weight).unbind(2)
    fmt = (
        torch.channels_last if memory_format_of(weight) == torch.channels_last_3d else torch.contiguous_format
    )
    kernels = (g0, (g0 + g1 + g2) * 0.5, (g0 - g1 + g2) * 0.5, g2)
    return tuple(k.to(dtype=weight.dtype, memory_format=fmt) for k in kernels), bias


class TimeWinogradConv3d(_DerivedKernelsOwner, CausalConv3d):
    """A causal 3x3x3 conv computed as Winograd F(2, 3) along time when its output frame count is even
    (module docstring); `time_winograd = False` (or an odd count) runs the plain Conv3d. Same parameters,
    same keys."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__(in_dim, out_dim, (3, 3, 3))
        self.time_winograd = True
        self._kernels = DerivedKernels(time_winograd_kernels)

    def forward(self, a: Tensor) -> Tensor:
        """a [B, I, 2 + T, H, W] (context frames first) -> [B, O, T, H, W]."""
        t = a.shape[2] - 2
        if not self.time_winograd or t % 2:
            return super().forward(a)
        (k0, k1, k2, k3), bias = self._kernels.get(self.weight, self.bias)
        b, _, _, h, w = a.shape
        fmt = memory_format_of(a)
        a = laid_out(a, fmt)
        d0, d1, d2, d3 = (a[:, :, i : i + t : 2] for i in range(4))  # [B, I, T/2, H, W]: frames i, i + 2, ...

        def conv(x: Tensor, k: Tensor, bias: Tensor | None = None) -> Tensor:  # -> [B*T/2, O, H, W]
            return F.conv2d(frames_2d(x.contiguous(memory_format=fmt)), k, bias, padding=self.padding[1:])

        m0, m1, m2, m3 = conv(d0 - d2, k0), conv(d1 + d2, k1, bias), conv(d2 - d1, k2), conv(d1 - d3, k3)
        o = m0.shape[1]
        # one expression for both frames of each pair (compiled: one fused kernel reading each m once, laid
        # out as `a` is), [B*T/2, 2, O, H, W]: frames 2j, 2j + 1 -> [B, T, O, H, W] -> [B, O, T, H, W]
        pairs = torch.stack([m0 + m1 + m2, m1 - m2 - m3], dim=1)
        return laid_out(pairs.reshape(b, t, o, h, w).transpose(1, 2), fmt)


class NearestUp2x(nn.Module):
    """2x nearest-exact spatial upsampling of [N, C, H, W], in the input dtype (diffusers upcasts to
    float32 and back: the same values, since nearest only copies). For the exact factor 2, nearest-exact's
    source index floor((i + 0.5) / 2) is i // 2: plain repetition, which the sub-pixel form relies on.
    Only `SubpixelUp2xConv.reference` (the diffusers formulation, for tests) calls it."""

    def forward(self, x: Tensor) -> Tensor:
        return F.interpolate(x, scale_factor=2.0, mode="nearest-exact")


def _fold_taps(w: Tensor, dim: int) -> Tensor:
    """3 taps along `dim` -> [2 phases, ...] with 2 taps along `dim`: phase 0 [w0, w1 + w2], 1 [w0 + w1, w2]."""
    w0, w1, w2 = w.unbind(dim)
    return torch.stack([torch.stack([w0, w1 + w2], dim), torch.stack([w0 + w1, w2], dim)])


def subpixel_kernels(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """A 3x3 kernel [O, I, 3, 3] (padding 1) on the nearest-2x image as one 2x2 kernel [4*O, I, 2, 2] on the
    low-res image padded by 1, and the bias [4*O]; output channel (2a + b)*O + o is phase (a, b) of channel
    o, i.e. output pixel (2i + a, 2j + b), found at row i + a, column j + b of the 2x2 conv's output.

    Per axis, output 2i + a reads low-res pixel (2i + a - 1 + k) // 2 with tap k: phase 0 reads i - 1 (tap
    0) and i (taps 1, 2), phase 1 reads i (taps 0, 1) and i + 1 (tap 2). Taps are summed in float32 (at
    least) and rounded once to the weight's dtype; the kernel keeps the weight's memory format."""
    k = _fold_taps(
        _fold_taps(_widened(weight), 3), 3
    )  # columns -> [b, O, I, 3, 2]; rows -> [a, b, O, I, 2, 2]
    k = k.reshape(4 * weight.shape[0], weight.shape[1], 2, 2)
    k = k.to(dtype=weight.dtype, memory_format=memory_format_of(weight))
    return k, None if bias is None else bias.repeat(4)


class SubpixelUp2xConv(_DerivedKernelsOwner, nn.Sequential):
    """diffusers' `resample` (nearest-exact 2x, then Conv2d 3x3 with padding 1) of [N, C, H, W] ->
    [N, O, 2H, 2W], computed sub-pixel (module docstring): ONE 2x2 conv with 4*O outputs over the low-res
    input padded by 1 (`subpixel_kernels`: one cuDNN call gives all 4 output phases), then one strided copy
    interleaves the phases.

    The children stay diffusers' (`0`: NearestUp2x, `1`: the Conv2d), so the checkpoint's keys
    (`resample.1.weight`, `resample.1.bias`) load unchanged and the Conv2d keeps holding the parameters; the
    2x2 kernels are a `DerivedKernels` cache (16/9 of the conv weight, ~75 MB bf16 for Wan2.2's three
    upsamplers; derived in-graph under torch.compile: ~10 us a call for O = I = 1024)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__(NearestUp2x(), nn.Conv2d(in_dim, out_dim, 3, padding=1))
        self._kernels = DerivedKernels(subpixel_kernels)

    def kernels(self) -> tuple[Tensor, Tensor | None]:
        """The 2x2 phase kernels [4*O, I, 2, 2] and bias [4*O] of the current 3x3 weight and bias."""
        return self._kernels.get(self[1].weight, self[1].bias)

    def forward(self, x: Tensor) -> Tensor:
        n, _, h, w = x.shape
        weight, bias = self.kernels()
        o = weight.shape[0] // 4
        y = F.conv2d(x, weight, bias, padding=1)  # [N, 4*O, H + 1, W + 1]
        sn, sc, sh, sw = y.stride()
        # [N, O, H, 2, W, 2] view of y: element (n, c, i, a, j, b) is y[n, (2a + b)*O + c, i + a, j + b]
        phases = y.as_strided((n, o, h, 2, w, 2), (sn, sc, sh, 2 * o * sc + sh, sw, o * sc + sw))
        out = torch.empty(
            (n, o, 2 * h, 2 * w), dtype=y.dtype, device=y.device, memory_format=memory_format_of(x)
        )
        out.view(n, o, h, 2, w, 2).copy_(phases)
        return out

    def reference(self, x: Tensor) -> Tensor:
        """diffusers' formulation: nearest-exact 2x, then the 3x3 conv (the same numbers up to rounding)."""
        return self[1](self[0](x))

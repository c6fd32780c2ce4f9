"""FP8 (e4m3) GEMMs with row-wise scales: the `--quantization fp8` seam of the gen tower's linear layers.

Weights are quantised once, after loading: one float32 scale per output row (`quantize_rowwise(w)` ->
w_fp8 [N, K] e4m3, scale [N, 1]), each row's absmax mapped to 448. Activations are quantised on the fly,
one scale per token row, inside `fp8_linear`; under torch.compile that amax + scale + cast fuses with the
producer of the activation (RMSNorm, SiLU*up). The GEMM is `torch._scaled_mm(x_fp8 [M, K], w_fp8.t()
[K, N] column-major, scale_a [M, 1], scale_b [1, N], out_dtype=bf16)`: cuBLAS/CUTLASS rowwise fp8, which
needs sm90+ (Hopper, Blackwell) and both operands e4m3. `emulate=True` computes the same math in float32
on any device (e4m3 products are exact in float32; only the K-sum order differs): tests and machines
without fp8 GEMMs use it. fp8 attention is not done: PyTorch 2.11 exposes no fp8 SDPA (cuDNN fp8
attention is only a proposed private op upstream).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_AMAX = 1e-12
"""Floor of a row's absmax, so that an all-zero row gets a finite scale (and quantises to zeros)."""


def fp8_supported(device: str | torch.device) -> bool:
    """Whether `device` runs row-wise scaled e4m3 GEMMs natively (CUDA sm90+; not ROCm, not CPU)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_unavailable_reason(device: str | torch.device, dtype: torch.dtype) -> str | None:
    """Why native fp8 GEMMs cannot run for a model on `device` in `dtype` (one line), or None when they can."""
    if not fp8_supported(device):
        return f"fp8 GEMMs need an NVIDIA GPU of compute capability 9.0+ (H100/H200/B200); {device} has none"
    if dtype != torch.bfloat16:
        return f"fp8 GEMMs need a bfloat16 model (row-wise _scaled_mm), got {dtype}"
    return None


def quantize_rowwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (x_fp8 [..., K] e4m3, scale [..., 1] float32) with x ~= x_fp8 * scale.

    Each row's absmax maps to the e4m3 maximum (448), so no row saturates and its largest element keeps
    3 mantissa bits; the relative rounding error of an element is at most 2^-4."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(_MIN_AMAX)
    scale = amax / FP8_MAX
    # The clamp catches the last-ulp overshoot of x / scale: casting past 448 to e4m3fn gives NaN.
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rowwise(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of quantize_rowwise (up to its rounding): q [..., K] e4m3 * scale [..., 1]."""
    return (q.float() * scale).to(dtype)


def fp8_linear(
    x: Tensor,
    w_fp8: Tensor,
    w_scale: Tensor,
    bias: Tensor | None = None,
    *,
    emulate: bool = False,
    fast_accum: bool = True,
) -> Tensor:
    """y = x W^T + b with W = w_fp8 [N, K] * w_scale [N, 1] and x [..., K] quantised per row here.

    Native path: torch._scaled_mm, bf16 output (x must be bf16). `fast_accum`: Hopper's fp8 tensor-core
    accumulation without periodic fp32 promotion (what the 1.28-1.37 PF/s rowwise numbers of
    performance.md §3.2 used; its error is far below the e4m3 rounding of the inputs). `emulate`: the
    same quantised math in float32 on any device, output in x.dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    xq, xs = quantize_rowwise(x2)  # [M, K] e4m3, [M, 1] f32
    if emulate:
        # Products of two e4m3 values are exact in float32; then the same per-row / per-column scaling.
        y = (xq.float() @ w_fp8.float().t()) * xs * w_scale.view(1, -1)  # [M, N] f32
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*lead, -1)
    y = torch._scaled_mm(
        xq,
        w_fp8.t(),  # [K, N] column-major view of the row-major weight, as the kernel requires
        scale_a=xs,
        scale_b=w_scale.view(1, -1),  # [1, N]
        out_dtype=x.dtype,
        use_fast_accum=fast_accum,
    )
    if bias is not None:  # added outside: rowwise _scaled_mm's bias support varies between builds
        y = y + bias
    return y.reshape(*lead, -1)


class Fp8Linear(nn.Module):
    """A frozen linear layer holding an e4m3 weight [N, K] and its per-row float32 scale [N, 1].

    Built from a loaded bf16 / fp32 linear (`from_linear`); the source weight is not kept, so replacing a
    module by its Fp8Linear frees the high-precision copy. Single-rank: no tensor-parallel reduction."""

    def __init__(
        self,
        weight: Tensor,
        weight_scale: Tensor,
        bias: Tensor | None,
        *,
        emulate: bool = False,
        fast_accum: bool = True,
    ) -> None:
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.ndim != 2:
            raise ValueError(
                f"weight must be a 2-D {FP8_DTYPE} tensor, got {weight.dtype} {tuple(weight.shape)}"
            )
        if weight_scale.shape != (weight.shape[0], 1) or weight_scale.dtype != torch.float32:
            raise ValueError(f"weight_scale must be float32 [{weight.shape[0]}, 1]")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.emulate = emulate
        self.fast_accum = fast_accum

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Module, *, emulate: bool = False, fast_accum: bool = True) -> Fp8Linear:
        """Quantise `linear.weight` [N, K] per output row; the bias is kept in its own dtype."""
        w_fp8, scale = quantize_rowwise(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(w_fp8, scale, bias, emulate=emulate, fast_accum=fast_accum)

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(
            x, self.weight, self.weight_scale, self.bias, emulate=self.emulate, fast_accum=self.fast_accum
        )

    def extra_repr(self) -> str:
        mode = "emulated" if self.emulate else ("fast_accum" if self.fast_accum else "fp32 accum")
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, {mode}"

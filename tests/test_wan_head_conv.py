"""L1 / L4: the Wan2.2 decoder's head conv (`HeadConv3d`, `torch.ops.worldserve.wan_head_conv`).

On the CPU the op runs F.conv3d + clamp: these tests pin its contract (shapes, memory format, the packed taps'
order, compiled = eager, autograd falls back). On CUDA the Triton kernel runs; the gpu tests hold it to a
float32 conv at the decoder's real width (256 -> 12) and at small ones, on shapes that are not multiples of
any tile, the one-frame first chunk, a batch of two and float16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worldserve.models.cosmos3.wan_head_conv import HeadConv3d, kernel_runs, packed_taps


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _reference(a: torch.Tensor, conv: torch.nn.Conv3d) -> torch.Tensor:
    """The head in float32: conv (zero H / W padding, the context frames already in a) then clamp."""
    return F.conv3d(a.float(), conv.weight.float(), conv.bias.float(), padding=(0, 1, 1)).clamp(-1, 1)


@pytest.mark.parametrize("channels_last", [False, True])
def test_op_is_conv_then_clamp_in_the_input_s_format(channels_last):
    torch.manual_seed(0)
    conv = HeadConv3d(16, 12).eval().requires_grad_(False)
    a = 3 * torch.randn(2, 16, 2 + 3, 5, 7)  # large enough that the clamp bites
    if channels_last:
        a = a.contiguous(memory_format=torch.channels_last_3d)
    out = conv(a)
    assert out.shape == (2, 12, 3, 5, 7)
    assert out.is_contiguous(memory_format=torch.channels_last_3d) == channels_last
    ref = _reference(a, conv)
    assert (ref.abs() == 1).float().mean() > 0.1
    torch.testing.assert_close(out, ref)
    conv.fused = False
    torch.testing.assert_close(conv(a), ref)


def test_packed_taps_are_the_conv_s_taps_in_order():
    """taps[kt*9 + kh*3 + kw] [C, 16] applied to the shifted input and summed is the conv; the padded
    output channels are zero and the bias rides along in float32."""
    torch.manual_seed(1)
    conv = HeadConv3d(8, 12).eval().requires_grad_(False)
    a = torch.randn(1, 8, 2 + 2, 4, 5)
    taps, bias = packed_taps(conv.weight, conv.bias)
    assert taps.shape == (27, 8, 16) and bias.dtype == torch.float32 and bias.shape == (16,)
    padded = F.pad(a, (1, 1, 1, 1))  # [1, 8, 4, 6, 7]
    out = bias[None, :, None, None, None].expand(1, 16, 2, 4, 5).clone()
    for kt in range(3):
        for kh in range(3):
            for kw in range(3):
                x = padded[:, :, kt : kt + 2, kh : kh + 4, kw : kw + 5]
                out += torch.einsum("bcthw,cn->bnthw", x, taps[kt * 9 + kh * 3 + kw])
    assert torch.equal(out[:, 12:], torch.zeros_like(out[:, 12:]))
    torch.testing.assert_close(out[:, :12].clamp(-1, 1), conv(a))


def test_compiled_head_calls_the_op_and_equals_eager():
    torch.manual_seed(2)
    conv = HeadConv3d(16, 12).eval().requires_grad_(False)
    a = torch.randn(1, 16, 2 + 2, 4, 6).contiguous(memory_format=torch.channels_last_3d)
    compiled = torch.compile(conv, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(a), conv(a))


def test_with_autograd_on_the_weight_or_the_input_it_runs_differentiable_torch_ops():
    conv = HeadConv3d(16, 12)
    a = torch.randn(1, 16, 2 + 1, 3, 4)
    conv(a).sum().backward()
    assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0
    conv.requires_grad_(False)  # frozen weights, an input that needs its gradient
    a.requires_grad_(True)
    conv(a).sum().backward()
    assert a.grad is not None and a.grad.abs().sum() > 0
    conv.bias.requires_grad_(True)  # a bias-only fine-tune
    conv(a.detach()).sum().backward()
    assert conv.bias.grad is not None and conv.bias.grad.abs().sum() > 0


def test_the_kernel_is_not_chosen_where_it_cannot_run():
    conv = HeadConv3d(16, 12)
    assert not kernel_runs(torch.randn(1, 16, 3, 4, 4), conv.weight)  # CPU
    assert not kernel_runs(torch.randn(1, 16, 3, 4, 4, dtype=torch.bfloat16), conv.weight.bfloat16())


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernel)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("batch", "channels", "frames", "h", "w", "dtype"),
    [
        (1, 256, 2, 45, 80, torch.bfloat16),  # the decoder's width, a 720p frame / 8
        (1, 256, 1, 37, 61, torch.bfloat16),  # the one-frame first chunk, sizes no tile divides
        (2, 32, 3, 9, 130, torch.bfloat16),
        (1, 48, 2, 17, 33, torch.float16),
    ],
)
def test_triton_kernel_matches_a_float32_conv(batch, channels, frames, h, w, dtype):
    torch.manual_seed(3)
    conv = HeadConv3d(channels, 12).cuda().to(dtype).eval().requires_grad_(False)
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
    a = torch.randn(batch, channels, 2 + frames, h, w, device="cuda", dtype=dtype)
    a = a.contiguous(memory_format=torch.channels_last_3d)
    assert kernel_runs(a, conv.weight)
    ref = _reference(a, conv)
    out = conv(a)
    assert out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last_3d)
    assert out.abs().max() <= 1
    # one rounding of the output to bf16 / fp16 (cuDNN's own error against float32 is the same size)
    assert _rel(out, ref) <= (4e-3 if dtype == torch.bfloat16 else 5e-4)
    conv.fused = False
    assert _rel(out, conv(a)) <= (8e-3 if dtype == torch.bfloat16 else 1e-3)
    conv.fused = True
    # any strides compute the same conv (slower): the plain contiguous layout
    assert _rel(conv(a.contiguous()), ref) <= (4e-3 if dtype == torch.bfloat16 else 5e-4)

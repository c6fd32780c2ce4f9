"""Attention backends: the FA3 / SDPA choice and its errors (CPU), our FA3 glue against SDPA through a
reference FA3 front end (CPU), and the real FlashAttention-3 kernels against SDPA (marked gpu).

The CPU stand-in for the FA3 package implements FA3's documented contract (token-major [B, N, H, D], GQA by
head groups, causal aligned to the bottom right, fp8 inputs un-scaled by *_descale) with the SDPA math
kernel, so a layout, mask or scale mistake in flash_attention.py shows up as a mismatch."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from worldserve.models.layers import flash_attention as fa
from worldserve.models.layers.attention import sdpa_attention
from worldserve.runner.kernel_options import KernelOptions


def _reference_fa3_module() -> types.ModuleType:
    def flash_attn_func(
        q, k, v, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None
    ):
        assert q.dim() == 4 and q.shape[0] == 1, "FA3 takes [B, N, H, D]"
        deq = [
            x.float() * (s[0, 0] if s is not None else 1.0)
            for x, s in ((q, q_descale), (k, k_descale), (v, v_descale))
        ]
        qh, kh, vh = (x.transpose(1, 2) for x in deq)  # [B, H, N, D]
        nq, nk = qh.shape[2], kh.shape[2]
        mask = None
        if causal:
            mask = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=softmax_scale, enable_gqa=True)
        return out.transpose(1, 2).to(torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype), None

    return types.SimpleNamespace(__name__="reference_fa3", flash_attn_func=flash_attn_func)


@pytest.fixture
def reference_fa3(monkeypatch):
    monkeypatch.setattr(fa, "fa3_module", _reference_fa3_module)


def _qkv(nq: int, nk: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(nq, 4, 32, generator=g, dtype=dtype)
    k = torch.randn(nk, 2, 32, generator=g, dtype=dtype)
    v = torch.randn(nk, 2, 32, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(("nq", "nk", "causal"), [(7, 7, False), (5, 12, False), (9, 9, True), (3, 10, True)])
def test_fa3_glue_matches_sdpa(reference_fa3, nq, nk, causal):
    q, k, v = _qkv(nq, nk)
    ours = fa.fa3_attention(q, k, v, causal=causal)
    ref = sdpa_attention(q, k, v, causal=causal)
    assert ours.shape == (nq, 4, 32)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_fa3_fp8_glue_is_close_but_lossy(reference_fa3):
    q, k, v = _qkv(64, 80)
    ref = sdpa_attention(q, k, v)
    out = fa.fa3_fp8_attention(q, k, v)
    err = float((out.float() - ref).norm() / ref.norm())
    assert 1e-3 < err < 0.1, err  # e4m3 rounding, correctly un-scaled (a wrong scale is off by O(1))


def test_e4m3_quantisation_scales_to_the_amax():
    x = torch.randn(100, 3) * 1000
    x8, s = fa.quantize_e4m3_per_tensor(x)
    assert x8.dtype == torch.float8_e4m3fn
    assert float(x8.float().abs().max()) == pytest.approx(fa.E4M3_MAX)
    torch.testing.assert_close(x8.float() * s, x, rtol=0.07, atol=1e-3)


def test_auto_falls_back_to_sdpa_and_flash_attn_explains_why():
    assert fa.resolve_attention_backend(None, torch.device("cpu"), torch.float32, 128)[0] == "sdpa"
    assert fa.resolve_attention_backend("TORCH_SDPA", torch.device("cpu"), torch.float32, 128)[0] == "sdpa"
    with pytest.raises(ValueError, match="FLASH_ATTN: FlashAttention-3 needs an NVIDIA Hopper GPU"):
        fa.resolve_attention_backend("FLASH_ATTN", torch.device("cpu"), torch.bfloat16, 128)
    with pytest.raises(ValueError, match="must be one of"):
        fa.resolve_attention_backend("SAGE_ATTN", torch.device("cpu"), torch.bfloat16, 128)


def test_kernel_options_validate_names_and_read_the_environment(monkeypatch):
    with pytest.raises(ValueError, match="must be one of"):
        KernelOptions(attention_backend="XFORMERS")
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "TORCH_SDPA")
    assert KernelOptions().backend_name == "TORCH_SDPA"
    assert KernelOptions(attention_backend="FLASH_ATTN").backend_name == "FLASH_ATTN"  # the flag wins
    opts = KernelOptions.from_flags(
        enforce_eager=True, quantization=None, diffusion_attention_backend="auto", fp8_attention=False
    )
    assert opts.attention_backend is None and not opts.compile
    with pytest.raises(ValueError, match="--fp8-attention: FlashAttention-3 needs an NVIDIA Hopper GPU"):
        KernelOptions(fp8_attention=True).check(torch.device("cpu"), torch.bfloat16)


def test_transformer_routes_every_layer_through_the_chosen_backend(tiny_ckpt, monkeypatch):
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    assert model.set_attention_backend(None) == "sdpa"
    assert all(b.attn_fn is sdpa_attention for layer in model.layers for b in (layer.und, layer.gen))
    with pytest.raises(ValueError, match="fp8 attention needs the FlashAttention-3 backend"):
        model.set_attention_backend("TORCH_SDPA", fp8_attention=True)
    # Where FA3 can run, every layer gets it (the gen tower its fp8 kernel on request).
    monkeypatch.setattr(fa, "fa3_unavailable_reason", lambda *a: None)
    assert model.set_attention_backend(None, fp8_attention=True) == "fa3+fp8"
    assert all(layer.und.attn_fn is fa.fa3_attention for layer in model.layers)
    assert all(layer.gen.attn_fn is fa.fa3_fp8_attention for layer in model.layers)


def test_generate_refuses_flash_attn_without_a_hopper_gpu(tiny_ckpt, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "worldserve.cli", "generate", str(tiny_ckpt), "--prompt", "a cat",
         "--diffusion-attention-backend", "FLASH_ATTN", "-o", str(tmp_path / "x.mp4")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        "--diffusion-attention-backend FLASH_ATTN: FlashAttention-3 needs an NVIDIA Hopper GPU" in proc.stderr
    )
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------- GPU
def _hopper_fa3() -> bool:
    return (
        torch.cuda.is_available()
        and fa.fa3_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128) is None
    )


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_fa3(), reason="needs an H100/H200 with the FA3 package")
@pytest.mark.parametrize(
    ("nq", "nk", "causal"), [(1000, 1000, False), (700, 1300, False), (513, 513, True), (1, 77, True)]
)
def test_real_fa3_matches_sdpa(nq, nk, causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(nq, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(nk, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(nk, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    ref = sdpa_attention(q.float(), k.float(), v.float(), causal=causal)
    for fn, tol in ((fa.fa3_attention, 0.01), (fa.fa3_fp8_attention, 0.1)):
        out = fn(q, k, v, causal=causal)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        err = float((out.float() - ref).norm() / ref.norm())
        assert err < tol, (fn.__name__, err)

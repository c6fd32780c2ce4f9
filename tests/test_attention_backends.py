"""Attention backends: the FA3 / SDPA choice and its errors (CPU), our FA3 glue against SDPA through a
reference FA3 front end (CPU), and the real FlashAttention-3 kernels against SDPA (marked gpu).

The CPU stand-in for the FA3 package implements FA3's documented contract (token-major [B, N, H, D], GQA by
head groups, causal aligned to the bottom right, fp8 inputs un-scaled by *_descale) with the SDPA math
kernel, so a layout, mask or scale mistake in flash_attention.py shows up as a mismatch."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import run_cli

from worldserve.models.layers import flash_attention as fa
from worldserve.models.layers.attention import any_shape_sdpa_attention, sdpa_attention
from worldserve.runner.kernel_options import KernelOptions

SM_MARGINS: list[int] = []  # the sm_margin argument of every reference FA3 call


def _reference_fa3_module() -> types.ModuleType:
    def fwd(q, k, v, k_new, v_new, qv, out, *rest):
        """FA3's compiled `fwd` op, its 34 positional arguments: (out, lse, ...)."""
        assert q.dim() == 4 and q.shape[0] == 1, "FA3 takes [B, N, H, D]"
        assert len(rest) == 27 and (k_new, v_new, qv) == (None, None, None) and rest[:13] == (None,) * 13
        q_descale, k_descale, v_descale, softmax_scale, causal = rest[13:18]
        assert rest[18:-1] == (-1, -1, 0, 0.0, True, None, 1, None), "plain attention, no extras"
        SM_MARGINS.append(rest[-1])
        deq = [
            x.float() * (s[0, 0] if s is not None else 1.0)
            for x, s in ((q, q_descale), (k, k_descale), (v, v_descale))
        ]
        qh, kh, vh = (x.transpose(1, 2) for x in deq)  # [B, H, N, D]
        nq, nk = qh.shape[2], kh.shape[2]
        mask = None
        if causal:
            mask = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq)
        res = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=softmax_scale, enable_gqa=True)
        res = res.transpose(1, 2).to(torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype)
        if out is not None:
            assert out.dtype == res.dtype and out.is_contiguous(), "FA3 checks the out buffer"
            res = out.copy_(res)
        scores = qh @ kh.repeat_interleave(qh.shape[1] // kh.shape[1], 1).transpose(-1, -2) * softmax_scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return res, scores.logsumexp(-1)  # lse [B, Hq, Nq]

    return types.SimpleNamespace(__name__="reference_fa3", fa3_fwd_cuda=types.SimpleNamespace(fwd=fwd))


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


def test_fa3_glue_writes_into_the_given_output_rows(reference_fa3):
    q, k, v = _qkv(6, 9)
    buf = torch.full((10, 4, 32), float("nan"))
    res = fa.fa3_attention(q, k, v, out=buf[3:9])
    assert res.data_ptr() == buf[3:9].data_ptr()
    torch.testing.assert_close(buf[3:9], sdpa_attention(q, k, v), atol=1e-5, rtol=1e-5)
    assert buf[:3].isnan().all() and buf[9:].isnan().all()
    buf2 = torch.full((6, 4, 32), float("nan"))
    assert sdpa_attention(q, k, v, out=buf2) is buf2
    torch.testing.assert_close(buf2, buf[3:9])


def test_sm_margin_reaches_fa3_and_cublas_while_set(reference_fa3):
    """runner/chat_share.set_sm_margin: FA3's sm_margin argument and cuBLAS's SM carve-out, then back to 0."""
    from worldserve.runner.chat_share import set_sm_margin

    q, k, v = _qkv(4, 6)
    SM_MARGINS.clear()
    try:
        set_sm_margin(16)
        fa.fa3_attention(q, k, v)
        assert torch._C._get_sm_carveout_experimental() == 16
    finally:
        set_sm_margin(0)
    fa.fa3_attention(q, k, v)
    assert SM_MARGINS == [16, 0] and torch._C._get_sm_carveout_experimental() in (None, 0)


def test_fa3_fp8_glue_is_close_but_lossy(reference_fa3):
    q, k, v = _qkv(64, 80)
    ref = sdpa_attention(q, k, v)
    out = fa.fa3_fp8_attention(q, k, v)
    err = float((out.float() - ref).norm() / ref.norm())
    assert 1e-3 < err < 0.1, err  # e4m3 rounding, correctly un-scaled (a wrong scale is off by O(1))


def test_e4m3_quantisation_scales_to_the_amax():
    """Rounded to e4m3: within half a step of its 3 mantissa bits (6.25 %), and near zero within half the
    smallest subnormal step (2**-9, in units of the scale): an unseeded draw once put a value there."""
    x = torch.randn(100, 3, generator=torch.Generator().manual_seed(0)) * 1000
    x[0, :] = torch.tensor([0.016, -0.004, 0.0])  # values in e4m3's subnormal range once scaled
    x8, s = fa.quantize_e4m3_per_tensor(x)
    assert x8.dtype == torch.float8_e4m3fn
    assert float(x8.float().abs().max()) == pytest.approx(fa.E4M3_MAX)
    torch.testing.assert_close(x8.float() * s, x, rtol=0.0625, atol=float(s) * 2**-10)


def test_auto_falls_back_to_sdpa_and_flash_attn_explains_why():
    assert fa.resolve_attention_backend(None, torch.device("cpu"), torch.float32, 128)[0] == "sdpa"
    assert fa.resolve_attention_backend("TORCH_SDPA", torch.device("cpu"), torch.float32, 128)[0] == "sdpa"
    with pytest.raises(ValueError, match="FLASH_ATTN: FlashAttention-3 needs an NVIDIA Hopper GPU"):
        fa.resolve_attention_backend("FLASH_ATTN", torch.device("cpu"), torch.bfloat16, 128)
    with pytest.raises(ValueError, match="must be one of"):
        fa.resolve_attention_backend("SAGE_ATTN", torch.device("cpu"), torch.bfloat16, 128)


def test_fa3_is_used_only_with_the_fwd_op_it_calls(monkeypatch):
    """fa3_forward calls the front end's compiled fwd op with its 34 arguments: a build whose op takes
    another list (older upstream FA3) is reported unusable, not picked and failed at the first step."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")

    def module(n_args):
        schema = types.SimpleNamespace(arguments=[None] * n_args)
        fwd = types.SimpleNamespace(default=types.SimpleNamespace(_schema=schema))
        return types.SimpleNamespace(__name__="some_fa3", fa3_fwd_cuda=types.SimpleNamespace(fwd=fwd))

    monkeypatch.setattr(fa, "fa3_module", lambda: module(fa.FA3_FWD_ARGS))
    assert fa.fa3_unavailable_reason(cuda, torch.bfloat16, 128) is None
    monkeypatch.setattr(fa, "fa3_module", lambda: module(30))
    assert "compiled fwd op is not the 34-argument one" in fa.fa3_unavailable_reason(
        cuda, torch.bfloat16, 128
    )
    monkeypatch.setattr(fa, "fa3_module", _reference_fa3_module)  # a plain function, no op schema
    assert "compiled fwd op" in fa.fa3_unavailable_reason(cuda, torch.bfloat16, 128)


def test_an_fa3_install_that_does_not_import_says_why(monkeypatch, tmp_path):
    """An FA3 package whose import fails (a binary built for another torch: an undefined symbol) is reported
    with its error, not as "no package is importable" with an install hint (which it already has)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    (tmp_path / "fa3_fwd_interface.py").write_text(
        "raise OSError('fa3_fwd_cuda.so: undefined symbol: _ZN3c10')"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fa._fa3_import.cache_clear()
    try:
        reason = fa.fa3_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128)
    finally:
        fa._fa3_import.cache_clear()
    assert "does not import (fa3_fwd_interface: OSError: fa3_fwd_cuda.so: undefined symbol" in reason


def test_kernel_options_validate_names_and_read_the_environment(monkeypatch):
    with pytest.raises(ValueError, match="must be one of"):
        KernelOptions(attention_backend="XFORMERS")
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "XFORMERS")  # the message names where it came from
    with pytest.raises(ValueError, match="^environment variable DIFFUSION_ATTENTION_BACKEND must be one of"):
        KernelOptions()
    monkeypatch.setenv("DIFFUSION_ATTENTION_BACKEND", "FLASH_ATTN")
    with pytest.raises(ValueError, match="^environment variable DIFFUSION_ATTENTION_BACKEND FLASH_ATTN: "):
        KernelOptions().check(torch.device("cpu"), torch.bfloat16)
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


def test_cudnn_attn_off_cuda_says_which_kernels_run(tiny_ckpt, caplog):
    """--diffusion-attention-backend CUDNN_ATTN on a CPU runs SDPA's own kernels: said once, not silently."""
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    with caplog.at_level("WARNING", logger="worldserve.kernels"):
        assert KernelOptions(attention_backend="CUDNN_ATTN", compile=False).apply(model) == "sdpa"
        assert KernelOptions(attention_backend="TORCH_SDPA", compile=False).apply(model) == "sdpa"
    assert [r.getMessage() for r in caplog.records] == [
        "--diffusion-attention-backend CUDNN_ATTN: cuDNN attention runs on CUDA only; on cpu PyTorch SDPA's own "
        "kernels run"
    ]


def test_first_layer_shares_a_cfg_pairs_gen_attention_and_computes_the_same(tiny_ckpt, monkeypatch):
    """A CFG pair (same latents, sound and timestep; prompts of different lengths, so every gen position
    differs by a constant) computes its first layer's gen-gen attention once, merged by LSE with each
    branch's prompt attention: the same velocities as two separate attentions (float32), and the twin
    path really ran (one gen-gen call fewer)."""
    from worldserve.models.cosmos3.batch import GenBatch, GenItem, twin_groups
    from worldserve.weights.loader import load_transformer

    monkeypatch.setattr(fa, "fa3_module", _reference_fa3_module)
    monkeypatch.setattr(fa, "fa3_unavailable_reason", lambda *a: None)
    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    cfg = model.config
    assert model.set_attention_backend("FLASH_ATTN") == "fa3"
    g = torch.Generator().manual_seed(5)
    caches = model.prefill_und([torch.randint(0, 100, (n,), generator=g) for n in (9, 4)])
    lat = torch.randn(cfg.latent_channel, 3, 4, 6, generator=g)
    snd = torch.randn(cfg.sound_dim, 5, generator=g)
    items = [GenItem(latents=lat, timestep=700.0, und_cache=c, sound=snd) for c in caches]
    batch = GenBatch.pack(items, config=cfg, device="cpu")
    assert batch.twins == ((0, 1),)
    calls = []
    first = model.layers[0].gen
    first.attn_lse_fn = lambda *a, **k: calls.append(a[1].shape[0]) or fa.fa3_forward(*a, **k)
    shared = model(batch)
    assert calls == [batch.layout[0].num_tokens, 9, 4]  # gen-gen once, then each prompt's keys
    separate = model(dataclasses.replace(batch, twins=()))
    for a, b in zip(shared.video + shared.sound, separate.video + separate.sound, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # two requests batched, each a CFG pair of its own shape and prompts: two twin groups, the same numbers
    lat_b = torch.randn(cfg.latent_channel, 2, 6, 4, generator=g)
    caches_b = model.prefill_und([torch.randint(0, 100, (n,), generator=g) for n in (3, 7)])
    items_b = [GenItem(latents=lat_b, timestep=300.0, und_cache=c, clean_frames=(0,)) for c in caches_b]
    batch4 = GenBatch.pack(items + items_b, config=cfg, device="cpu")
    assert batch4.twins == ((0, 1), (2, 3))
    shared4, separate4 = model(batch4), model(dataclasses.replace(batch4, twins=()))
    for a, b in zip(shared4.video, separate4.video, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # no twins unless the gen input is the very same: another latents tensor, another timestep
    other = GenItem(latents=lat.clone(), timestep=700.0, und_cache=caches[1], sound=snd)
    later = GenItem(latents=lat, timestep=600.0, und_cache=caches[1], sound=snd)
    assert twin_groups([items[0], other]) == () and twin_groups([items[0], later]) == ()
    assert twin_groups([items[0], other, items[1]]) == ((0, 2),)


def test_generate_refuses_flash_attn_without_a_hopper_gpu(tiny_ckpt, tmp_path):
    proc = run_cli("generate", tiny_ckpt, "--prompt", "a cat", "--diffusion-attention-backend", "FLASH_ATTN",
                   "-o", tmp_path / "x.mp4")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        "--diffusion-attention-backend FLASH_ATTN: FlashAttention-3 needs an NVIDIA Hopper GPU" in proc.stderr
    )
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------- GPU
def _softmax_attention(q, k, v, causal):
    """The definition in float64: every query head over its KV head's keys, causal at the bottom right."""
    nq, nk = q.shape[0], k.shape[0]
    kk, vv = (x.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) / q.shape[-1] ** 0.5  # [Hq, Nq, Nk]
    if causal:
        allowed = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)


@pytest.mark.parametrize("fn", [sdpa_attention, any_shape_sdpa_attention])
@pytest.mark.parametrize(
    ("nq", "nk", "causal"), [(7, 7, False), (5, 12, False), (9, 9, True), (3, 10, True), (1, 10, True)]
)  # (3, 10, True): a prefill chunk over 7 cached tokens; (1, 10): one query sees every key
@pytest.mark.parametrize("bias_takes_gqa", [True, False])  # (False: older torch, K/V heads repeated)
def test_sdpa_is_softmax_attention_with_gqa_and_a_bottom_right_causal_mask(
    fn, nq, nk, causal, bias_takes_gqa, monkeypatch
):
    from worldserve.models.layers import attention

    monkeypatch.setattr(attention, "_CAUSAL_BIAS_TAKES_GQA", bias_takes_gqa)
    q, k, v = _qkv(nq, nk)
    torch.testing.assert_close(fn(q, k, v, causal=causal).double(), _softmax_attention(q, k, v, causal),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    buf = torch.full((nq + 2, 4, 32), float("nan"))
    assert fn(q, k, v, causal=causal, out=buf[1 : 1 + nq]).data_ptr() == buf[1].data_ptr()
    assert buf[0].isnan().all() and buf[-1].isnan().all()


def _cuda_kernels(fn) -> list[str]:
    """The CUDA kernels one call of fn() launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("nq", "nk"), [(34, 930), (513, 513)])  # a cached prefix's chat; a whole prompt
def test_causal_sdpa_runs_flash_with_no_graph_build_per_shape(nq, nk):
    """The und tower's prefill without FA3 (and the ViT's items): flash, not cuDNN, whose per-shape graph
    build cost 46-790 ms a new prompt length on an H200 (bench/sdpa_new_shapes.py); right at the bottom-right
    alignment, GQA 32 / 8, token-major strided views."""
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(max(nq, nk), 48, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = qkv[-nq:, :32], qkv[-nk:, 32:40], qkv[-nk:, 40:]  # (column slices, as a fused projection's)
    ref = _softmax_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), True).float().cuda()
    out = sdpa_attention(q, k, v, causal=True)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
    kernels = _cuda_kernels(lambda: sdpa_attention(q, k, v, causal=True))
    assert _flash_not_cudnn(kernels), kernels
    # the ViT's items: 16 heads of 72, q / k / v column slices of one fused projection
    vq, vk, vv = torch.randn(nk, 3, 16, 72, device="cuda", dtype=torch.bfloat16, generator=g).unbind(1)
    out = any_shape_sdpa_attention(vq, vk, vv)
    ref = _softmax_attention(vq.float().cpu(), vk.float().cpu(), vv.float().cpu(), False).float().cuda()
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
    vit = _cuda_kernels(lambda: any_shape_sdpa_attention(vq, vk, vv))
    assert _flash_not_cudnn(vit), vit


def _flash_not_cudnn(kernels: list[str]) -> bool:
    """PyTorch's flash kernels ran and no cuDNN one (cuDNN's SDPA kernels have "flash" in their names too)."""
    names = [name.lower() for name in kernels]
    return any("flash_fwd" in n or "pytorch_flash" in n for n in names) and not any(
        "cudnn" in n for n in names
    )


def _hopper_fa3() -> bool:
    return (
        torch.cuda.is_available()
        and fa.fa3_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128) is None
    )


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or fa.fa3_module() is None,
    reason="needs an H100/H200 with the FA3 package",
)
def test_the_installed_fa3_is_usable_on_hopper():
    """Where the package imports on Hopper, FA3 is the backend (a schema mismatch would silently fall back)."""
    assert fa.fa3_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128) is None


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_fa3(), reason="needs an H100/H200 with the FA3 package")
@pytest.mark.parametrize(
    ("nq", "nk", "causal"),
    [(1000, 1000, False), (700, 1300, False), (513, 513, True), (1, 77, True), (300, 1000, True)],
)  # (300, 1000, True): a prefill chunk after 700 cached tokens, causal aligned at the bottom right
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
        buf = torch.full((nq + 5, 32, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
        assert fn(q, k, v, causal=causal, out=buf[2 : 2 + nq]).data_ptr() == buf[2].data_ptr()
        torch.testing.assert_close(buf[2 : 2 + nq], out, atol=0, rtol=0)  # same kernel, written in place
        assert buf[:2].isnan().all() and buf[2 + nq :].isnan().all()
    if not causal:  # the softmax LSE FA3 returns: [Hq, Nq] float32, natural log
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(4, dim=1)) / 128**0.5
        lse = fa.fa3_forward(q, k, v)[1]
        torch.testing.assert_close(lse, scores.logsumexp(-1), atol=2e-2, rtol=1e-3)

"""The gen tower's FA4 cluster kernel: what ships, when it is chosen, its call glue (CPU), and the real
kernel against FA3 and float32 attention on Hopper (marked gpu).

CPU: the committed kernel library and manifest; the reasons it cannot run; where the DSL runtime is found;
`set_attention_backend` giving it to the gen layers only on auto; causal calls going to FA3; the TVM-FFI
argument layout (a stand-in `tvm_ffi` records the call)."""

from __future__ import annotations

import contextlib
import json
import sys
import types

import pytest
import torch

from worldserve.models.layers import fa4_cluster as fc
from worldserve.models.layers import flash_attention as fa


@pytest.fixture
def fresh_cache():
    loader = fc._gen_kernel  # a test may patch it: clear the real one
    loader.cache_clear()
    yield
    loader.cache_clear()


def test_the_gen_kernel_ships_with_its_manifest():
    manifest = json.loads((fc.KERNEL_DIR / "manifest.json").read_text())
    entry = manifest["kernels"][fc.GEN_KERNEL]
    assert (entry["tile_m"], entry["tile_n"], entry["cluster_m"], entry["qhead_per_kvhead"]) == (
        128,
        176,
        2,
        4,
    )
    assert not entry["p_in_smem"] and not entry["pack_gqa"]
    assert manifest["arch"] == "sm_90a" and manifest["flash_attn_4"] == "4.0.0b36"
    lib = (fc.KERNEL_DIR / f"{fc.GEN_KERNEL}.so").read_bytes()
    assert (
        lib[:4] == b"\x7fELF" and f"__tvm_ffi_{fc.GEN_KERNEL}".encode() in lib
    )  # the entry TVM-FFI looks up


def test_reasons_it_cannot_run(monkeypatch, tmp_path, fresh_cache):
    assert "needs an NVIDIA Hopper GPU" in fc.fa4_cluster_unavailable_reason(
        torch.device("cpu"), torch.bfloat16, 128
    )
    monkeypatch.setattr(fc, "hopper_bf16_reason", lambda *a: None)
    assert "compiled for head dim 128, not 64" in fc.fa4_cluster_unavailable_reason(
        torch.device("cuda"), torch.bfloat16, 64
    )
    monkeypatch.setitem(sys.modules, "tvm_ffi", None)  # import tvm_ffi -> ImportError
    assert fc.fa4_cluster_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128) == (
        f"apache-tvm-ffi is not installed: {fc.INSTALL_HINT}"
    )
    fc._gen_kernel.cache_clear()
    monkeypatch.setitem(sys.modules, "tvm_ffi", types.ModuleType("tvm_ffi"))
    monkeypatch.setenv(fc.RUNTIME_ENV, str(tmp_path / "nowhere.so"))
    reason = fc.fa4_cluster_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128)
    assert reason.startswith("FileNotFoundError: the CuTe DSL runtime libcute_dsl_runtime.so is missing")
    assert "nowhere.so" in reason and "worldserve[hopper]" in reason


def test_the_runtime_is_taken_from_the_environment_then_the_installed_libs(monkeypatch, tmp_path):
    monkeypatch.setenv(fc.RUNTIME_ENV, "/opt/x/libcute_dsl_runtime.so")
    assert str(fc.runtime_library()) == "/opt/x/libcute_dsl_runtime.so"
    monkeypatch.delenv(fc.RUNTIME_ENV)
    pkg = tmp_path / "nvidia_cutlass_dsl"
    (pkg / "cu13" / "lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "nvidia_cutlass_dsl", raising=False)
    assert fc.runtime_library() is None  # the package without the library
    (pkg / "cu13" / "lib" / fc.RUNTIME).write_bytes(b"")
    assert fc.runtime_library() == pkg / "cu13" / "lib" / fc.RUNTIME


def test_auto_gives_the_gen_layers_the_cluster_kernel_and_the_und_layers_fa3(tiny_ckpt, monkeypatch):
    from worldserve.models.cosmos3 import transformer_setup as tr
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    monkeypatch.setattr(fa, "fa3_unavailable_reason", lambda *a: None)
    assert model.set_attention_backend(None) == "fa3"  # the cluster kernel cannot run on the CPU
    monkeypatch.setattr(tr, "fa4_cluster_unavailable_reason", lambda *a: None)
    assert model.set_attention_backend(None) == "fa4-cluster"
    assert all(layer.und.attn_fn is fa.fa3_attention for layer in model.layers)
    assert all(layer.gen.attn_fn is fc.fa4_cluster_attention for layer in model.layers)
    assert all(layer.gen.attn_lse_fn is fc.fa4_cluster_forward for layer in model.layers)
    assert model.set_attention_backend("FLASH_ATTN") == "fa3"  # asked for FA3 by name: FA3 everywhere
    assert all(layer.gen.attn_fn is fa.fa3_attention for layer in model.layers)
    assert all(layer.gen.attn_lse_fn is fa.fa3_forward for layer in model.layers)
    assert model.set_attention_backend(None, fp8_attention=True) == "fa3+fp8"
    assert all(
        layer.gen.attn_fn is fa.fa3_fp8_attention and layer.gen.attn_lse_fn is None for layer in model.layers
    )


def test_a_causal_call_or_another_gqa_ratio_goes_to_fa3(monkeypatch, fresh_cache):
    calls, kernel_calls = [], []
    monkeypatch.setattr(fc, "fa3_forward", lambda *a, **kw: calls.append(kw) or ("fa3", "lse"))

    class Recording(fc.Fa4Kernel):
        def forward(self, *a, **kw):
            return kernel_calls.append(kw) or ("fa4", "lse")

    monkeypatch.setattr(fc, "_gen_kernel", lambda: (Recording("k", "128x176-c2", 4, None), None))
    q, kv = torch.zeros(3, 8, 128), torch.zeros(5, 2, 128)
    assert fc.fa4_cluster_forward(q, kv, kv)[0] == "fa4"
    assert fc.fa4_cluster_forward(q, kv, kv, causal=True, scale=0.5)[0] == "fa3"
    assert fc.fa4_cluster_forward(q, q, q)[0] == "fa3"  # 8 / 8 heads: not the compiled ratio
    assert calls == [
        {"causal": True, "scale": 0.5, "out": None},
        {"causal": False, "scale": None, "out": None},
    ]
    assert kernel_calls == [{"scale": None, "out": None}]
    monkeypatch.setattr(fc, "_gen_kernel", lambda: (None, "no kernel here"))
    with pytest.raises(RuntimeError, match="cluster kernel cannot run: no kernel here"):
        fc.fa4_cluster_forward(q, kv, kv)


def test_while_chats_hold_an_sm_margin_the_calls_go_to_fa3_which_leaves_them_those_sms(
    monkeypatch, fresh_cache
):
    """The cluster kernel is not persistent and takes any SM a retiring CTA frees: beside it 8 chats decoded
    3.4 tokens/s each, 26 beside FA3 with 16 SMs left free (bench/results/README.md, thirty-fourth session)."""
    from worldserve.runner.chat_share import set_sm_margin

    used = []
    monkeypatch.setattr(fc, "fa3_forward", lambda *a, **kw: used.append("fa3") or ("fa3", "lse"))

    class Recording(fc.Fa4Kernel):
        def forward(self, *a, **kw):
            return used.append("fa4") or ("fa4", "lse")

    monkeypatch.setattr(fc, "_gen_kernel", lambda: (Recording("k", "128x176-c2", 4, None), None))
    q, kv = torch.zeros(3, 8, 128), torch.zeros(5, 2, 128)
    try:
        fc.fa4_cluster_forward(q, kv, kv)
        set_sm_margin(16)  # a chat went live (runner/chat_share.py)
        fc.fa4_cluster_forward(q, kv, kv)
        set_sm_margin(0)  # the last chat ended
        fc.fa4_cluster_forward(q, kv, kv)
    finally:
        set_sm_margin(0)
    assert used == ["fa4", "fa3", "fa4"]


def test_the_kernel_gets_fa4s_batch_major_arguments(monkeypatch):
    """The TVM-FFI function is FA4's SM90 `__call__`: q / k / v / out as [1, N, H, D] views of the caller's
    tensors, the LSE [1, Hq, Nq], the scale, then the 12 optional arguments absent; it runs inside
    `use_torch_stream` (PyTorch's current stream)."""
    seen, streams = [], []
    stand_in = types.ModuleType("tvm_ffi")
    stand_in.use_torch_stream = lambda: contextlib.nullcontext(streams.append("torch"))
    monkeypatch.setitem(sys.modules, "tvm_ffi", stand_in)

    def fn(*args):
        seen.append(args)
        args[4].fill_(1.5)  # the kernel writes the LSE

    kernel = fc.Fa4Kernel("k", "128x176-c2", 4, fn)
    q, k = torch.randn(10, 8, 128), torch.randn(12, 2, 128)
    out = torch.empty(12, 8, 128)[1:11]
    o, lse = kernel.forward(q, k, k, out=out)
    (args,) = seen
    assert len(args) == 18 and streams == ["torch"]
    assert [tuple(a.shape) for a in args[:5]] == [(1, 10, 8, 128), (1, 12, 2, 128), (1, 12, 2, 128),
                                                  (1, 10, 8, 128), (1, 8, 10)]  # fmt: skip
    assert args[3].data_ptr() == out.data_ptr() and o is out
    assert args[5] == pytest.approx(128**-0.5) and args[6:] == fc._ABSENT
    assert lse.shape == (8, 10) and lse.dtype == torch.float32 and bool((lse == 1.5).all())
    with pytest.raises(ValueError, match="non-causal kernel for 4 query heads per K/V head; got causal=True"):
        kernel.forward(q, k, k, causal=True)
    with pytest.raises(ValueError, match="got causal=False, 8 / 8 heads"):
        kernel.forward(q, q, q)


def test_the_self_test_keeps_fa3_when_the_kernel_fails_or_disagrees(monkeypatch):
    """Before the model takes the kernel, it runs once against FA3 on a small problem (here on the CPU, with
    stand-ins for both kernels): agreement passes; a launch error or a wrong result is the reason FA3 stays."""
    monkeypatch.setattr(fc, "fa3_forward", lambda q, k, v: (q.clone(), torch.zeros(q.shape[1], q.shape[0])))

    class StandIn(fc.Fa4Kernel):
        def forward(self, q, k, v, **kw):
            if self.fn == "raise":
                raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
            return (q.clone() if self.fn == "agree" else -q), torch.zeros(q.shape[1], q.shape[0])

    cpu = torch.device("cpu")
    assert fc.self_test(StandIn("k", "128x176-c2", 4, "agree"), cpu) is None
    assert fc.self_test(StandIn("k", "128x176-c2", 4, "raise"), cpu) == (
        "FlashAttention-4's cluster kernel failed its self-test: RuntimeError: CUDA error: no kernel image is "
        "available for execution on the device"
    )
    assert fc.self_test(StandIn("k", "128x176-c2", 4, "negate"), cpu).startswith(
        "FlashAttention-4's cluster kernel disagrees with FA3 (rel. L2 2.0e+00"
    )


def _cluster_kernel_runs() -> bool:
    return (
        torch.cuda.is_available()
        and fc.fa4_cluster_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128) is None
    )


def _hopper_with_the_kernel_packages() -> bool:
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and fa.fa3_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128) is None
        and fc.runtime_library() is not None
    )


@pytest.mark.gpu
@pytest.mark.skipif(
    not _hopper_with_the_kernel_packages(), reason="needs an H100/H200 with worldserve[hopper]"
)
def test_the_shipped_kernel_is_usable_on_hopper():
    """Where its packages are installed on Hopper, the kernel loads and passes its self-test (a failure would
    silently leave the gen tower on FA3, and skip the tests below)."""
    assert fc.fa4_cluster_unavailable_reason(torch.device("cuda"), torch.bfloat16, 128) is None


@pytest.mark.gpu
@pytest.mark.skipif(not _cluster_kernel_runs(), reason="needs an H100/H200 with worldserve[hopper]")
@pytest.mark.parametrize(
    ("nq", "nk", "hq", "hkv"),
    [
        (1000, 1300, 32, 8),
        (3 * 128 + 5, 700, 8, 2),
        (77, 2000, 32, 8),
        (2 * 128, 4096, 16, 4),
        (1, 33, 4, 1),
        (300, 500, 8, 8),
        (200, 300, 16, 2),
    ],
)  # odd and even numbers of 128-row query tiles (an odd count launches one CTA past the queries); the last
# two are not the compiled GQA ratio (4): FA3 computes them
def test_the_cluster_kernel_matches_fa3_and_float32(nq, nk, hq, hkv):
    g = torch.Generator(device="cuda").manual_seed(nq)
    q = torch.randn(nq, hq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(nk, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.float().transpose(0, 1) for x in (q, k, v)), enable_gqa=True
    ).transpose(0, 1)
    buf = torch.full((nq + 4, hq, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    out, lse = fc.fa4_cluster_forward(q, k, v, out=buf[2 : 2 + nq])
    assert out.data_ptr() == buf[2].data_ptr() and buf[:2].isnan().all() and buf[2 + nq :].isnan().all()
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
    fa3_out, fa3_lse = fa.fa3_forward(q, k, v)
    assert float((out.float() - fa3_out.float()).norm() / fa3_out.float().norm()) < 2e-3
    torch.testing.assert_close(lse, fa3_lse, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not _cluster_kernel_runs(), reason="needs an H100/H200 with worldserve[hopper]")
def test_the_cluster_kernel_reads_strided_views():
    """q / k / v as column slices of one fused [N, (Hq + 2 Hkv) D] projection (token strides larger than
    H D, as `qkv_math` returns them before the K/V buffers): the same result as contiguous copies."""
    g = torch.Generator(device="cuda").manual_seed(1)
    n, hq, hkv = 700, 32, 8
    qkv = torch.randn(n, (hq + 2 * hkv) * 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (x.unflatten(-1, (-1, 128)) for x in qkv.split([hq * 128, hkv * 128, hkv * 128], dim=-1))
    assert not q.is_contiguous() and not k.is_contiguous()
    out, lse = fc.fa4_cluster_forward(q, k, v)
    ref, ref_lse = fc.fa4_cluster_forward(q.contiguous(), k.contiguous(), v.contiguous())
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)


def test_info_names_the_attention_kernels_it_would_use(monkeypatch):
    from worldserve.commands import info

    monkeypatch.setattr(fa, "fa3_unavailable_reason", lambda *a: None)
    monkeypatch.setattr(fc, "fa4_cluster_unavailable_reason", lambda *a: "no tvm here")
    assert info.runtime(128)["attention"] == "FlashAttention-3 (the FA4 cluster kernel not used: no tvm here)"
    monkeypatch.setattr(fc, "fa4_cluster_unavailable_reason", lambda *a: None)
    assert (
        info.runtime(128)["attention"]
        == "FlashAttention-3, the gen tower FlashAttention-4 with 2-CTA clusters"
    )

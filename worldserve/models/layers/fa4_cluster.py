"""The gen tower's attention on Hopper: FlashAttention-4's forward with K/V tiles shared by 2-CTA clusters.

At 720p each gen layer's attention reads ~0.5 TB of K/V from L2 into shared memory, and on an H200 every
long kernel of a step runs at the board's 700 W cap. This kernel launches clusters of two CTAs on
neighbouring query tiles of one head; each CTA loads half of every K/V tile and the TMA multicasts it into
both, halving that traffic. Measured at the gen shape (bench/results/README.md, thirty-third session) it
runs at FA4's rate per clock at a 4-6 % higher capped clock: 676-685 vs FA3's 664-670 TF/s sustained on
two boards, the CFG step 1.4-1.6 % faster. The output is exact (FA4's numerics: rel. L2 1e-5 against FA3).

The kernel is FA4 (flash-attn-4 4.0.0b36, NVIDIA's CuTe Python DSL) with our patch
(bench/fa4_sm90_kv_multicast.patch), compiled ahead of time for sm_90a by bench/fa4_export.py into
`fa4_sm90/` beside this file: manifest.json and one TVM-FFI library per kernel (~65 kB; shapes dynamic).
Running it needs no DSL compiler, only `apache-tvm-ffi` and the DSL's runtime library
`libcute_dsl_runtime.so` (the `nvidia-cutlass-dsl-libs-cu13` wheel, or the file $WORLDSERVE_CUTE_DSL_RUNTIME
names); `pip install 'worldserve[hopper]'` brings both.

Same contract as `flash_attention.fa3_forward`: token-major q [Nq, Hq, D], k / v [Nk, Hkv, D] (bf16, d 128,
last dim contiguous), the output written into `out` when given, the softmax LSE [Hq, Nq] float32 beside
it; PyTorch's current stream. Token and head counts are runtime shapes, but the GQA ratio Hq / Hkv is
compiled in (4: Cosmos3's 32 / 8, also per Ulysses rank), and the kernel is non-causal: a causal call or
another ratio goes to FA3.
`transformer.set_attention_backend` gives it to the gen layers where the backend is chosen automatically
and it can run (the und tower, causal, keeps FA3); `--diffusion-attention-backend FLASH_ATTN` keeps FA3.
"Can run" includes a self-test against FA3 on each GPU, once (`self_test`): a driver or runtime that cannot
launch the sm_90a code leaves the model on FA3 with the reason, instead of failing requests.
While chats run beside a video (runner/chat_share.py raised FA3's SM margin), the calls go to FA3, which
leaves those SMs to the chats' high-priority stream. This kernel is not persistent, so chat kernels get SMs
as its CTAs retire, ~0.5 ms each: a 20-GEMM chain waited 7.3 ms beside it vs 1.3 ms beside FA3 with 16 SMs
free, and 8 chats decoded 3.4 tokens/s each beside a 720p step, 26 with FA3's margin
(bench/priority_probe.py, bench/chat_during_video.py; bench/results/README.md, thirty-fourth session).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from worldserve import envs
from worldserve.models.layers.flash_attention import fa3_forward, fa3_sm_margin, hopper_bf16_reason

KERNEL_DIR = Path(__file__).with_name("fa4_sm90")
GEN_KERNEL = "fa4_sm90_128x176_c2"
"""The gen tower's kernel: FA3's own 128 x 176 tile, clusters of 2 CTAs sharing K/V tiles."""
HEAD_DIM = 128
RUNTIME = "libcute_dsl_runtime.so"
RUNTIME_ENV = envs.CUTE_DSL_RUNTIME_ENV
INSTALL_HINT = "pip install 'worldserve[hopper]' (apache-tvm-ffi and nvidia-cutlass-dsl-libs-cu13)"
AGREEMENT = 1e-2
"""The largest rel. L2 of the output, and LSE difference, a kernel may show against FA3 (bf16 rounding: ~1e-3)."""

# Arguments after (q, k, v, out, lse, scale) of FA4's SM90 `__call__`: cu_seqlens_q / k, seqused_q / k,
# page_table, window_size_left / right, learnable_sink, blocksparse_tensors, aux_data (tensors, scalars),
# cu_total_m_blocks, cu_total_splits_m_blocks: all absent for dense non-causal attention.
_ABSENT = (None,) * 9 + ((None, None), None, None)


@dataclass(frozen=True)
class Fa4Kernel:
    """One exported kernel: its manifest entry and TVM-FFI function."""

    name: str
    spec: str
    qhead_per_kvhead: int
    """The GQA ratio compiled in (query heads per K/V head)."""
    fn: Any

    def runs(self, q: Tensor, k: Tensor, causal: bool) -> bool:
        """Whether this kernel computes attention of these shapes (non-causal, its GQA ratio)."""
        return not causal and q.shape[1] == self.qhead_per_kvhead * k.shape[1]

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
        out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """q [Nq, Hq, D], k / v [Nk, Hkv, D] -> (out [Nq, Hq, D], LSE [Hq, Nq] float32); non-causal."""
        import tvm_ffi

        if not self.runs(q, k, causal):
            raise ValueError(
                f"{self.name} is a non-causal kernel for {self.qhead_per_kvhead} query heads per K/V head; "
                f"got causal={causal}, {q.shape[1]} / {k.shape[1]} heads"
            )
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty(1, q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        with tvm_ffi.use_torch_stream():
            # [N, H, D] -> [1, N, H, D]: FA4's batch-major layout with one batch
            self.fn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse, scale, *_ABSENT)
        return out, lse[0]

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
        out: Tensor | None = None,
    ) -> Tensor:  # fmt: skip
        return self.forward(q, k, v, causal=causal, scale=scale, out=out)[0]


def runtime_library() -> Path | None:
    """The DSL runtime to load: $WORLDSERVE_CUTE_DSL_RUNTIME, else the installed nvidia-cutlass-dsl libs'."""
    if (lib := envs.cute_dsl_runtime()) is not None:
        return lib
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    roots = (spec.submodule_search_locations or ()) if spec is not None else ()
    for root in roots:
        for flavour in ("cu13", "cu12"):
            if (lib := Path(root) / flavour / "lib" / RUNTIME).exists():
                return lib
    return None


def load_kernels(folder: Path) -> dict[str, Fa4Kernel]:
    """Every kernel of `folder`'s manifest.json, by name, the DSL runtime loaded first (raises: ImportError
    without apache-tvm-ffi, FileNotFoundError without the runtime or a kernel, OSError / RuntimeError from
    a library that does not load)."""
    import tvm_ffi

    lib = runtime_library()
    if lib is None or not lib.exists():
        where = (
            f"${RUNTIME_ENV} = {lib}" if lib is not None else "nvidia-cutlass-dsl-libs-cu13 is not installed"
        )
        raise FileNotFoundError(f"the CuTe DSL runtime {RUNTIME} is missing ({where})")
    _load_global(str(lib))
    manifest = json.loads((folder / "manifest.json").read_text())
    kernels = {}
    for name, entry in manifest["kernels"].items():
        fn = tvm_ffi.load_module(str(folder / f"{name}.so"))[name]
        kernels[name] = Fa4Kernel(name, entry["spec"], entry["qhead_per_kvhead"], fn)
    return kernels


@cache
def _load_global(path: str) -> None:
    """dlopen the runtime with global symbols (the kernels' libraries resolve against it), once."""
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


@cache
def _gen_kernel() -> tuple[Fa4Kernel | None, str | None]:
    """(the gen kernel, None), or (None, why it does not load); loaded once."""
    try:
        return load_kernels(KERNEL_DIR)[GEN_KERNEL], None
    except ImportError:
        return None, f"apache-tvm-ffi is not installed: {INSTALL_HINT}"
    except Exception as e:  # a missing runtime / kernel file, or a library the loader refuses
        return None, f"{type(e).__name__}: {e} ({INSTALL_HINT})"


def fa4_cluster_unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the cluster kernel cannot run here (one line), or None when it can."""
    reason = hopper_bf16_reason("FlashAttention-4's cluster kernel", device, dtype, head_dim)
    if reason is not None:
        return reason
    if head_dim != HEAD_DIM:
        return f"FlashAttention-4's cluster kernel is compiled for head dim {HEAD_DIM}, not {head_dim}"
    kernel, reason = _gen_kernel()
    if kernel is None:
        return reason
    return _self_test(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _self_test(index: int) -> str | None:
    """`self_test` of the gen kernel on GPU `index`, once per GPU (asked only once the kernel loaded)."""
    kernel = _gen_kernel()[0]
    assert kernel is not None  # (fa4_cluster_unavailable_reason checks it first)
    return self_test(kernel, torch.device("cuda", index))


def self_test(kernel: Fa4Kernel, device: torch.device) -> str | None:
    """None when `kernel` runs on `device` and agrees with FA3 on a small problem (three query tiles, so one
    cluster holds a tile past the queries), else why not: a driver that cannot load its sm_90a code or a
    runtime that does not match it shows here, once, and the model keeps FA3 instead of failing a request."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(
        300, 4 * kernel.qhead_per_kvhead, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=g
    )
    k, v = (torch.randn(333, 4, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    try:
        err, lse_err = compare_with_fa3(kernel, q, k, v)
    except Exception as e:  # the launch itself failed (driver, runtime, kernel image)
        return f"FlashAttention-4's cluster kernel failed its self-test: {type(e).__name__}: {e}"
    if not (err < AGREEMENT and lse_err < AGREEMENT):
        return f"FlashAttention-4's cluster kernel disagrees with FA3 (rel. L2 {err:.1e}, LSE {lse_err:.1e})"
    return None


def compare_with_fa3(kernel: Fa4Kernel, q: Tensor, k: Tensor, v: Tensor) -> tuple[float, float]:
    """(rel. L2 of `kernel`'s output, largest LSE difference) against FA3's on q, k, v."""
    out, lse = kernel.forward(q, k, v)
    ref, ref_lse = fa3_forward(q, k, v)
    return float((out.float() - ref.float()).norm() / ref.float().norm()), float((lse - ref_lse).abs().max())


def fa4_cluster_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`fa3_forward`'s contract through the cluster kernel (a causal call, another GQA ratio, or any call while
    chats hold an SM margin, through FA3)."""
    kernel, reason = _gen_kernel()
    if kernel is None:
        raise RuntimeError(f"FlashAttention-4's cluster kernel cannot run: {reason}")
    if not kernel.runs(q, k, causal) or fa3_sm_margin():
        return fa3_forward(q, k, v, causal=causal, scale=scale, out=out)
    return kernel.forward(q, k, v, scale=scale, out=out)


def fa4_cluster_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
    out: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """q [Nq, Hq, D], k/v [Nk, Hkv, D] -> [Nq, Hq, D] (into `out` when given), as `fa3_attention`."""
    return fa4_cluster_forward(q, k, v, causal=causal, scale=scale, out=out)[0]

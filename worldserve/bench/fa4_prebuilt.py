"""FlashAttention-4 SM90 forward kernels compiled ahead of time (bench/fa4_export.py), loaded through TVM-FFI.

The GPU machine needs neither the CuTe DSL nor flash-attn-4 for these: only `apache-tvm-ffi` and the DSL's
runtime library, which bench/fa4_export.py writes beside the kernels (`libcute_dsl_runtime.so.xz`; this
module unpacks it once and loads it globally before the first kernel). Bench only: bench/attention_fa4.py
--prebuilt and bench/step_levers.py --fa4-prebuilt time these kernels against FA3, the product's kernel.

Same contract as `flash_attention.fa3_forward`: token-major q [Nq, Hq, D], k / v [Nk, Hkv, D] (bf16, last
dim contiguous), non-causal, the output written into `out` when given, the softmax LSE [Hq, Nq] float32
returned beside it. The kernel runs on PyTorch's current stream.
"""

from __future__ import annotations

import ctypes
import json
import lzma
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

RUNTIME = "libcute_dsl_runtime.so"
# Arguments after (q, k, v, out, lse, scale) of FA4's SM90 `__call__`: cu_seqlens_q / k, seqused_q / k,
# page_table, window_size_left / right, learnable_sink, blocksparse_tensors, aux_data (tensors, scalars),
# cu_total_m_blocks, cu_total_splits_m_blocks: all absent here (dense, non-causal, no score mod).
_ABSENT = (None,) * 9 + ((None, None), None, None)


@dataclass(frozen=True)
class PrebuiltFa4:
    """One exported kernel: its manifest entry and TVM-FFI function."""

    name: str
    spec: str
    cluster_m: int
    fn: Any

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
        out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """q [Nq, Hq, D], k / v [Nk, Hkv, D] -> (out [Nq, Hq, D], LSE [Hq, Nq] float32)."""
        import tvm_ffi

        if causal:
            raise ValueError(f"{self.name} is a non-causal kernel")
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


@cache
def _load_runtime(folder: Path) -> None:
    """Unpack the DSL runtime beside the kernels (once) and load it with global symbols for them."""
    lib = folder / RUNTIME
    if not lib.exists():
        packed = folder / f"{RUNTIME}.xz"
        if not packed.exists():
            raise FileNotFoundError(
                f"{folder} has neither {RUNTIME} nor {RUNTIME}.xz (bench/fa4_export.py writes it)"
            )
        lib.write_bytes(lzma.decompress(packed.read_bytes()))
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def load_prebuilt(folder: Path) -> dict[str, PrebuiltFa4]:
    """Every kernel of `folder`'s manifest.json, by name (ImportError without apache-tvm-ffi)."""
    import tvm_ffi

    manifest = json.loads((folder / "manifest.json").read_text())
    _load_runtime(folder.resolve())
    kernels = {}
    for name, entry in manifest["kernels"].items():
        fn = tvm_ffi.load_module(str(folder / f"{name}.so"))[name]
        kernels[name] = PrebuiltFa4(name, entry["spec"], entry["cluster_m"], fn)
    return kernels


def prebuilt_unavailable_reason(folder: Path | None) -> str | None:
    """Why prebuilt kernels cannot run here (one line), or None when they can."""
    from worldserve.models.layers.flash_attention import hopper_bf16_reason

    if folder is None:
        return "no --prebuilt folder given"
    reason = hopper_bf16_reason("FlashAttention-4 (prebuilt)", torch.device("cuda"), torch.bfloat16, 128)
    if reason is not None:
        return reason
    if not (folder / "manifest.json").exists():
        return f"{folder}/manifest.json is missing (bench/fa4_export.py writes it)"
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return "apache-tvm-ffi is not installed (bench/fa4_export.py --tvm-ffi-wheel copies its wheel)"
    return None

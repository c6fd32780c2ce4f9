"""FlashAttention-3 (Hopper) forward, bf16 and fp8, through an optional package; the attention backend choice.

FA3 is the fastest exact attention kernel on H100/H200 at the tower's shapes (head dim 128, GQA 32/8,
~44k tokens; performance.md §3: cuDNN SDPA reaches ~570-610 TF/s there, FA3 ~650+). PyTorch does not ship
it, so it comes from an optional wheel: `fa3-fwd` (forward-only FA3 built on the torch stable ABI, module
`fa3_fwd_interface`; `pip install 'worldserve[hopper]'`) or an upstream FlashAttention-3 build (module
`flash_attn_interface`). Both take token-major [B, N, H, D] tensors, the layout our projections produce,
do GQA natively and align a causal mask to the bottom right (query i of Nq sees keys <= Nk - Nq + i), as
`attention.sdpa_attention` does, so the backends are interchangeable.

`fa3_fp8_attention` is the lossy opt-in path (`--quantization fp8`): q, k, v are cast to e4m3 with one
amax scale per tensor (computed on the device, no host sync) and FA3's fp8 kernel un-scales them
(`*_descale`); the output stays bf16.

Backends (`--diffusion-attention-backend`, env `DIFFUSION_ATTENTION_BACKEND`, vLLM-Omni's names):
- None / "auto": FA3 where it can run (CUDA sm90, bf16, head dim <= 256, package importable), else SDPA;
  the transformer then gives its gen tower FA4's cluster kernel where that runs (fa4_cluster.py).
- "FLASH_ATTN": FA3 (both towers), and an error naming the fix where it cannot run.
- "TORCH_SDPA" / "CUDNN_ATTN": PyTorch SDPA (`attention.sdpa_attention`: cuDNN first for the gen tower's
  fixed shapes, flash first for causal calls; the ViT takes `any_shape_sdpa_attention`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from worldserve.models.layers.attention import sdpa_attention

AttentionFn = Callable[..., Tensor]
"""(q [Nq, Hq, D], k [Nk, Hkv, D], v [Nk, Hkv, D], *, causal=False, scale=None, out=None) -> [Nq, Hq, D];
with `out` ([Nq, Hq, D]) the result lands there (the gen layers pass their workspace rows)."""

LseAttentionFn = Callable[..., tuple[Tensor, Tensor]]
"""An AttentionFn that also gives the softmax LSE: (q, k, v, ...) -> (out [Nq, Hq, D], LSE [Hq, Nq] float32),
as `fa3_forward` (the first gen layer merges attentions by their LSEs: gen_attention.twin_attention)."""

BACKENDS = ("FLASH_ATTN", "TORCH_SDPA", "CUDNN_ATTN")
"""Accepted `--diffusion-attention-backend` values (None means auto)."""

FA3_MODULES = ("fa3_fwd_interface", "flash_attn_interface")
"""Importable FA3 front ends, in order of preference (`fa3_forward` calls their compiled `fwd` op)."""

FA3_INSTALL_HINT = (
    "pip install 'worldserve[hopper]' (the fa3-fwd wheel: FlashAttention-3 forward for torch/CUDA 13)"
)

E4M3_MAX = 448.0
FA3_FWD_ARGS = 34
"""Arguments of FA3's compiled `fwd` op as fa3-fwd 0.0.3 (and the upstream FA3 it packages) declares it."""


@cache
def _fa3_import() -> tuple[ModuleType | None, str]:
    """(the first importable FA3 front end, or None; why none imported: each module's error)."""
    errors = []
    for name in FA3_MODULES:
        try:
            return importlib.import_module(name), ""
        except ModuleNotFoundError as e:
            if e.name != name.split(".")[0]:  # (a module it imports is missing: a broken install)
                errors.append(f"{name}: {e}")
        except Exception as e:  # an OSError / RuntimeError from a mismatched binary
            errors.append(f"{name}: {type(e).__name__}: {e}")
    return None, "; ".join(errors)


def fa3_module() -> ModuleType | None:
    """The first importable FA3 front end, or None (never raises: a broken install reads as absent, and
    fa3_unavailable_reason says why)."""
    return _fa3_import()[0]


def hopper_bf16_reason(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why a Hopper-only bf16 attention kernel (named `kernel` in the line) cannot run on this device, dtype
    and head dim, or None when those allow it (whether its package imports is the caller's check)."""
    if device.type != "cuda":
        return f"{kernel} needs an NVIDIA Hopper GPU; the model is on {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"{kernel} runs on compute capability 9.0 (H100/H200); {device} is {major}.{minor}"
    if dtype != torch.bfloat16:
        return f"{kernel} runs in bfloat16; the model is {dtype}"
    if head_dim > 256 or head_dim % 8:
        return f"{kernel} needs head_dim <= 256 and a multiple of 8, got {head_dim}"
    return None


def fa3_unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FA3 cannot run here (one line), or None when it can."""
    reason = hopper_bf16_reason("FlashAttention-3", device, dtype, head_dim)
    if reason is not None:
        return reason
    mod = fa3_module()
    errors = _fa3_import()[1] if mod is None else ""
    if errors:  # installed, but it does not import
        return f"the FlashAttention-3 package does not import ({errors}): {FA3_INSTALL_HINT}"
    if mod is None:
        return f"no FlashAttention-3 package is importable ({' / '.join(FA3_MODULES)}): {FA3_INSTALL_HINT}"
    schema = getattr(getattr(getattr(_fwd_ops(mod), "fwd", None), "default", None), "_schema", None)
    if schema is None or len(schema.arguments) != FA3_FWD_ARGS:
        return (
            f"{mod.__name__}'s compiled fwd op is not the {FA3_FWD_ARGS}-argument one fa3_forward calls: "
            f"{FA3_INSTALL_HINT}"
        )
    return None


def _fwd_ops(mod: ModuleType) -> Any:
    """The front end's namespace of compiled ops (fa3-fwd's `fa3_fwd_cuda`, upstream's `flash_attn_3_cuda`)."""
    return getattr(mod, "fa3_fwd_cuda", None) or getattr(mod, "flash_attn_3_cuda", None)


_sm_margin = 0  # SMs FA3 leaves free for other streams (runner/chat_share.py sets it while chats run)


def set_fa3_sm_margin(margin: int) -> None:
    """Leave `margin` SMs free in the following FA3 calls (its persistent kernels otherwise take them all)."""
    global _sm_margin
    _sm_margin = int(margin)


def fa3_sm_margin() -> int:
    """The SMs FA3 calls leave free now (0: none; runner/chat_share.py raises it while chats run)."""
    return _sm_margin


def fa3_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
    out: Tensor | None = None, descale: tuple[Tensor | None, ...] = (None, None, None),
    pack_gqa: bool | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One FA3 forward: q [Nq, Hq, D], k/v [Nk, Hkv, D] token-major, last dim contiguous -> (out [Nq, Hq, D],
    softmax LSE [Hq, Nq] float32). With `out` ([Nq, Hq, D], contiguous, bf16) the kernel stores its result
    there itself: no copy after it. `descale`: the fp8 inputs' (q, k, v) scales, [1, Hkv] float32 each.
    `pack_gqa`: whether a query tile packs the Hq / Hkv query heads that share a KV head (each K/V tile
    then loaded once for all of them); None lets FA3 choose (what the product runs).

    Calls the front end's compiled op (`fwd`, what its Python wrappers call) directly: the wrappers either
    take no output buffer (`flash_attn_func`) or are a torch custom op that refuses to return a tensor it
    was given (`_flash_attn_forward`). The argument list is FA3's `fwd` schema as of fa3-fwd 0.0.3 (the
    `worldserve[hopper]` pin) and the upstream FA3 it packages."""
    mod = fa3_module()
    if mod is None:  # (the backend is chosen only where it imports: fa3_unavailable_reason)
        raise RuntimeError(f"no FlashAttention-3 package is importable: {FA3_INSTALL_HINT}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    res = _fwd_ops(mod).fwd(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
        None, None, None,  # k_new, v_new, qv
        None if out is None else out.unsqueeze(0),
        *(None,) * 13,  # cu_seqlens_q / k / k_new, seqused_q / k, max_seqlen_q / k, page_table,
        # kv_batch_idx, leftpad_k, rotary_cos / sin, seqlens_rotary
        *descale, scale, causal,
        -1, -1, 0, 0.0, True,  # window_size_left / right, attention_chunk, softcap, rotary_interleaved
        None, 1, pack_gqa, _sm_margin,  # scheduler_metadata, num_splits, pack_gqa, sm_margin
    )  # fmt: skip
    return res[0].squeeze(0), res[1].squeeze(0)  # [1, Nq, Hq, D] -> [Nq, Hq, D]; [1, Hq, Nq] -> [Hq, Nq]


def fa3_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
    out: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """q [Nq, Hq, D], k/v [Nk, Hkv, D] (bf16, CUDA sm90) -> [Nq, Hq, D] through FlashAttention-3, written
    into `out` when given."""
    return fa3_forward(q, k, v, causal=causal, scale=scale, out=out)[0]


def quantize_e4m3_per_tensor(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (any float) -> (x / s as e4m3, s [] fp32) with s = amax / 448, computed on the device."""
    s = (x.abs().amax().float() / E4M3_MAX).clamp_min(1e-12)
    return (x / s).to(torch.float8_e4m3fn), s


def fa3_fp8_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
    out: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """fa3_attention with q, k, v in e4m3 (one scale each); bf16 output (into `out` when given), returned
    in q's dtype. Lossy: the fp8 mode only."""
    hkv = k.shape[1]
    q8, sq = quantize_e4m3_per_tensor(q)
    k8, sk = quantize_e4m3_per_tensor(k)
    v8, sv = quantize_e4m3_per_tensor(v)
    descale = tuple(s.reshape(1, 1).expand(1, hkv) for s in (sq, sk, sv))  # FA3 wants [B, Hkv] fp32
    if out is None:
        out = q.new_empty(q.shape, dtype=torch.bfloat16)  # FA3's fp8 kernel writes bf16
    return fa3_forward(q8, k8, v8, causal=causal, scale=scale, out=out, descale=descale)[0].to(q.dtype)


def resolve_attention_backend(
    name: str | None, device: torch.device, dtype: torch.dtype, head_dim: int
) -> tuple[str, AttentionFn]:
    """(label, attention function) for `--diffusion-attention-backend name` on this device and dtype.

    ValueError when FLASH_ATTN is asked for and cannot run, or the name is unknown."""
    key = (name or "auto").upper()
    if key in ("TORCH_SDPA", "CUDNN_ATTN"):
        return "sdpa", sdpa_attention
    if key not in ("AUTO", "FLASH_ATTN"):
        raise ValueError(f"--diffusion-attention-backend must be one of {BACKENDS} or auto, got {name!r}")
    reason = fa3_unavailable_reason(device, dtype, head_dim)
    if reason is None:
        return "fa3", fa3_attention
    if key == "FLASH_ATTN":
        raise ValueError(f"--diffusion-attention-backend FLASH_ATTN: {reason}")
    return "sdpa", sdpa_attention

"""FlashAttention-4 (the CuTe-DSL FlashAttention, `flash-attn-4`) forward on Hopper with a chosen tile: bench only.

FA3's prebuilt wheel fixes its tile per head dim (128 x 176 at d = 128, non-causal); FA4 is written in
NVIDIA's CuTe Python DSL and compiled on first use (~2 s) for the tile, the P @ V operand source (registers
or shared memory) and the intra-warpgroup overlap it is given. `bench/attention_fa4.py` searches those at
the gen tower's shape and `bench/step_levers.py --variants fa4` runs a whole step on the winner: measured on
an H200 (bench/results/README.md, seventh session) the best FA4 tile is FA3's own 128 x 176 at FA3's speed
(49.3 vs 49.7 ms a call, within noise) and the step is 1 % slower, so this wrapper lives with the
benchmarks. What did pay is FA4 with K/V tiles shared by 2-CTA clusters (thirty-third session), which
the product runs precompiled: `models/layers/fa4_cluster.py`.

Same contract as `flash_attention.fa3_forward`: token-major [N, H, D] tensors, GQA native, causal aligned
bottom right, the output written into `out`, the softmax LSE [Hq, Nq] float32 returned beside it. The call
goes to `flash_attn.cute.interface._flash_attn_fwd`, the one entry point that takes an output buffer and
the tile; it is private, so `fa4_unavailable_reason` checks that the keywords passed are still there
(written against flash-attn-4 4.0.0b36 with nvidia-cutlass-dsl 4.8.1).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch
from torch import Tensor

from worldserve.models.layers.flash_attention import hopper_bf16_reason

FA4_MODULE = "flash_attn.cute.interface"
FA4_INSTALL_HINT = "pip install flash-attn-4==4.0.0b36 (FlashAttention's CuTe-DSL kernels, JIT-compiled)"


@dataclass(frozen=True)
class Fa4Config:
    """One FA4 Hopper forward kernel: tile [tile_m query rows x tile_n keys], P @ V with P from registers
    (`mma_pv_is_rs`) or shared memory, softmax of one K block overlapped with the next block's Q @ K^T
    (`intra_wg_overlap`), the GQA query heads of one K/V head packed into one tile (`pack_gqa`, None: FA4
    decides), `num_threads` = 128 x (1 producer + tile_m / 64 consumer warpgroups)."""

    tile_m: int = 128
    tile_n: int = 128
    mma_pv_is_rs: bool = True
    intra_wg_overlap: bool = True
    pack_gqa: bool | None = None

    @property
    def num_threads(self) -> int:
        return 128 * (1 + self.tile_m // 64)

    @property
    def spec(self) -> str:
        """`TMxTN-{rs|ss}-{ovl|noovl}-gqa{auto|on|off}`, e.g. 128x176-rs-ovl-gqaauto (`parse` reads it)."""
        gqa = {None: "auto", True: "on", False: "off"}[self.pack_gqa]
        rs, ovl = "rs" if self.mma_pv_is_rs else "ss", "ovl" if self.intra_wg_overlap else "noovl"
        return f"{self.tile_m}x{self.tile_n}-{rs}-{ovl}-gqa{gqa}"

    @classmethod
    def parse(cls, spec: str) -> Fa4Config:
        """The config `spec` names (ValueError naming the expected form otherwise)."""
        try:
            tile, rs, ovl, gqa = spec.strip().lower().split("-")
            m, n = (int(x) for x in tile.split("x"))
            if rs not in ("rs", "ss") or ovl not in ("ovl", "noovl"):
                raise ValueError
            pack = {"gqaauto": None, "gqaon": True, "gqaoff": False}[gqa]
        except (ValueError, KeyError):
            raise ValueError(f"FA4 config must look like 128x176-rs-ovl-gqaauto, got {spec!r}") from None
        if m % 64 or n % 16 or not (64 <= m <= 192 and 16 <= n <= 256):
            raise ValueError(f"FA4 tile must be 64-192 rows (x64) by 16-256 keys (x16), got {m}x{n}")
        return cls(m, n, rs == "rs", ovl == "ovl", pack)


DEFAULT_FA4_CONFIG = Fa4Config()
_config = DEFAULT_FA4_CONFIG
_FWD_KEYWORDS = (
    "out",
    "return_lse",
    "tile_mn",
    "mma_pv_is_rs",
    "intra_wg_overlap",
    "num_threads",
    "pack_gqa",
)


def set_fa4_config(config: Fa4Config) -> None:
    """Use `config` for the following FA4 forwards (the benchmark's tile search sets it)."""
    global _config
    _config = config


@cache
def fa4_module() -> ModuleType | None:
    """FA4's interface module, or None when not importable (never raises: a broken install reads as absent)."""
    try:
        return importlib.import_module(FA4_MODULE)
    except Exception:  # ImportError, or an OSError / RuntimeError from the DSL's native libraries
        return None


def fa4_unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FA4 cannot run here (one line), or None when it can."""
    reason = hopper_bf16_reason("FlashAttention-4", device, dtype, head_dim)
    if reason is not None:
        return reason
    mod = fa4_module()
    if mod is None:
        return f"{FA4_MODULE} is not importable: {FA4_INSTALL_HINT}"
    params = inspect.signature(getattr(mod, "_flash_attn_fwd", lambda: None)).parameters
    missing = [k for k in _FWD_KEYWORDS if k not in params]
    if missing:
        return f"{FA4_MODULE}._flash_attn_fwd lacks {', '.join(missing)}: {FA4_INSTALL_HINT}"
    return None


def fa4_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One FA4 forward: q [Nq, Hq, D], k/v [Nk, Hkv, D] token-major, last dim contiguous -> (out [Nq, Hq, D],
    softmax LSE [Hq, Nq] float32), with the current `Fa4Config`. With `out` the kernel writes there."""
    cfg, mod = _config, fa4_module()
    if mod is None:  # (the caller skipped fa4_unavailable_reason: `bench/step_levers.py --variants fa4`)
        raise RuntimeError(f"{FA4_MODULE} is not importable: {FA4_INSTALL_HINT}")
    res = mod._flash_attn_fwd(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),  # [N, H, D] -> [1, N, H, D]
        softmax_scale=scale, causal=causal, out=None if out is None else out.unsqueeze(0),
        return_lse=True, tile_mn=(cfg.tile_m, cfg.tile_n), mma_pv_is_rs=cfg.mma_pv_is_rs,
        intra_wg_overlap=cfg.intra_wg_overlap, num_threads=cfg.num_threads, pack_gqa=cfg.pack_gqa,
    )  # fmt: skip
    return res[0].squeeze(0), res[1].squeeze(0)  # [1, Nq, Hq, D] -> [Nq, Hq, D]; [1, Hq, Nq] -> [Hq, Nq]


def fa4_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
    out: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """q [Nq, Hq, D], k/v [Nk, Hkv, D] (bf16, CUDA sm90) -> [Nq, Hq, D] through FlashAttention-4, written
    into `out` when given."""
    return fa4_forward(q, k, v, causal=causal, scale=scale, out=out)[0]

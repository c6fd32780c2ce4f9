"""The one attention entry point (scaled dot-product, GQA) and the contiguous per-sequence K/V cache.

`sdpa_attention(q, k, v, causal=...)` takes token-major tensors, q [Nq, Hq, D] and k/v [Nk, Hkv, D] with Hq a
multiple of Hkv, and returns [Nq, Hq, D]. It runs `F.scaled_dot_product_attention` with `enable_gqa` (no K/V
repeat). On CPU the math kernel runs. On CUDA the backend priority depends on whether the call's shapes
repeat: cuDNN builds an execution graph for every new (Nq, Nk), 46-790 ms on an H200
(bench/sdpa_new_shapes.py) where flash starts at once and runs as fast. So the gen tower's calls (non-causal:
the same shapes over every step of a request: a graph build per request for each CFG branch's prompt length,
~40 ms against minutes of steps, for a kernel 1.6-1.7x PyTorch's flash, FA2, at those lengths: 55 vs 89 ms a
720p call on an H200, bench/sdpa_new_shapes.py, performance.md §3) keep cuDNN first, while causal calls (the
und tower's prefill: any prompt length over any cached prefix) and `any_shape_sdpa_attention` (the ViT: an
item's length is its image's size) put flash first (prompts are short enough for FA2's attention to cost less
than a graph build): without FlashAttention-3 every chat had paid a graph build, a cached prefix's chat
~0.2-1.3 s of its first token. (`flash_attention.py` holds the FlashAttention-3 alternative with the same
signature and semantics, and the choice between them.) A causal call with Nq < Nk (chunked prefill, a cached
prefix) aligns the mask to the bottom right: query i of the new chunk sees keys [0, Nk - Nq + i], through
torch's lower-right CausalBias (flash takes it without a mask tensor; a boolean mask would send the call to
cuDNN or the math kernel). Nothing here reads device values on the host, so it stays capturable in CUDA graphs
(torch.compile runs no attention: dynamo cannot build a CausalBias inside a graph).

`ContiguousKVCache` holds one sequence's K/V for every layer, post-norm and post-RoPE, in one
[layers, capacity, Hkv, D] buffer per K and V. Its `length` is host metadata. The und step writes a chunk
with `write(layer, k, v)` in every layer and then calls `advance(n)` once. A paged cache can replace
it behind the same `KVCache` protocol.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias, causal_lower_right

CUDA_SDPA_PRIORITY = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
"""Shapes that repeat (the gen tower's): cuDNN first, the fastest Hopper SDPA kernel at the tower's shapes
(performance.md §4), accepting unequal q/kv head counts; flash also does GQA; mem-efficient declines GQA;
math always works."""

ANY_SHAPE_PRIORITY = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.MATH,
]
"""Shapes that change from call to call (a prompt's length, a cached prefix, an image's size): flash first, as
fast as cuDNN there with no per-shape graph build (the module docstring)."""


_CAUSAL_BIAS_TAKES_GQA = "enable_gqa" in inspect.signature(CausalBias._dispatch).parameters
"""Whether torch's CausalBias passes `enable_gqa` on (its flash kernel then reads the KV heads in place, no
copy); otherwise a lower-right call repeats the K/V heads."""


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
    out: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """q [Nq, Hq, D], k/v [Nk, Hkv, D] -> [Nq, Hq, D]; unmasked, or causal aligned at the bottom right.
    With `out` ([Nq, Hq, D]) the result is copied there and `out` returned (FA3 writes it directly).
    On CUDA: causal calls flash first, the others cuDNN first (the module docstring)."""
    priority = ANY_SHAPE_PRIORITY if causal else CUDA_SDPA_PRIORITY
    return _sdpa(q, k, v, causal=causal, scale=scale, out=out, priority=priority)


def any_shape_sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
    out: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """sdpa_attention with flash first for every call: for callers whose shapes change from call to call
    (the ViT)."""
    return _sdpa(q, k, v, causal=causal, scale=scale, out=out, priority=ANY_SHAPE_PRIORITY)


def _sdpa(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float | None, out: Tensor | None,
    priority: list[SDPBackend],
) -> Tensor:  # fmt: skip
    nq, nk = q.shape[0], k.shape[0]
    # SDPA wants [B, H, N, D]; these are strided views of the token-major tensors.
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, Nq, D]
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Nk, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[1]
    options: dict = {"is_causal": causal and nq > 1, "enable_gqa": gqa}
    if causal and 1 < nq != nk:  # lower right: query i sees keys [0, Nk - Nq + i]
        options = {"attn_mask": _lower_right(nq, nk)}
        if _CAUSAL_BIAS_TAKES_GQA:
            options["enable_gqa"] = gqa
        elif gqa:  # (K/V heads repeated, as the math kernel does)
            kh = kh.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [1, Hq, Nk, D]
            vh = vh.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    if q.device.type == "cuda":
        with sdpa_kernel(priority, set_priority=True):
            out_h = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, **options)
    else:
        out_h = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, **options)
    res = out_h.squeeze(0).transpose(0, 1)  # [Nq, Hq, D]
    return res if out is None else out.copy_(res)


@lru_cache(maxsize=8)
def _lower_right(nq: int, nk: int) -> CausalBias:
    """torch's lower-right CausalBias for (Nq, Nk), one per shape for a pass's layers: the object is a tensor
    subclass that allocates (uninitialised, never read) 2 x Nq x Nk float32 of host memory, 0.5 GB for a
    2k-token chunk over 32k cached tokens, which every layer had allocated again."""
    return causal_lower_right(nq, nk)


class KVCache(Protocol):
    """What the und step needs from a per-sequence cache (contiguous now, paged later)."""

    @property
    def length(self) -> int: ...

    def reserve(self, num_new: int) -> None: ...

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def kv(self, layer: int) -> tuple[Tensor, Tensor]: ...

    def advance(self, num_new: int) -> None: ...


class ContiguousKVCache:
    """K/V of one sequence for all layers: [layers, capacity, Hkv, D] buffers + a host-side length."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self._length = 0

    @property
    def length(self) -> int:
        """Tokens whose K/V are committed (host int; never read from the device)."""
        return self._length

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def reserve(self, num_new: int) -> None:
        """Make room for `num_new` more tokens (reallocates at least 2x when it must grow)."""
        need = self._length + num_new
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], new_cap, *old.shape[2:]))
            new[:, : self._length] = old[:, : self._length]
            setattr(self, name, new)

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k/v [n, Hkv, D] after the committed tokens; return this layer's K/V [length + n, Hkv, D]."""
        end = self._length + k.shape[0]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} > capacity {self.capacity}; call reserve() first")
        self.k[layer, self._length : end] = k
        self.v[layer, self._length : end] = v
        return self.k[layer, :end], self.v[layer, :end]

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """Committed K/V of one layer: [length, Hkv, D] views."""
        return self.k[layer, : self._length], self.v[layer, : self._length]

    def advance(self, num_new: int) -> None:
        """Commit the chunk written by the last `write` of every layer."""
        if self._length + num_new > self.capacity:
            raise RuntimeError("advance past capacity")
        self._length += num_new

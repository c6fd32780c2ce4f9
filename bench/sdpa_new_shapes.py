"""What a new query / key length costs the SDPA fallback (no FlashAttention-3) on its first call, and what each
backend order costs once running: the numbers behind attention.sdpa_attention's choice (flash first for
causal calls and the ViT, cuDNN first for the gen tower). bf16, token-major views as the towers pass them.

Three tables, each a variant's first call on a shape not seen before and its best later call (ms):
1. causal, one Nano und layer's heads (32 query, 8 KV, head dim 128): the Reasoner's prefill over a cached
   prefix (Nq < Nk, bottom-right aligned) and over a whole prompt (Nq == Nk). "cuDNN first" is how causal
   calls ran until the forty-fourth session (cuDNN first, a boolean mask when Nq != Nk), "product" is
   attention.sdpa_attention now (flash first, torch's lower-right CausalBias);
2. non-causal, the ViT's heads (16 heads of 72): one item per image size (a 720p image is 3,600 patches).
   "cuDNN first" as the ViT ran before, "product" is any_shape_sdpa_attention;
3. the gen tower (720p x 189 + audio: 44,160 gen tokens over a CFG branch's prompt K/V, 300 and 220 tokens;
   performance.md's shape): "product" (cuDNN first, as the gen layers run it) against flash first: whether
   cuDNN's rate there is worth a graph build per branch per request.

Measured on an H200 before the change (`sdpa-new-shapes-20261205-h200.log`; that first version of this
script had table 1 only, "lower-right bias" being the product's math today): cuDNN first 46-790 ms on a new
shape's first call, flash 0.2-15 ms; later calls 0.12-0.21 ms for both.

    PYTHONPATH=. python3 bench/sdpa_new_shapes.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from worldserve.models.layers.attention import (
    ANY_SHAPE_PRIORITY,
    CUDA_SDPA_PRIORITY,
    any_shape_sdpa_attention,
    sdpa_attention,
)

Attention = Callable[[Tensor, Tensor, Tensor], Tensor]


def timed(fn: Attention, *args: Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def ordered(priority: list, causal: bool) -> Attention:
    """SDPA with `priority`, a boolean mask for a bottom-right causal call (as the product ran before)."""

    def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        nq, nk = q.shape[0], k.shape[0]
        mask = None
        if causal and nq != nk:
            mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, N, D]
        with sdpa_kernel(priority, set_priority=True):
            return F.scaled_dot_product_attention(
                qh,
                kh,
                vh,
                attn_mask=mask,
                is_causal=causal and mask is None,
                enable_gqa=q.shape[1] != k.shape[1],
            )

    return fn


def table(title: str, variants: dict[str, Attention], shapes: list[tuple[int, int]],
          heads: tuple[int, int, int]) -> None:  # fmt: skip
    """Each variant over `shapes` (Nq, Nk) with (query heads, KV heads, head dim): first and later ms."""
    hq, hkv, d = heads
    print(f"\n{title}\n{'variant':14} {'Nq':>6} {'Nk':>6} {'first ms':>9} {'again ms':>9}")
    for name, fn in variants.items():
        for i, (nq, nk) in enumerate([(7, 77), *shapes]):  # (the first warms the variant's libraries up)
            q = torch.randn(nq, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(nk, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(nk, hkv, d, device="cuda", dtype=torch.bfloat16)
            once = timed(fn, q, k, v)
            again = min(timed(fn, q, k, v) for _ in range(3))
            if i:
                print(f"{name:14} {nq:6d} {nk:6d} {once:9.2f} {again:9.3f}")


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    q, k, v = (
        torch.randn(n, h, 128, device="cuda", dtype=torch.bfloat16) for n, h in ((33, 32), (929, 8), (929, 8))
    )
    before = ordered(CUDA_SDPA_PRIORITY, causal=True)(q, k, v).squeeze(0).transpose(0, 1)
    print("max |product - cuDNN first|, a cached prefix (a shape the tables do not time):", (sdpa_attention(q, k, v, causal=True) - before).abs().max().item())  # fmt: skip
    table("1. causal (the und tower's prefill)",
          {"cuDNN first": ordered(CUDA_SDPA_PRIORITY, causal=True),
           "product": lambda q, k, v: sdpa_attention(q, k, v, causal=True)},
          [(34, 930), (35, 931), (50, 2000), (16, 300), (930, 930), (931, 931), (1500, 1500)], (32, 8, 128))  # fmt: skip
    table("2. non-causal, the ViT (one item per image size)",
          {"cuDNN first": ordered(CUDA_SDPA_PRIORITY, causal=False), "product": any_shape_sdpa_attention},
          [(3600, 3600), (920, 920), (1564, 1564), (3608, 3608)], (16, 16, 72))  # fmt: skip
    table(  # (the two CFG branches: prompts of 300 and 220 tokens)
        "3. the gen tower (non-causal, its shapes repeat over a request's steps)",
        {"product": sdpa_attention, "flash first": ordered(ANY_SHAPE_PRIORITY, causal=False)},
        [(44160, 44460), (44160, 44380)],
        (32, 8, 128),
    )


if __name__ == "__main__":
    main()

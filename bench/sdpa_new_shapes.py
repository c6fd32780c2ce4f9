"""What a new query / key length costs the SDPA fallback (no FlashAttention-3) on its first call: the
Reasoner's prefill over a cached prefix (causal, aligned at the bottom right) and over a whole prompt, one
Nano und layer's heads (32 query, 8 KV, head dim 128), bf16, token-major views as the towers pass them.

For each (Nq, Nk) not seen before, the first call's and the best later call's milliseconds of:
- "cuDNN first": how attention.sdpa_attention ran causal calls until the forty-fourth session (cuDNN first,
  a boolean mask when Nq != Nk): cuDNN builds an execution graph for every new shape;
- "product": attention.sdpa_attention now (flash first for causal calls, torch's lower-right CausalBias).

Measured on an H200 before the change (`sdpa-new-shapes-20261205-h200.log`, where "lower-right bias" is the
product's math today): cuDNN first 46-790 ms on a new shape's first call, flash 0.2-15 ms; later calls
0.12-0.21 ms for both.

    PYTHONPATH=. python3 bench/sdpa_new_shapes.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention import sdpa_kernel

from worldserve.models.layers.attention import CUDA_SDPA_PRIORITY, sdpa_attention

HQ, HKV, D = 32, 8, 128


def timed(fn, *args) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def cudnn_first(q, k, v):
    """The causal calls as they ran before: cuDNN first, an explicit mask when Nq != Nk."""
    nq, nk = q.shape[0], k.shape[0]
    mask = None if nq == nk else torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, N, D]
    with sdpa_kernel(CUDA_SDPA_PRIORITY, set_priority=True):
        return F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version())
    shapes = [(34, 930), (35, 931), (50, 2000), (16, 300), (930, 930), (931, 931), (1500, 1500)]
    rows = []
    for variant, fn in (("cuDNN first", cudnn_first),
                        ("product", lambda q, k, v: sdpa_attention(q, k, v, causal=True))):  # fmt: skip
        for i, (nq, nk) in enumerate([(7, 77), *shapes]):  # (the first warms the variant's libraries up)
            q = torch.randn(nq, HQ, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(nk, HKV, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(nk, HKV, D, device="cuda", dtype=torch.bfloat16)
            first = timed(fn, q, k, v)
            again = min(timed(fn, q, k, v) for _ in range(3))
            if i:
                rows.append((variant, nq, nk, first, again))
    with torch.no_grad():  # the two agree (lower-right causal)
        q = torch.randn(34, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(930, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(930, HKV, D, device="cuda", dtype=torch.bfloat16)
        a = sdpa_attention(q, k, v, causal=True).float()
        b = cudnn_first(q, k, v).squeeze(0).transpose(0, 1).float()
        print("max |product - cuDNN first|", (a - b).abs().max().item())
    print(f"{'variant':18} {'Nq':>5} {'Nk':>5} {'first ms':>9} {'again ms':>9}")
    for variant, nq, nk, first, again in rows:
        print(f"{variant:18} {nq:5d} {nk:5d} {first:9.2f} {again:9.3f}")


if __name__ == "__main__":
    main()

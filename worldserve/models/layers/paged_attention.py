"""Decode attention over a paged K/V pool: one new query token per sequence, GQA, no host syncs.

`paged_decode_attention(q, k_pool, v_pool, block_table, seq_lens)`:
  q [B, Hq, D]; k_pool / v_pool [num_blocks, block_size, Hkv, D] (one layer of models/layers/paged_kv.py);
  block_table [B, max_blocks] int32 (row b: sequence b's block ids, unused entries any valid id);
  seq_lens [B] int32 (keys of sequence b, the new token's included) -> [B, Hq, D].
Query head h reads KV head h // (Hq / Hkv), as SDPA's enable_gqa does. The decode step is memory-bound (the
K/V of every sequence are read once), so the kernel's job is to read only the blocks a sequence uses and to
spread long sequences over the SMs: it is split-K ("flash-decoding"). Program (b, kv head, split s) walks
blocks [s * SPLIT_BLOCKS, (s + 1) * SPLIT_BLOCKS) of sequence b for the Hq / Hkv query heads of that KV head
with an online softmax, and writes a partial output and its log-sum-exp; `_combine` merges the splits (empty
splits carry lse = -inf). Shapes and the split count depend only on B and max_blocks, never on the lengths,
so one CUDA graph per batch size serves every context length (runner/und_decoder.py).

On CUDA with Triton the kernel runs; elsewhere (CPU tests, or no Triton) `paged_decode_attention_reference`,
the plain torch version (gather the whole table width, mask past seq_len, fp32 softmax) that also serves as
the tests' oracle.
"""

from __future__ import annotations

import math
from functools import cache

import torch
from torch import Tensor

SPLIT_BLOCKS = 16
"""Blocks one program walks (1,024 tokens at the default block size 64)."""


def paged_decode_attention_reference(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float | None = None,
) -> Tensor:
    """The torch version: [B, Hq, D] from the whole table width, masked past each sequence's length."""
    b, hq, d = q.shape
    hkv = k_pool.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    table = block_table.long()
    k = k_pool[table].flatten(1, 2).float()  # [B, max_blocks * block_size, Hkv, D]
    v = v_pool[table].flatten(1, 2).float()
    qg = q.float().view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]: query head h -> KV head h // G
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k) * scale  # [B, Hkv, G, T]
    keep = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens[:, None]  # [B, T]
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgt,btkd->bkgd", scores.softmax(-1), v)  # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(q.dtype)


@cache
def _triton():
    """The Triton module and the compiled kernel, or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None

    @triton.jit
    def split_kernel(
        Q, K, V, TABLE, LENS, OUT, LSE, scale,
        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb,
        stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
        SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        hk = tl.program_id(1)
        s = tl.program_id(2)
        length = tl.load(LENS + b)
        first = s * SPLIT
        last = tl.minimum(first + SPLIT, tl.cdiv(length, BS))
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        t = tl.arange(0, BS)
        heads = hk * GROUP + g
        gmask = g < GROUP
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0
        )
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for i in range(first, last):
            blk = tl.load(TABLE + b * stride_tb + i).to(tl.int64)
            rows = blk * stride_kb + t[:, None] * stride_kt + hk * stride_kh + d[None, :]  # [BS, D]
            tmask = i * BS + t < length
            k = tl.load(K + rows, mask=tmask[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, BS] fp32
            sc = tl.where(tmask[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(V + rows, mask=tmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        has = l_sum > 0
        out = tl.where(has[:, None], acc / tl.where(has, l_sum, 1.0)[:, None], 0.0)
        lse = tl.where(has, m + tl.log(tl.where(has, l_sum, 1.0)), float("-inf"))
        o_ptr = OUT + b * stride_ob + s * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out, mask=gmask[:, None])
        tl.store(LSE + b * stride_lb + s * stride_ls + heads, lse, mask=gmask)

    return triton, split_kernel


def triton_available() -> bool:
    return _triton() is not None


def _combine(o_part: Tensor, lse: Tensor) -> Tensor:
    """o_part [B, S, Hq, D], lse [B, S, Hq] (fp32) -> [B, Hq, D] fp32: the splits weighted by softmax(lse)."""
    w = torch.softmax(lse, dim=1)  # a split with lse -inf weighs 0; split 0 is never empty
    return (w.unsqueeze(-1) * o_part).sum(1)


def paged_decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    scale: float | None = None,
) -> Tensor:
    """[B, Hq, D] attention of one query per sequence over its paged K/V (module docstring)."""
    tri = _triton() if q.is_cuda else None
    if tri is None:
        return paged_decode_attention_reference(q, k_pool, v_pool, block_table, seq_lens, scale)
    triton, kernel = tri
    b, hq, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    if k_pool.stride() != v_pool.stride() or k_pool.stride(-1) != 1 or bs < 16 or d & (d - 1):
        raise ValueError(
            "paged attention kernel: K and V pools of one layout, blocks >= 16, power-of-2 head dim"
        )
    group = hq // hkv
    splits = triton.cdiv(block_table.shape[1], SPLIT_BLOCKS)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = q.contiguous()
    o_part = torch.empty((b, splits, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, splits, hq), dtype=torch.float32, device=q.device)
    kernel[(b, hkv, splits)](
        q, k_pool, v_pool, block_table, seq_lens, o_part, lse, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, BS=bs, SPLIT=SPLIT_BLOCKS,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 (tests) exact, not TF32
    )  # fmt: skip
    return _combine(o_part, lse).to(q.dtype)

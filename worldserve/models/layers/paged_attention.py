"""Decode attention over a paged K/V pool: one new token per sequence, its K/V appended, GQA, no host syncs.

`paged_decode_attention(q, k_new, v_new, k_pool, v_pool, block_table, cached_lens, slots)`:
  q [B, Hq, D], k_new / v_new [B, Hkv, D]: the new token of each sequence;
  k_pool / v_pool [num_blocks, block_size, Hkv, D]: one layer of models/layers/paged_kv.py;
  block_table [B, max_blocks] int32 (row b: sequence b's block ids, unused entries any valid id);
  cached_lens [B] int32 (tokens of sequence b already in the pool); slots [B] long (the flat pool row,
  block * block_size + offset, where the new token's K/V go) -> [B, Hq, D], the attention of each new
  token over its sequence's cached tokens and itself; k_new / v_new are stored at `slots` on the way.
Query head h reads KV head h // (Hq / Hkv), as SDPA's enable_gqa does. The step is memory-bound (every
sequence's K/V are read once), so the kernel's job is to read only the blocks a sequence uses and to spread
long sequences over the SMs: it is split-K ("flash-decoding"). Program (b, kv head, split s) of the first
kernel walks blocks [s * n, (s + 1) * n) of the cached tokens of sequence b (n = split_blocks(max_blocks):
16, more past 64 splits) for the Hq / Hkv query heads of that KV head with an online softmax, and writes a
partial output and its
log-sum-exp (an empty split: lse = -inf). Program (b, query head) of the second merges the splits with the
new token's own score and value, writes the output in the model dtype, and (once per KV head) stores the new
K/V into the pool: two kernels a layer, no separate cache write. Shapes and the split count depend only on B
and max_blocks, never on the lengths, so one CUDA graph per batch size serves every context length
(runner/und_decoder.py).

On CUDA with Triton the kernels run; elsewhere (CPU tests, or no Triton) `paged_decode_attention_reference`,
the plain torch version (store the new K/V, gather the whole table width, mask past each length, fp32
softmax) that also serves as the tests' oracle.
"""

from __future__ import annotations

import logging
import math
from functools import cache
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("worldserve.paged_attention")

SPLIT_BLOCKS = 16
"""Blocks one program walks (1,024 tokens at the default block size 64), at least."""

MAX_SPLITS = 64
"""Splits per sequence at most (the merge holds them all in registers): past 64 x 1,024 tokens of table
width (--max-model-len 65536) each program walks more blocks instead."""


def split_blocks(max_blocks: int) -> int:
    """Blocks a split program walks for a table `max_blocks` wide."""
    return max(SPLIT_BLOCKS, -(-max_blocks // MAX_SPLITS))


def paged_decode_attention_reference(
    q: Tensor, k_new: Tensor, v_new: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor,
    cached_lens: Tensor, slots: Tensor, scale: float | None = None,
) -> Tensor:  # fmt: skip
    """The torch version: store k_new / v_new at `slots`, then attend over the whole table width, masked past
    each sequence's cached_lens + 1 keys."""
    b, hq, d = q.shape
    hkv = k_pool.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k_pool.view(-1, hkv, d).index_copy_(0, slots, k_new.to(k_pool.dtype))
    v_pool.view(-1, hkv, d).index_copy_(0, slots, v_new.to(v_pool.dtype))
    table = block_table.long()
    k = k_pool[table].flatten(1, 2).float()  # [B, max_blocks * block_size, Hkv, D]
    v = v_pool[table].flatten(1, 2).float()
    qg = q.float().view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]: query head h -> KV head h // G
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k) * scale  # [B, Hkv, G, T]
    keep = torch.arange(k.shape[1], device=q.device)[None, :] <= cached_lens[:, None]  # [B, T]
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    out = torch.einsum("bkgt,btkd->bkgd", scores.softmax(-1), v)  # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(q.dtype)


@cache
def _triton() -> tuple[Any, Any, Any] | None:
    """(triton, split kernel, merge kernel), or None where Triton is not importable."""
    try:
        import triton
        import triton.language as tl
    except Exception as e:  # (ImportError, or a broken install's own error)
        log.warning("Triton does not import (%s: %s): the Reasoner's paged decode attention runs the slower "
                    "PyTorch reference instead", type(e).__name__, e)  # fmt: skip
        return None

    # (Triton reads a kernel's annotations: its arguments keep none but tl.constexpr)
    @triton.jit
    def split_kernel(  # type: ignore[no-untyped-def]
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

    @triton.jit
    def merge_kernel(  # type: ignore[no-untyped-def]
        Q, KN, VN, KP, VP, SLOTS, PART, LSE, OUT, scale,
        stride_qb, stride_qh, stride_nb, stride_nh, stride_row, stride_ph,
        stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_yb, stride_yh,
        GROUP: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        hk = h // GROUP
        d = tl.arange(0, D)
        q = tl.load(Q + b * stride_qb + h * stride_qh + d).to(tl.float32)
        kn = tl.load(KN + b * stride_nb + hk * stride_nh + d)
        vn = tl.load(VN + b * stride_nb + hk * stride_nh + d)
        s_new = tl.sum(q * kn.to(tl.float32), 0) * scale
        si = tl.arange(0, S_PAD)
        smask = si < S
        lse = tl.load(LSE + b * stride_lb + si * stride_ls + h, mask=smask, other=float("-inf"))
        m = tl.maximum(tl.max(lse, 0), s_new)
        w = tl.exp(lse - m)  # [S_PAD]: 0 for empty and padded splits
        w_new = tl.exp(s_new - m)
        part = tl.load(PART + b * stride_ob + si[:, None] * stride_os + h * stride_oh + d[None, :],
                       mask=smask[:, None], other=0.0)  # fmt: skip
        acc = tl.sum(w[:, None] * part, 0) + w_new * vn.to(tl.float32)
        y = acc / (tl.sum(w, 0) + w_new)
        tl.store(OUT + b * stride_yb + h * stride_yh + d, y.to(OUT.dtype.element_ty))
        if h % GROUP == 0:  # one program per KV head stores the new token's K/V for the next steps
            slot = tl.load(SLOTS + b).to(tl.int64)
            tl.store(KP + slot * stride_row + hk * stride_ph + d, kn.to(KP.dtype.element_ty))
            tl.store(VP + slot * stride_row + hk * stride_ph + d, vn.to(VP.dtype.element_ty))

    return triton, split_kernel, merge_kernel


def triton_available() -> bool:
    return _triton() is not None


def paged_decode_attention(
    q: Tensor, k_new: Tensor, v_new: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor,
    cached_lens: Tensor, slots: Tensor, scale: float | None = None,
) -> Tensor:  # fmt: skip
    """[B, Hq, D] attention of each new token over its cached K/V and itself; the new K/V are stored at
    `slots` (module docstring)."""
    tri = _triton() if q.is_cuda else None
    if tri is None:
        return paged_decode_attention_reference(
            q, k_new, v_new, k_pool, v_pool, block_table, cached_lens, slots, scale
        )
    triton, split_kernel, merge_kernel = tri
    b, hq, d = q.shape
    _, bs, hkv, _ = k_pool.shape
    if k_pool.stride() != v_pool.stride() or not k_pool.is_contiguous() or bs < 16 or d & (d - 1):
        raise ValueError(
            "paged attention: K and V pools contiguous and alike, blocks >= 16, power-of-2 head dim"
        )
    group = hq // hkv
    per_split = split_blocks(block_table.shape[1])
    splits = triton.cdiv(block_table.shape[1], per_split)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
    part = torch.empty((b, splits, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, splits, hq), dtype=torch.float32, device=q.device)
    split_kernel[(b, hkv, splits)](
        q, k_pool, v_pool, block_table, cached_lens, part, lse, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_table.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, BS=bs, SPLIT=per_split,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 (tests) exact, not TF32
    )  # fmt: skip
    out = torch.empty_like(q)
    merge_kernel[(b, hq)](
        q, k_new, v_new, k_pool, v_pool, slots, part, lse, out, scale,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), k_pool.stride(1), k_pool.stride(2),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        GROUP=group, S=splits, S_PAD=triton.next_power_of_2(splits), D=d,
    )  # fmt: skip
    return out

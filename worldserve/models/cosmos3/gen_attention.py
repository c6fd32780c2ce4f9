"""The gen layers' attention workspace: `GenAttentionBuffers` (one forward's K/V rows and attention output, shared by
all 36 gen layers) and `twin_attention` (a CFG pair's first-layer gen-gen attention computed once, merged by LSE
with each item's attention over its own prompt). models/cosmos3/layer.py `gen_layer_step` runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from worldserve.models.layers.attention import KVCache

if TYPE_CHECKING:
    from worldserve.models.cosmos3.layer import TowerBlock


KV_ROWS_BUCKET = 4096
"""GenAttentionBuffers' K/V rows are allocated in multiples of this: the compiled qkv graph (static shapes)
takes the buffers, and their exact size (prompt tokens + gen tokens) would compile it anew for every prompt
length; rounded up, requests of one shape share a graph across ~4k tokens of prompt lengths (~16 MB more)."""


class GenAttentionBuffers:
    """One forward's attention workspace for the gen layers (single rank, or tensor parallel).

    Item i's keys are rows [base_i, base_i + L_i + n_i) of `k` / `v` [R, Hkv, D]: its prompt's und K/V
    (L_i rows, copied in per layer by `load_text`) and then its gen K/V (n_i rows, stored by the compiled
    qkv kernel through `rows` [N]: the buffer row of each packed gen row). Attention writes every item's
    output straight into `out` [N, Hq, D], which o_proj reads. So a layer makes no per-item concatenation
    of K / V (a read and write of all gen K/V) and none of the attention outputs (the same for all q).
    Allocated once per forward and reused by all layers. `twins`: GenBatch.twins (groups of items with
    identical gen input), whose first-layer gen-gen attention `gen_layer_step` computes once per group."""

    def __init__(
        self, caches: Sequence[KVCache], spans: Sequence[tuple[int, int]], block: TowerBlock, like: Tensor,
        twins: Sequence[tuple[int, ...]] = (),
    ) -> None:  # fmt: skip
        self.text_lens = [c.length for c in caches]
        self.spans = list(spans)
        self.twins: tuple[tuple[int, ...], ...] = tuple(twins)
        self.bases: list[int] = []
        rows, base = [], 0
        if [start for start, _ in spans] != [sum(n for _, n in spans[:i]) for i in range(len(spans))]:
            raise ValueError(f"gen spans must tile the stream in item order, got {list(spans)}")
        for lt, (_, n) in zip(self.text_lens, spans, strict=True):
            self.bases.append(base)
            rows.append(torch.arange(base + lt, base + lt + n))
            base += lt + n
        rows_alloc = -(-base // KV_ROWS_BUCKET) * KV_ROWS_BUCKET  # a static shape for many prompt lengths
        kv_shape = (rows_alloc, block.num_kv_heads, block.head_dim)
        self.k = like.new_empty(kv_shape)  # [R, Hkv, D]; rows past the last item's never read
        self.v = like.new_empty(kv_shape)
        self.rows = torch.cat(rows).to(like.device)  # [N] long
        self.out = like.new_empty((self.rows.numel(), block.num_heads, block.head_dim))  # [N, Hq, D]

    def load_text(self, layer: int, caches: Sequence[KVCache]) -> None:
        """Copy each item's und K/V of `layer` in front of its gen rows."""
        for cache, base, lt in zip(caches, self.bases, self.text_lens, strict=True):
            k_und, v_und = cache.kv(layer)  # [L_i, Hkv, D]
            self.k[base : base + lt] = k_und
            self.v[base : base + lt] = v_und

    def keys(self, i: int, part: str = "all") -> tuple[Tensor, Tensor]:
        """Item i's K and V views: "all" [L_i + n_i, Hkv, D], "text" [L_i, ...] or "gen" [n_i, ...]."""
        base, mid = self.bases[i], self.bases[i] + self.text_lens[i]
        start, stop = {
            "all": (base, mid + self.spans[i][1]),
            "text": (base, mid),
            "gen": (mid, mid + self.spans[i][1]),
        }[part]
        return self.k[start:stop], self.v[start:stop]


def twin_attention(
    block: TowerBlock, q: Tensor, buffers: GenAttentionBuffers, group: tuple[int, ...]
) -> None:
    """First layer, a group of items with identical gen input: their gen-gen attention is one function
    (same tokens; the prompts shift every gen position by a constant, which relative RoPE cancels, up to
    the float32 rounding of non-integer positions: batch.same_gen_input), so it runs once, from the group's
    first item, and each item merges it (by LSE) with the attention of its own queries over its own
    prompt's K/V. Saves one N_g x N_g attention per extra member (a CFG pair at
    720p: one of the step's 72 FA3 calls) for two N_g x L_text ones and the merges."""
    attend = block.attn_lse_fn
    assert attend is not None  # (gen_layer forms twins only with a backend that gives LSEs)
    start0, n = buffers.spans[group[0]]
    o_gen, lse_gen = attend(q[start0 : start0 + n], *buffers.keys(group[0], "gen"))
    for i in group:
        start = buffers.spans[i][0]
        o_text, lse_text = attend(q[start : start + n], *buffers.keys(i, "text"))
        block.merge_fn(o_gen, lse_gen, o_text, lse_text, buffers.out[start : start + n])

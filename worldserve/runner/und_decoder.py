"""UndDecoder: the Reasoner's batched decode step (one new token for each of B chats), CUDA-graphed on a GPU.

One step: embed the B tokens, mRoPE at their positions, then per und layer: the fused q|k|v projection with
q/k-norm and RoPE, paged decode attention (models/layers/paged_attention.py: over each sequence's cached
K/V in the pool of models/layers/paged_kv.py and the new token, whose K/V it stores at the sequence's next
slot), o_proj + SwiGLU; final norm, lm_head.
Everything a step reads sits in static device buffers (token ids, positions, write slots, block tables,
lengths), so the step has no host syncs and no shapes that depend on the contexts.

Why: at batch 1 the decode step streams 15.1 GB of weights (3.5 ms at 4.3 TB/s, performance.md §2), but
eager PyTorch spends ~27 ms launching ~2,500 small kernels from Python (bench/results/README.md). On CUDA
(single rank, layers resident) each batch-size bucket (1, 2, 4, 8, ... up to max_batch) is captured once as
a CUDA graph: a step is then a few small host-to-device copies and one graph replay. Batches are padded up
to their bucket with rows that write into and read from the pool's scratch block 0. Elsewhere (CPU, tensor
parallel, layerwise offload) the same step runs eagerly (on the CPU with the block tables cut to the longest sequence).

On CUDA the layers' q|k|v and o/MLP math also run through torch.compile'd copies (their own code objects,
automatic dynamic shapes: one graph for batch 1 and one for the rest), which fuse the norms, RoPE and SiLU
into a few kernels per layer before the capture. `enforce_eager=True` (vLLM's flag) turns both off.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from torch import Tensor

from worldserve.models.layers.paged_attention import paged_decode_attention
from worldserve.models.layers.paged_kv import PagedKVPool, PagedSequence
from worldserve.runner.graph_capture import GraphCapture


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below max_batch, then max_batch itself: (1, 2, 4, 8, ..., max_batch)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch)


class UndDecoder:
    """Static-buffer decode step over a PagedKVPool; CUDA graphs per batch bucket where they can run."""

    def __init__(
        self,
        model: Any,
        pool: PagedKVPool,
        *,
        max_batch: int,
        max_model_len: int,
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        self.pool = pool
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = pool.blocks_for(max_model_len)
        dev = model.device
        fast = dev.type == "cuda" and not enforce_eager
        self.use_graphs = fast and model.tp.size == 1 and model.und_blocks is None
        self.qkv_fn, self.finish_fn = (None, None)
        if fast:
            from worldserve.models.cosmos3.layer import compiled_decode_math

            self.qkv_fn, self.finish_fn = compiled_decode_math()
        b = self.buckets[-1]
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(3, b, dtype=torch.float32, device=dev)
        self.slots = torch.zeros(b, dtype=torch.long, device=dev)  # flat pool row of each new token
        self.table = torch.zeros(b, self.max_blocks, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(b, dtype=torch.int32, device=dev)  # tokens of each row already in the pool
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._capture_with = GraphCapture(dev) if self.use_graphs else None

    @property
    def math(self) -> tuple | None:
        """(qkv, finish): the compiled layer math the step runs (the prefill runs it too), None when eager."""
        return None if self.qkv_fn is None else (self.qkv_fn, self.finish_fn)

    # ------------------------------------------------------------------ the step
    def _layer(self, i: int, h: Tensor, cos: Tensor, sin: Tensor, table: Tensor, lens: Tensor) -> Tensor:
        blk = self.model.layers[i].und
        q, k, v = blk.project_qkv(h, cos, sin, self.qkv_fn)
        k_pool, v_pool = self.pool.layer(i)  # [blocks, block_size, Hkv, D]
        slots = self.slots[: h.shape[0]]
        attn = paged_decode_attention(q, k, v, k_pool, v_pool, table, lens, slots)  # [B, Hq, D]; k, v stored
        return blk.finish(h, attn, self.finish_fn)

    def _forward(self, b: int, width: int) -> Tensor:
        """Logits [b, vocab] of the first b rows of the static buffers (tables cut to `width` blocks)."""
        m = self.model
        h = m.embed_tokens(self.ids[:b]).to(m.dtype)  # [b, d]
        cos, sin = m.rotary_emb.cos_sin(self.positions[:, :b], h.dtype)
        table, lens = self.table[:b, :width], self.lens[:b]
        for i in range(len(m.layers)):
            with nullcontext() if m.und_blocks is None else m.und_blocks.use(i):
                h = self._layer(i, h, cos, sin, table, lens)
        return m.compute_logits(m.norm(h))

    def _fill(
        self, tokens: Sequence[int], seqs: Sequence[PagedSequence], positions: Sequence[int], b: int
    ) -> None:
        """Copy the step's host metadata into the static buffers; rows past len(seqs) become padding."""
        n = len(seqs)
        table = np.zeros((b, self.max_blocks), dtype=np.int32)  # filled by numpy: no tensor a row
        for r, s in enumerate(seqs):
            table[r, : len(s.blocks)] = s.blocks
        pad = b - n
        ids = torch.tensor([*tokens, *([0] * pad)], dtype=torch.long)
        pos = torch.tensor([*(float(p) for p in positions), *([0.0] * pad)], dtype=torch.float32)
        slots = torch.tensor([*(s.slot(s.length) for s in seqs), *([0] * pad)], dtype=torch.long)
        lens = torch.tensor([*(s.length for s in seqs), *([0] * pad)], dtype=torch.int32)
        self.ids[:b].copy_(ids, non_blocking=True)
        self.positions[:, :b].copy_(pos.expand(3, -1), non_blocking=True)
        self.slots[:b].copy_(slots, non_blocking=True)
        self.lens[:b].copy_(lens, non_blocking=True)
        self.table[:b].copy_(torch.from_numpy(table), non_blocking=True)

    @torch.inference_mode()
    def step(self, tokens: Sequence[int], seqs: Sequence[PagedSequence], positions: Sequence[int]) -> Tensor:
        """Decode token[r] of sequence seqs[r] at mRoPE position positions[r] -> logits [len(seqs), vocab].

        Each sequence must have room for one more token (PagedSequence.reserve(1)); its length advances by
        one."""
        n = len(seqs)
        if not 0 < n <= self.buckets[-1]:
            raise ValueError(f"a decode step takes 1..{self.buckets[-1]} sequences, got {n}")
        if any(s.length + 1 > s.capacity for s in seqs):
            raise RuntimeError("a sequence has no room for its next token: reserve(1) first")
        if self.use_graphs:
            b = next(x for x in self.buckets if x >= n)
            graph, out = self._graph(b)  # a first capture runs on padding rows: before the fill
            self._fill(tokens, seqs, positions, b)
            graph.replay()
            logits = out[:n].clone()
        else:
            self._fill(tokens, seqs, positions, n)
            # CPU: the torch reference gathers the table's width, so cut it; CUDA: one width, one kernel build
            width = max(len(s.blocks) for s in seqs) if self.model.device.type != "cuda" else self.max_blocks
            logits = self._forward(n, width)
        for s in seqs:
            s.advance(1)
        return logits

    # ------------------------------------------------------------------ CUDA graphs
    def _graph(self, b: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        if b not in self._graphs:
            self._capture(b)
        return self._graphs[b]

    def _capture(self, b: int) -> None:
        """Warm the step up and capture it for bucket b (graph_capture.py), with the rows pointing at the
        scratch block (the warm-up writes there)."""
        assert self._capture_with is not None, "graphs are captured only with use_graphs (which made it)"
        self._pad_rows(b)
        ((graph, out),) = self._capture_with.capture([lambda: self._forward(b, self.max_blocks)])
        self._graphs[b] = (graph, out)

    def _pad_rows(self, b: int) -> None:
        self.ids[:b].zero_()
        self.positions[:, :b].zero_()
        self.slots[:b].zero_()
        self.table[:b].zero_()
        self.lens[:b].zero_()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now (server start), so no chat pays for a capture. A no-op without graphs."""
        if self.use_graphs:
            for b in self.buckets:
                self._graph(b)

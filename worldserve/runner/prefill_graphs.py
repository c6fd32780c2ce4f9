"""Piecewise CUDA graphs of the Reasoner's prefill (vLLM's piecewise capture), one set per token bucket.

Why: compiled (runner/und_prefill.py's `math`), a prefill pass still dispatches from Python: on an H200 a
75-token prompt took 28 ms in the und tower, ~770 us of host time a layer (the compiled regions' wrappers
~600 us, cuDNN attention ~115 us) for 5.4 ms of GPU work (bench/prefill_floor.py --profile). Short prompts
waited on the host, whatever their length.

What: everything between two attentions is one graph per bucket of tokens (`prefill_buckets`, padded):
piece 0 is layer 0's pre-norm, q|k|v, q/k-norm and RoPE; piece i (1..L-1) is layer i-1's o_proj and
SwiGLU MLP with their residual adds, Qwen3-VL's deepstack add after the first layers, then layer i's q|k|v
math; piece L is the last layer's o_proj + MLP and the final norm. Attention runs eagerly between the pieces,
on the real rows only: each sequence's new K/V written into the paged pool, then its causal attention over
its cached and new K/V (models/cosmos3/layer.py's und_layer_step does the same). So cached prefixes, several
sequences in one pass and any context length need no graph of their own; only the packed token count picks
the bucket. The pieces read and write static buffers (residual stream, cos/sin, q / k / v, attention output,
dense deepstack rows, final hidden), so a replay is one host call. Padding rows compute values no real row
ever reads (every op in a piece is row-wise) and are never written to the pool.

Measured (H200, random Nano, bench/prefill_floor.py): a 75-token prompt's first token 7.6 ms (compiled
without graphs 22 ms, eager 29 ms; the weight-streaming floor 3.5 ms); what is left on the host is mostly the
per-layer attention call and K/V writes.

The pieces run the decode step's compiled layer math (layer.compiled_decode_math, dynamic shapes), but not its
graphs: the static buffers are normal tensors where the decode step's activations are inference tensors, and
dynamo guards on that (the dispatch keys), so each function compiles twice more at the warm-up (the first
bucket static, then one dynamic graph for the rest: 4 graphs a function with the decode step's, within
dynamo's default limit of 8). Those compiles run in a capture's warm-up passes, never inside a capture, and
after the warm-up no bucket compiles. All graphs share one memory pool: their intermediates die inside each
replay and replays never overlap, and every result they keep lands in the static buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from worldserve.models.cosmos3.batch import UndBatch
from worldserve.models.layers.attention import KVCache
from worldserve.runner.graph_capture import GraphCapture

MAX_PREFILL_GRAPH_TOKENS = 2048
"""The largest bucket: past ~2k tokens a prefill's GEMMs (36 ms on an H200) outlast its host dispatch."""


def prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    """16, 32, 64, then every 128 tokens, up to max_tokens (itself last): past ~512 tokens a pass is
    GEMM-bound, so a bucket pads it by at most 128 tokens (powers of two cost 843 tokens 21 % more work in
    1,024)."""
    sizes = [b for b in (16, 32, 64) if b < max_tokens] + list(range(128, max_tokens, 128))
    return (*sizes, max_tokens)


class PrefillGraphs:
    """The und tower's prefill pass as L + 1 CUDA-graphed pieces per token bucket, attention eager between."""

    def __init__(
        self, model: Any, math: tuple, *, num_deepstack: int, max_tokens: int = MAX_PREFILL_GRAPH_TOKENS,
        capture: bool = True,
    ) -> None:  # fmt: skip
        self.model = model
        self.capture = capture  # False: the pieces run as plain calls (CPU tests of the split into pieces)
        self.qkv_fn, self.finish_fn = math
        self.num_deepstack = num_deepstack
        self.buckets = prefill_buckets(max_tokens)
        blk = model.layers[0].und
        n, d, dev, dt = self.buckets[-1], model.config.hidden_size, model.device, model.dtype
        self.h = torch.zeros(n, d, device=dev, dtype=dt)  # the residual stream
        self.cos = torch.zeros(n, blk.head_dim, device=dev, dtype=dt)
        self.sin = torch.zeros(n, blk.head_dim, device=dev, dtype=dt)
        self.q = torch.zeros(n, blk.num_heads, blk.head_dim, device=dev, dtype=dt)
        self.k = torch.zeros(n, blk.num_kv_heads, blk.head_dim, device=dev, dtype=dt)
        self.v = torch.zeros_like(self.k)
        self.attn = torch.zeros_like(self.q)  # attention output of the layer between two pieces
        self.deepstack = torch.zeros(num_deepstack, n, d, device=dev, dtype=dt)  # dense: zero off visual rows
        self.out = torch.zeros(n, d, device=dev, dtype=dt)  # final-normed hidden states
        self._deepstack_set = False
        self._graphs: dict[int, list] = {}  # bucket -> its pieces' replay functions
        self._capture_with = GraphCapture(model.device) if capture else None
        self.replays = 0  # passes run through the graphs (tests, metrics)

    def fits(self, batch: UndBatch) -> bool:
        """Whether the pass can run here: its tokens within the largest bucket, its deepstack layers known."""
        return sum(batch.seq_lens) <= self.buckets[-1] and len(batch.deepstack) in (0, self.num_deepstack)

    # ------------------------------------------------------------------ the pass
    def __call__(self, batch: UndBatch, caches: Sequence[KVCache]) -> Tensor:
        """und_step(batch, caches) (not kv_only): final-normed hidden states [N, d]; the K/V appended."""
        m, n = self.model, sum(batch.seq_lens)
        b = next(x for x in self.buckets if x >= n)
        graphs = self._graphs_for(b)
        h = batch.inputs_embeds if batch.inputs_embeds is not None else m.embed_tokens(batch.input_ids)
        self.h[:n].copy_(h)
        self.h[n:b].zero_()
        cos, sin = m.rotary_emb.cos_sin(batch.positions, m.dtype)  # [n, D] each
        self.cos[:n].copy_(cos)
        self.sin[:n].copy_(sin)
        self._set_deepstack(batch, b)
        for cache, k in zip(caches, batch.seq_lens, strict=True):
            cache.reserve(k)
        graphs[0]()
        for i, layer in enumerate(m.layers):
            start = 0
            for cache, k in zip(caches, batch.seq_lens, strict=True):
                rows = slice(start, start + k)
                k_all, v_all = cache.write(i, self.k[rows], self.v[rows])
                layer.und.attn_fn(self.q[rows], k_all, v_all, causal=True, out=self.attn[rows])
                start += k
            graphs[i + 1]()
        for cache, k in zip(caches, batch.seq_lens, strict=True):
            cache.advance(k)
        self.replays += 1
        return self.out[:n].clone()

    def _set_deepstack(self, batch: UndBatch, b: int) -> None:
        """The deepstack features into their dense rows (zero elsewhere); zeroed again after a visual pass."""
        if batch.deepstack:
            self._deepstack_set = (
                True  # (first: a failure among the writes leaves them to the next pass to zero)
            )
            self.deepstack[:, :b].zero_()
            for j, feat in enumerate(batch.deepstack):
                self.deepstack[j].index_add_(0, batch.visual_rows, feat.to(self.deepstack.dtype))
        elif self._deepstack_set:
            self.deepstack.zero_()
            self._deepstack_set = False

    def _piece(self, i: int, b: int) -> None:
        """Piece i of bucket b over the static buffers' first b rows (the module docstring)."""
        m, last = self.model, len(self.model.layers)
        if i > 0:
            h = m.layers[i - 1].und.finish(self.h[:b], self.attn[:b], self.finish_fn)  # [b, d], a new tensor
            if i - 1 < self.num_deepstack:
                h = h + self.deepstack[i - 1, :b]
            if i == last:
                self.out[:b].copy_(m.norm(h))
                return
            self.h[:b].copy_(h)
        q, k, v = m.layers[i].und.project_qkv(self.h[:b], self.cos[:b], self.sin[:b], self.qkv_fn)
        self.q[:b].copy_(q)
        self.k[:b].copy_(k)
        self.v[:b].copy_(v)

    # ------------------------------------------------------------------ capture
    def _graphs_for(self, b: int) -> list:
        """Bucket b's pieces as replay functions: captured (graph_capture.py: one pool and warm-up stream for
        every bucket) at their first use, or the plain calls without capture."""
        if b not in self._graphs:
            pieces = [partial(self._piece, i, b) for i in range(len(self.model.layers) + 1)]
            captured = self._capture_with.capture(pieces) if self._capture_with is not None else None
            self._graphs[b] = pieces if captured is None else [graph.replay for graph, _ in captured]
        return self._graphs[b]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket now (server start), so no chat pays for a capture."""
        for b in self.buckets:
            self._graphs_for(b)

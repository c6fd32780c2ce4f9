"""LoRA deltas, unmerged: y = x W^T + (x A^T) B^T for a linear layer whose adapter is (A [R, in], B [out, R]).

The adapter's scaling (lora_alpha / r, rsLoRA's lora_alpha / sqrt(r), times the request's scale) is folded
into B when it is loaded (weights/lora_adapter.py), so applying one is two small GEMMs on the layer's input
(R is the adapter's rank, a few dozen). A fused layer (q|k|v, gate|up) takes the parts' adapters as one pair:
A stacks the parts' A rows [R_q + R_k + R_v, in] and B is block-diagonal [q + k + v, R_q + R_k + R_v], so
the parts stay independent and one GEMM pair serves the fused weight. Under tensor parallelism a
column-parallel layer holds its rank's rows of B (A whole) and a row-parallel one its rank's columns of A
(B whole): the partial deltas sum in the layer's all-reduce.

Per-request adapters are never merged into the weights: the base weights stay exact for every other request
(the Reasoner's chats share the und tower), and switching adapters costs nothing but passing other tensors.
The unmerged deltas cost ~5 % of a 720p step at rank 16 and 64 alike (bench/results/README.md: the GEMM pairs' extra
reads and writes of each layer's input and output, not their FLOPs), so a server's one static adapter (no
per-request ones) is merged into the gen pathway's weights instead (`merge_pair`, `MergedLora`:
Cosmos3Transformer.merge_gen_lora), each output row unless rounding into the weights' dtype would change
more than a trace of its delta (runner/lora_cache.py MERGE_ERASURE_LIMIT); its und tower deltas, and the rows
left out, run unmerged (the und ones in the prompt's prefill).
`LoraWeights` is one loaded adapter in our model's layout: what the transformer's forwards take.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

LoraPair = tuple[Tensor, Tensor]
"""(A [R, in], B [out, R]) of one linear layer, B already scaled."""

TOWER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""The linear layers of a TowerBlock an adapter may carry deltas for."""

TOP_LINEARS = (
    "proj_in", "proj_out", "time_embedder.linear_1", "time_embedder.linear_2", "audio_proj_in", "audio_proj_out",
)  # fmt: skip
"""The transformer's linear layers outside the layers (the gen pathway's embeddings and heads)."""


def lora_delta(x: Tensor, pair: LoraPair) -> Tensor:
    """(x A^T) B^T: x [N, in] -> [N, out], in x's dtype (the adapter is stored in the layer's dtype)."""
    a, b = pair
    return F.linear(F.linear(x, a), b)


def add_delta(y: Tensor, x: Tensor, pair: LoraPair) -> Tensor:
    """y + (x A^T) B^T. Compiled, the add fuses into y's consumers (the q / k norms, silu(gate) * up); an
    addmm into y's GEMM output instead copies y into its result before reading and writing it again: 1.066x a
    720p step at rank 64 against this form's 1.050x (bench/lora_step.py --forms)."""
    return y + lora_delta(x, pair)


def with_lora(y: Tensor, x: Tensor, pair: LoraPair | None) -> Tensor:
    """y (the base layer's output for x) plus the adapter's delta, or y as it is without one."""
    return y if pair is None else add_delta(y, x, pair)


def merge_pair(
    weight: Tensor, pair: LoraPair, *, max_erasure: float = math.inf
) -> tuple[LoraPair | None, float]:
    """weight [out, in] += B A in place, summed in float32 on the weight's device and rounded to its dtype once,
    row by row: a row whose rounding would change more than `max_erasure` of its delta (|<exact - rounded,
    B A>| / ||B A||^2 over the row) keeps its weights as loaded. Rounding a delta well above the weights' last
    bit only adds the zero-mean noise any bf16 weight carries (~0); a delta below half a bit (~0.2 % of the
    weight) rounds away whole (1), where the unmerged GEMM pair keeps it: its sum over the input is coherent,
    and the output's rounding sees that sum. Returns (the pair for the rows left unmerged, B's merged rows
    zeroed, or None when every row merged; the largest |erasure| of a merged row)."""
    a, b = (t.to(weight.device, torch.float32) for t in pair)
    base = weight.float()
    exact = torch.addmm(base, b, a)  # [out, in] + [out, R] @ [R, in]
    merged = exact.to(weight.dtype)
    delta = exact - base
    energy = delta.square().sum(1)  # [out]
    erased = ((exact - merged.float()) * delta).sum(1) / energy.clamp_min(1e-30)  # [out]; 0 where no delta
    ok = erased.abs() <= max_erasure  # [out]
    weight.copy_(torch.where(ok[:, None], merged, weight))
    worst = float(erased[ok].abs().max()) if bool(ok.any()) else 0.0
    if bool(ok.all()):
        return None, worst
    keep = (~ok).to(pair[1].device, pair[1].dtype)[:, None]  # [out, 1]
    return (pair[0], pair[1] * keep), worst


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class LoraWeights:
    """One adapter in our layout (on the host, or on the model's device where forwards take it): per layer and
    tower the deltas of its fused linears (`TOWER_LINEARS` names; absent: no delta), and those of the top-level
    linears (`TOP_LINEARS`)."""

    key: tuple
    """What identifies this adapter at this scale (its files and the scale): requests whose keys are equal
    may share a forward (runner/video_state.py batch_key)."""
    layers: tuple[Mapping[str, Mapping[str, LoraPair]], ...]
    """layers[i]["und" | "gen"][linear] -> (A, B)."""
    top: Mapping[str, LoraPair] = field(default_factory=dict)

    def tower(self, layer: int, tower: str) -> Mapping[str, LoraPair] | None:
        """The deltas of one TowerBlock (None when the adapter has none there)."""
        found = self.layers[layer].get(tower) if layer < len(self.layers) else None
        return found or None

    def replaced(self, pairs: Mapping[tuple, LoraPair | None]) -> LoraWeights | None:
        """The same adapter with the pairs named in `pairs` ((layer, tower, linear), or ("top", linear)) replaced,
        or dropped where None; None when nothing is left."""

        def pick(key: tuple, pair: LoraPair) -> LoraPair | None:
            return pairs.get(key, pair)

        layers = tuple(
            {tw: kept for tw, lin in layer.items()
             if (kept := {n: q for n, p in lin.items() if (q := pick((i, tw, n), p)) is not None})}
            for i, layer in enumerate(self.layers)
        )  # fmt: skip
        top = {n: q for n, p in self.top.items() if (q := pick(("top", n), p)) is not None}
        return LoraWeights(key=self.key, layers=layers, top=top) if any(layers) or top else None

    def to(
        self, device: torch.device, dtype: torch.dtype | None = None, *, non_blocking: bool = False
    ) -> LoraWeights:
        """The same adapter with every pair on `device` (in `dtype` when given; itself when it is so already)."""
        if all(t.device == device and dtype in (None, t.dtype) for t in self._tensors()):
            return self
        return self._map(lambda t: t.to(device, dtype, non_blocking=non_blocking))

    def mark_ranks_dynamic(self) -> LoraWeights:
        """Itself, every pair's rank dimension (A's rows, B's columns) marked dynamic for torch.compile: the
        compiled gen layers then run adapters of any ranks (and rank patterns) on one graph rather than compiling
        one per rank set (a rank of 1 still specialises)."""
        import torch._dynamo  # (only once an adapter runs: dynamo takes ~2 s to import)

        for a, b in self._pairs():
            torch._dynamo.maybe_mark_dynamic(a, 0)
            torch._dynamo.maybe_mark_dynamic(b, 1)
        return self

    def pinned(self) -> LoraWeights:
        """The same adapter in pinned host memory (its copies to a GPU then run asynchronously)."""
        return self._map(lambda t: t.pin_memory())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _pairs(self) -> list[LoraPair]:
        return [p for layer in self.layers for tower in layer.values() for p in tower.values()] + [
            *self.top.values()
        ]

    def _tensors(self) -> Iterator[Tensor]:
        return (t for pair in self._pairs() for t in pair)

    def _map(self, fn: Callable[[Tensor], Tensor]) -> LoraWeights:
        """A LoraWeights of the same key whose every tensor is fn(tensor)."""

        def pair(p: LoraPair) -> LoraPair:
            return fn(p[0]), fn(p[1])

        layers = tuple(
            {tw: {n: pair(p) for n, p in lin.items()} for tw, lin in layer.items()} for layer in self.layers
        )
        return LoraWeights(key=self.key, layers=layers, top={n: pair(p) for n, p in self.top.items()})


@dataclass(frozen=True, slots=True)
class MergedLora:
    """An adapter whose gen-pathway deltas were added into a model's weights (Cosmos3Transformer.merged_lora)."""

    source: Hashable
    """What the loader named it by (runner/lora_cache.py: the adapter's path and scale)."""
    rest: LoraWeights | None
    """Its deltas left unmerged, on the model's device: the und tower's (the Reasoner shares those weights), and
    the gen-pathway rows the rounding would have erased (their pairs with B's merged rows zeroed)."""

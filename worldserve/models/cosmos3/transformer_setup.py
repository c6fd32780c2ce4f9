"""What turns a loaded Cosmos3Transformer into the one that runs, applied once after its weights load
(runner/kernel_options.py `KernelOptions.apply`): torch.compile of the gen layers, the gen tower's fp8
GEMMs, a LoRA adapter merged into the gen pathway's weights, layerwise offload of the blocks to pinned host
memory, and the attention kernel of every layer.

Separate from transformer.py, which holds the model's modules and its forward passes: these change which
weights and kernels those passes run, never their math. Order matters and is checked: a LoRA merge before
fp8 quantisation (it quantises the merged weights), both before layerwise offload (it packs the blocks).
`Cosmos3TransformerSetup` is the model's base class; its methods use the model's own attributes (`config`,
`layers`, the block streamers, `merged_lora`, `dtype`, `device`, `post_load`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator

import torch
from torch import Tensor, nn

from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.models.cosmos3.layer import compile_blocks
from worldserve.models.layers.fa4_cluster import (
    fa4_cluster_attention,
    fa4_cluster_forward,
    fa4_cluster_unavailable_reason,
)
from worldserve.models.layers.flash_attention import (
    LseAttentionFn,
    fa3_forward,
    fa3_fp8_attention,
    resolve_attention_backend,
)
from worldserve.models.layers.fp8 import fp8_unavailable_reason
from worldserve.models.layers.lora import LoraPair, LoraWeights, MergedLora, merge_pair
from worldserve.models.layers.offload import BlockStreamer


class Cosmos3TransformerSetup(nn.Module):
    """The after-load setup methods of Cosmos3Transformer (its base class)."""

    config: Cosmos3Config
    layers: nn.ModuleList
    und_blocks: BlockStreamer | None
    gen_blocks: BlockStreamer | None
    merged_lora: MergedLora | None

    def compile_gen_layers(self, *, mode: str = "default", backend: str = "inductor") -> None:
        """torch.compile the gen tower's per-layer math (one shared graph per shape for all layers)."""
        compile_blocks([layer.gen for layer in self.layers], mode=mode, backend=backend)

    def quantize_gen_fp8(
        self, *, emulate: bool = False, fast_accum: bool = True, device: torch.device | None = None
    ) -> None:
        """Gen tower qkv/o/gate_up/down -> e4m3 weights with per-row scales; the bf16 copies are freed.

        Native (default): needs a bfloat16 model on a CUDA sm90+ device (torch._scaled_mm rowwise);
        `device`: the one it will run on, when it still sits on the CPU before enable_layerwise_offload.
        `emulate=True`: the same quantised math in float32 on any device/dtype (tests, numerics checks;
        slower than the unquantised model). Works before or after compile_gen_layers, not after offload."""
        if self.gen_blocks is not None:
            raise ValueError("quantize before enable_layerwise_offload (the offloaded blocks are packed)")
        run_on = self.device if device is None else device
        if not emulate and (reason := fp8_unavailable_reason(run_on, self.dtype)) is not None:
            raise ValueError(reason)
        for layer in self.layers:
            layer.gen.quantize_fp8(emulate=emulate, fast_accum=fast_accum)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed bf16 gen weights (about 13.9 GB on Nano) back

    def merge_gen_lora(
        self,
        lora: LoraWeights,
        source: Hashable,
        device: torch.device | None = None,
        *,
        max_erasure: float = math.inf,
    ) -> tuple[int, float]:
        """Add `lora`'s gen-pathway deltas (the gen tower's linears, proj_in / proj_out, the time embedder's and
        the audio heads') into the weights, W += B A, each output row unless rounding would change more than
        `max_erasure` of its delta (models/layers/lora.py merge_pair; float32 weights always merge): merged
        rows cost nothing a step. The und tower's deltas and the rows left out stay unmerged in
        `merged_lora.rest`, on `device` (default: the model's) in its dtype: the und weights stay exact for the
        Reasoner, and the prompt's prefill applies their deltas. Nothing merged leaves `merged_lora` None.
        Before fp8 quantisation (it quantises the merged weights) and layerwise offload (it packs them);
        `source` names the adapter for callers. Returns (linears merged whole, the largest |erasure| merged)."""
        if self.merged_lora is not None:
            raise ValueError("a LoRA adapter is merged into this model already")
        if self.gen_blocks is not None or any(layer.gen.fp8 for layer in self.layers):
            raise ValueError("merge a LoRA adapter before quantize_gen_fp8 and enable_layerwise_offload")
        left, worst, merged_any = {}, 0.0, False
        with torch.no_grad():
            for key, weight, pair in self._gen_lora_targets(lora):
                limit = math.inf if weight.dtype == torch.float32 else max_erasure
                kept, erased = merge_pair(weight, pair, max_erasure=limit)
                left[key] = kept
                worst = max(worst, erased)
                merged_any |= kept is None or bool(kept[1].count_nonzero() < pair[1].count_nonzero())
        if merged_any:
            rest = lora.replaced(left)
            self.merged_lora = MergedLora(
                source, None if rest is None else rest.to(device or self.device, self.dtype)
            )
        return sum(pair is None for pair in left.values()), worst

    def _gen_lora_targets(self, lora: LoraWeights) -> Iterator[tuple[tuple, Tensor, LoraPair]]:
        """(key, weight, pair) of every gen-pathway linear `lora` has a delta for (key: LoraWeights.replaced's)."""
        for i, layer in enumerate(self.layers):
            for name, pair in (lora.tower(i, "gen") or {}).items():
                yield (i, "gen", name), getattr(layer.gen, name).weight, pair
        for name, pair in lora.top.items():
            yield ("top", name), self.get_submodule(name).weight, pair

    def enable_layerwise_offload(self, device: str | torch.device, *, slots: int = 2) -> None:
        """Move everything but the layers to `device`; keep the layers' und and gen blocks in pinned host
        memory and stream them through `slots` device buffers per tower as they run (offload.py).

        Call on a fully loaded (and, if wanted, fp8-quantised) model whose layers are on the CPU."""
        if self.gen_blocks is not None:
            raise ValueError("layerwise offload is already on")
        device = torch.device(device)
        for name, child in self.named_children():
            if name != "layers":
                child.to(device)
        for tensor in [*self.parameters(recurse=False), *self.buffers(recurse=False)]:
            tensor.data = tensor.data.to(device)
        self.und_blocks = BlockStreamer([layer.und for layer in self.layers], device, slots=slots)
        self.gen_blocks = BlockStreamer([layer.gen for layer in self.layers], device, slots=slots)
        self.post_load()  # RoPE tables on the device

    def set_attention_backend(self, name: str | None = None, *, fp8_attention: bool = False) -> str:
        """Route every layer's attention through `name` (flash_attention.BACKENDS; None = auto); the label.

        Auto on Hopper: FA3 for the und tower and FA4's cluster kernel for the gen tower ("fa4-cluster")
        where that kernel can run (fa4_cluster.fa4_cluster_unavailable_reason), else FA3 for both.
        `fp8_attention` (needs FA3) runs the gen tower's attention in e4m3; the und tower stays exact."""
        label, fn = resolve_attention_backend(name, self.device, self.dtype, self.config.head_dim)
        if fp8_attention and label != "fa3":
            raise ValueError(
                "fp8 attention needs the FlashAttention-3 backend (FLASH_ATTN), which cannot run here"
            )
        # LSEs let the first gen layer share a CFG pair's gen-gen attention (gen_attention.GenAttentionBuffers)
        gen_fn = fn
        lse_fn: LseAttentionFn | None = fa3_forward if label == "fa3" else None
        if fp8_attention:
            gen_fn, lse_fn, label = fa3_fp8_attention, None, "fa3+fp8"
        elif label == "fa3" and (name or "auto").upper() == "AUTO":
            head_dim = self.config.head_dim
            if fa4_cluster_unavailable_reason(self.device, self.dtype, head_dim) is None:
                gen_fn, lse_fn, label = fa4_cluster_attention, fa4_cluster_forward, "fa4-cluster"
        for layer in self.layers:
            layer.und.attn_fn = fn
            layer.gen.attn_fn = gen_fn
            layer.gen.attn_lse_fn = lse_fn
        return label

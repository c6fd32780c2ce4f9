"""How the loaded transformer runs: torch.compile, fp8 GEMMs, the attention kernel, fp8 attention, and
whether its layers stream from host memory (layerwise offload).

One frozen `KernelOptions` travels from the CLI (`serve` / `generate` flags) to every rank that loads a
transformer (the CFG-parallel peer gets the same object), and `apply` turns a freshly loaded model into
the configured one in a fixed order: a merged LoRA adapter first (runner/lora_cache.py merge_lora: its deltas
are added into the weights everything after sees), fp8 weights (they replace the GEMM weights), then layerwise
offload (it packs the final weights into pinned host buffers; the model was loaded on the CPU for it, see
`load_device`), then the attention backend, then compilation (the compiled graphs see the final weights). `check` raises the
user-facing ValueError before anything is loaded.
"""

from __future__ import annotations

import logging
import typing
from dataclasses import dataclass

import torch

from worldserve import envs
from worldserve.models.layers.flash_attention import BACKENDS, fa3_unavailable_reason

if typing.TYPE_CHECKING:
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer
    from worldserve.params import LoraRequest

log = logging.getLogger("worldserve.kernels")

QUANTIZATIONS = ("fp8", "fp8-emulated")
"""`quantization` values besides None; the CLI offers "fp8" only ("fp8-emulated": float32 numerics, tests)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelOptions:
    compile: bool = True
    """torch.compile the gen layers (1.13x a step on an H200) on CUDA, and tell the Reasoner to compile its
    decode step (runner/und_decoder.py); CPU always runs eagerly."""
    quantization: str | None = None
    """None, "fp8" (gen tower GEMMs in e4m3, row-wise scales; bf16 gen weights freed) or "fp8-emulated"."""
    attention_backend: str | None = None
    """flash_attention.BACKENDS name; None: `DIFFUSION_ATTENTION_BACKEND`, else auto (FA3 where it runs; the gen tower
    FA4's cluster kernel where that runs too: models/layers/fa4_cluster.py)."""
    fp8_attention: bool = False
    """Gen tower attention in e4m3 through FlashAttention-3 (lossy; H100/H200 with the FA3 package)."""
    layerwise_offload: bool = False
    """Keep the transformer layers in pinned host memory and stream them to the GPU as they run."""
    merged_lora: LoraRequest | None = None
    """A LoRA adapter merged into the gen pathway's weights at load (a server's only one: --lora-path without
    --enable-lora; `generate --lora`): no cost a step, where unmerged deltas cost ~5 %. An output row whose delta
    rounding into the weights would erase stays unmerged (runner/lora_cache.py MERGE_ERASURE_LIMIT)."""

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        name = self.backend_name
        if name is not None and name.upper() not in (*BACKENDS, "AUTO"):
            raise ValueError(f"{self.backend_source} must be one of {BACKENDS} or auto, got {name!r}")

    @classmethod
    def from_flags(
        cls, *, enforce_eager: bool, quantization: str | None, diffusion_attention_backend: str | None,
        fp8_attention: bool, enable_layerwise_offload: bool = False,
    ) -> KernelOptions:  # fmt: skip
        """From the `serve` / `generate` flags of the same names ("auto" = None)."""
        backend = diffusion_attention_backend
        return cls(
            compile=not enforce_eager, quantization=quantization, fp8_attention=fp8_attention,
            attention_backend=None if backend is None or backend.lower() == "auto" else backend,
            layerwise_offload=enable_layerwise_offload,
        )  # fmt: skip

    @property
    def backend_name(self) -> str | None:
        """The flag, else the environment variable, else None (auto)."""
        return self.attention_backend or envs.attention_backend()

    @property
    def backend_source(self) -> str:
        """Where backend_name came from, for error messages: the flag or the environment variable."""
        if self.attention_backend is None and envs.attention_backend() is not None:
            return f"environment variable {envs.ATTENTION_BACKEND_VAR}"
        return "--diffusion-attention-backend"

    def check(self, device: torch.device, dtype: torch.dtype, head_dim: int = 128) -> None:
        """ValueError (with the way out) when these options cannot run on this device / dtype."""
        if self.quantization == "fp8":
            from worldserve.models.layers.fp8 import fp8_unavailable_reason

            if (reason := fp8_unavailable_reason(device, dtype)) is not None:
                raise ValueError(f"--quantization fp8: {reason}. Run without --quantization")
        wants_fa3 = (self.backend_name or "").upper() == "FLASH_ATTN"
        if wants_fa3 or self.fp8_attention:
            reason = fa3_unavailable_reason(device, dtype, head_dim)
            if reason is not None:
                flag = "--fp8-attention" if self.fp8_attention else f"{self.backend_source} FLASH_ATTN"
                raise ValueError(f"{flag}: {reason}")
        if self.fp8_attention and (self.backend_name or "auto").upper() in ("TORCH_SDPA", "CUDNN_ATTN"):
            raise ValueError(f"--fp8-attention runs on FlashAttention-3: drop {self.backend_source}")

    def load_device(self, device: torch.device) -> torch.device:
        """Where to load the weights for a model that will run on `device` (the CPU under layerwise offload)."""
        return torch.device("cpu") if self.layerwise_offload else device

    def apply(self, transformer: Cosmos3Transformer, device: torch.device | None = None) -> str:
        """Merge the adapter, quantise, offload, pick the attention kernel, compile; returns e.g.
        "fa3+compiled" for the logs.

        `device`: where the model runs (default: where it is; give it when it was loaded at load_device)."""
        device = transformer.device if device is None else torch.device(device)
        self.check(device, transformer.dtype, transformer.config.head_dim)
        if self.merged_lora is not None and self.merged_lora.active:
            from worldserve.runner.lora_cache import merge_lora

            merge_lora(transformer, self.merged_lora, device)  # (unless rounding would erase its deltas)
        merged = transformer.merged_lora is not None
        if self.quantization is not None:
            transformer.quantize_gen_fp8(emulate=self.quantization == "fp8-emulated", device=device)
        if self.layerwise_offload:
            transformer.enable_layerwise_offload(device)
        label = transformer.set_attention_backend(self.backend_name, fp8_attention=self.fp8_attention)
        if (self.backend_name or "").upper() == "CUDNN_ATTN" and device.type != "cuda":
            log.warning("%s CUDNN_ATTN: cuDNN attention runs on CUDA only; on %s PyTorch SDPA's own kernels "
                        "run", self.backend_source, device.type)  # fmt: skip
        parts = (
            [label] + (["lora-merged"] if merged else []) + ([self.quantization] if self.quantization else [])
        )
        parts += ["offload"] if self.layerwise_offload else []
        if self.compile and transformer.device.type == "cuda":
            transformer.compile_gen_layers()
            parts.append("compiled")
        return "+".join(parts)

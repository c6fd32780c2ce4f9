"""LoRA configuration (`LoraConfig`): whether requests may name adapters of their own (--enable-lora), the static
adapter of those that name none (--lora-path, --lora-scale), how many adapters stay loaded (--max-cpu-loras) and
the highest adapter rank the server takes (--max-lora-rank, vLLM's; unset: no bound).

A frozen dataclass of config.py's `EngineConfig` (`lora`), its flags generated as the others' are
(config_flags.py). The constructor validates without I/O; serve checks that --lora-path exists before the
model loads (`check_path`), checks the adapter against the checkpoint's config before the weights load, and
merges it into them as they load when it is the only adapter (`merged_lora`; commands/serve_backend.py).
"""

from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass, field

if typing.TYPE_CHECKING:
    from worldserve.params import LoraRequest

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""--max-lora-rank's values: vLLM's (vllm/config/lora.py MaxLoRARanks, the sizes of its rank-padded buffers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraConfig:
    enable_lora: bool = False
    """Let video and image requests name a LoRA adapter of their own in `lora` (a path on this server: a PEFT folder or a diffusers LoRA file), which replaces --lora-path's for that request (vLLM's flag; off: such a request is a 400 naming lora). Chat requests take no adapters."""
    lora_path: str | None = field(default=None, metadata={"metavar": "PATH"})
    """A LoRA adapter (a PEFT folder, or a diffusers LoRA file or its folder) every video and image request runs with unless it names its own (vLLM-Omni's flag; checked against the model before it loads). Without --enable-lora it is merged into the video weights as they load (no cost a step; unmerged it slows a step ~5 percent), each output row unless rounding into the weights would change more than 5 percent of its delta."""
    lora_scale: float | None = None
    """The scale of --lora-path's adapter (vLLM-Omni's flag); default: 1.0, 0 runs the base model."""
    max_lora_rank: int | None = field(default=None, metadata={"choices": MAX_LORA_RANKS, "metavar": "N"})
    """Refuse LoRA adapters with a module of a higher rank than N, one of 1, 8, 16, 32, 64, 128, 256, 320, 512 (vLLM's flag and values): a request naming one is a 400 naming lora ("LoRA rank R is greater than max_lora_rank N", vLLM's words), a --lora-path one stops the start. Unset, unlike vLLM's 16: no bound (adapters here are merged into the weights or applied as they are, with no buffers sized by a rank)."""
    max_cpu_loras: int = 4
    """LoRA adapters (at a scale) kept read in host memory between requests, least recently used dropped first (vLLM's flag); the GPU holds an adapter only while requests run with it (a rank-64 adapter of every linear of Cosmos3-Nano takes ~1 GB in bf16, fused q|k|v and gate|up B blocks included)."""

    def __post_init__(self) -> None:
        if self.max_cpu_loras < 1:
            raise ValueError(f"--max-cpu-loras must be >= 1, got {self.max_cpu_loras}")
        if self.max_lora_rank is not None and (
            type(self.max_lora_rank) is not int or self.max_lora_rank not in MAX_LORA_RANKS
        ):
            raise ValueError(f"--max-lora-rank must be one of {', '.join(map(str, MAX_LORA_RANKS))} (vLLM's "
                             f"values), got {self.max_lora_rank}")  # fmt: skip
        if self.lora_path == "":  # (`--lora-path "$ADAPTER"` with ADAPTER unset)
            raise ValueError("--lora-path: an empty path; give the adapter, or leave the flag out")
        if self.lora_scale is not None:
            if self.lora_path is None:
                raise ValueError("--lora-scale scales the --lora-path adapter: give --lora-path too (a request's "
                                 "own lora carries its own scale), or leave --lora-scale out")  # fmt: skip
            if not math.isfinite(self.lora_scale):
                raise ValueError(f"--lora-scale must be a finite number, got {self.lora_scale}")

    @property
    def static_lora(self) -> LoraRequest | None:
        """The adapter of requests that name none: --lora-path's (its absolute path: a job re-run after a
        restart from another folder finds it) as "static" at --lora-scale; None without --lora-path."""
        if self.lora_path is None:
            return None
        from worldserve.params import LoraRequest  # (params imports numpy: not at this module's import)

        scale = 1.0 if self.lora_scale is None else self.lora_scale
        return LoraRequest(name="static", path=os.path.abspath(self.lora_path), scale=scale)

    @property
    def merged_lora(self) -> LoraRequest | None:
        """The static adapter when it is the only one (no --enable-lora) and changes anything: merged into the
        gen pathway's weights as the model loads (KernelOptions.merged_lora), at no cost a step, unless
        rounding into the weights would erase some of its rows (runner/lora_cache.py MERGE_ERASURE_LIMIT)."""
        static = self.static_lora
        return static if static is not None and static.active and not self.enable_lora else None

    def check_path(self) -> None:
        """ValueError naming --lora-path when nothing is there (serve's startup, before the model loads)."""
        if self.lora_path is not None and not os.path.exists(self.lora_path):
            from worldserve.params import missing_adapter

            raise ValueError(f"--lora-path {self.lora_path}: {missing_adapter(self.lora_path)}")

"""Classifier-free guidance: the combine rule and the cond/uncond layout of a denoise batch.

Inputs: per-request velocities from the conditional (prompt) and unconditional (negative prompt) branches,
which see the same latents and timestep (cosmos3-model.md §5.5). Output: one guided velocity per request,
`v = v_uncond + g * (v_cond - v_uncond)`, applied jointly to video, sound and action velocities.
Rule (diffusers' Cosmos3 pipeline, `do_classifier_free_guidance = guidance_scale != 1.0`): a scale of
exactly 1.0 runs and returns only the conditional branch; any other scale (0 and < 1 included) runs both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def needs_uncond(scale: float) -> bool:
    """Whether the unconditional branch must run: `scale != 1.0`, exactly as diffusers decides."""
    return scale != 1.0


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`uncond + scale * (cond - uncond)` (diffusers' operation order); `cond` itself when scale == 1.0."""
    if not needs_uncond(scale):
        return cond
    if uncond is None:
        raise ValueError(f"guidance_scale={scale} needs the unconditional branch, but none was given")
    return uncond + scale * (cond - uncond)


@dataclass(frozen=True, slots=True)
class CfgBatchLayout:
    """Rows of one batched forward: every request's cond branch first (in request order), then the uncond
    branches of the requests whose scale needs one (in request order).

    Cond-first keeps rows [0, num_requests) identical whatever the guidance mix, so a batch where nobody
    needs CFG is simply the first half.
    """

    scales: tuple[float, ...]
    """Per-request guidance scale, in request order."""
    uncond_rows: tuple[int | None, ...]
    """Per request: the batch row of its uncond branch, or None when it runs cond only."""

    @classmethod
    def build(cls, scales: Sequence[float]) -> CfgBatchLayout:
        rows: list[int | None] = []
        next_row = len(scales)
        for scale in scales:
            rows.append(next_row if needs_uncond(scale) else None)
            next_row += needs_uncond(scale)
        return cls(scales=tuple(float(s) for s in scales), uncond_rows=tuple(rows))

    @property
    def num_requests(self) -> int:
        return len(self.scales)

    @property
    def num_rows(self) -> int:
        return self.num_requests + sum(r is not None for r in self.uncond_rows)

    def row_sources(self) -> list[tuple[int, bool]]:
        """(request index, is_cond) for each batch row, in row order: what to put in each row."""
        cond = [(i, True) for i in range(self.num_requests)]
        return cond + [(i, False) for i, r in enumerate(self.uncond_rows) if r is not None]

    def combine(self, outputs: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
        """Guided velocity per request from the per-row outputs (a list, or a tensor indexed on dim 0)."""
        if len(outputs) != self.num_rows:
            raise ValueError(f"expected {self.num_rows} branch outputs, got {len(outputs)}")
        return [
            cfg_combine(outputs[i], None if row is None else outputs[row], scale)
            for i, (scale, row) in enumerate(zip(self.scales, self.uncond_rows, strict=True))
        ]

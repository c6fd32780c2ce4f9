"""Classifier-free guidance: the combine rule and the cond/uncond layout of a denoise batch.

Inputs: per-request velocities from the conditional (prompt) and unconditional (negative prompt) branches,
which see the same latents and timestep (cosmos3-model.md §5.5). Output: one guided velocity per request,
`v = v_uncond + g * (v_cond - v_uncond)`, applied jointly to video, sound and action velocities.
Rule (diffusers' Cosmos3 pipeline, `do_classifier_free_guidance = guidance_scale != 1.0`): a scale of
exactly 1.0 runs and returns only the conditional branch; any other scale (0 and < 1 included) runs both,
at every step, or only at the steps whose timestep lies in a guidance interval (`guided_at`). A request's
branches sit next to each other in a batch, [cond, uncond] (runner/video_state.py `branch_items`).
"""

from __future__ import annotations

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


def guided_at(scale: float, interval: tuple[float, float] | None, timestep: float) -> bool:
    """Whether CFG runs at `timestep` (0..1000): the scale needs the uncond branch and, with a guidance
    interval [lo, hi] (vLLM-Omni's `guidance_interval`), lo <= timestep <= hi. Outside it a step runs the
    cond branch alone, as a scale of 1.0 would."""
    if not needs_uncond(scale):
        return False
    return interval is None or interval[0] <= float(timestep) <= interval[1]

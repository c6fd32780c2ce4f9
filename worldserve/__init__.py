"""worldserve: a serving engine for NVIDIA Cosmos3 omnimodal world models.

Glossary (used in every module):
- `und` / `gen`: the understanding (text, causal) and generation (diffusion tokens) pathways of the MoT.
- `latents`: (B, C, F, H, W) video latents; `tokens`: packed (N, D) rows.
- `request`, `step` (one denoising step), `plan` (what the engine asks the runner to do), `result`.

Public API: `VideoParams` / `ParamError` (per-request parameters), `VideoPipeline` (load a checkpoint and
generate; imported lazily because it pulls in torch), `resolve_model` (model reference -> folder).
"""

from __future__ import annotations

from typing import Any

from worldserve.params import ParamError, VideoParams

__version__ = "0.1.0"
__all__ = ["ParamError", "VideoParams", "VideoPipeline", "resolve_model", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "VideoPipeline":
        from worldserve.runner.video_pipeline import VideoPipeline

        return VideoPipeline
    if name == "resolve_model":
        from worldserve.weights.checkpoint import resolve_model

        return resolve_model
    raise AttributeError(f"module 'worldserve' has no attribute {name!r}")

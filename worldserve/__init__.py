"""worldserve: a serving engine for NVIDIA Cosmos3 omnimodal world models.

Glossary (used in every module):
- `und` / `gen`: the understanding (text, causal) and generation (diffusion tokens) pathways of the MoT.
- `latents`: (B, C, F, H, W) video latents; `tokens`: packed (N, D) rows.
- `request`, `step` (one denoising step), `plan` (what the engine asks the runner to do), `result`.

Public API: `VideoParams` / `ParamError` (per-request parameters; a bad one is a ParamError, a ValueError
naming the field), `VideoPipeline` (load a checkpoint and generate), `resolve_model` (model reference ->
folder; None: the embedded tiny checkpoint) and `CheckpointError` (what the last two raise for a bad model).
The last three import lazily: they pull in torch and huggingface_hub.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from worldserve.param_errors import ParamError
from worldserve.params import VideoParams

__version__ = "0.1.0"
_LAZY = {
    "VideoPipeline": "worldserve.runner.video_pipeline",
    "resolve_model": "worldserve.weights.checkpoint",
    "CheckpointError": "worldserve.weights.checkpoint",
}
__all__ = ["CheckpointError", "ParamError", "VideoParams", "VideoPipeline", "resolve_model", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'worldserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    # (the lazy names too: dir() and a REPL's completion had shown neither VideoPipeline nor resolve_model)
    return sorted({*globals(), *__all__})

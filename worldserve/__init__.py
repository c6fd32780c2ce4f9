"""worldserve: a serving engine for NVIDIA Cosmos3 omnimodal world models.

Glossary (used in every module):
- `und` / `gen`: the understanding (text, causal) and generation (diffusion tokens) pathways of the MoT.
- `latents`: (B, C, F, H, W) video latents; `tokens`: packed (N, D) rows.
- `request`, `step` (one denoising step), `plan` (what the engine asks the runner to do), `result`.

Public API: `Engine` (the model `worldserve serve` serves, in this process: `generate_video` -> `VideoOutput`,
`generate_image` -> `ImageOutput`s, `chat` -> `ChatOutput`, `stream_chat`, `get_metrics` -> its /metrics
families as worldserve.offline's `Counter` / `Gauge` / `Histogram`, vLLM's reader's records;
offline/engine.py), built from options or an `EngineConfig`; `VideoParams` / `ChatParams` / `ParamError`
(per-request parameters; a bad one is a ParamError, a ValueError naming the field), `VideoPipeline` (one
request at a time, frames and audio as arrays), `resolve_model` (model reference -> folder; None: the embedded
tiny checkpoint) and `CheckpointError` (what loading raises for a bad model). All but VideoParams and
ParamError import lazily: they pull in torch, huggingface_hub or the engine.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from worldserve.param_errors import ParamError
from worldserve.params import VideoParams

__version__ = "0.1.0"
_LAZY = {
    "Engine": "worldserve.offline.engine",
    "EngineConfig": "worldserve.config",
    "ChatParams": "worldserve.chat_params",
    "VideoOutput": "worldserve.offline.outputs",
    "ImageOutput": "worldserve.offline.outputs",
    "ChatOutput": "worldserve.offline.outputs",
    "ChatChoice": "worldserve.offline.outputs",
    "VideoPipeline": "worldserve.runner.video_pipeline",
    "resolve_model": "worldserve.weights.checkpoint",
    "CheckpointError": "worldserve.weights.checkpoint",
}
__all__ = [
    "ChatChoice", "ChatOutput", "ChatParams", "CheckpointError", "Engine", "EngineConfig", "ImageOutput", "ParamError", "VideoOutput", "VideoParams",
    "VideoPipeline", "resolve_model", "__version__",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'worldserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    # (the lazy names too: dir() and a REPL's completion had shown neither VideoPipeline nor resolve_model)
    return sorted({*globals(), *__all__})

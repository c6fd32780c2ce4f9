"""The offline Python API: `Engine` (offline/engine.py) runs the model `worldserve serve` serves in this
process, for videos (`generate_video` -> `VideoOutput`), text-to-image (`generate_image` -> `ImageOutput`s)
and Reasoner chats (`chat` -> `ChatOutput`, `stream_chat`), as vLLM's `LLM` does for its models;
`get_metrics()` returns its /metrics families as the records of vLLM's metrics reader (`Counter`, `Gauge`,
`Histogram`, `Vector`: offline/metrics.py). `worldserve.Engine` is this one (imported lazily there: it pulls
in torch)."""

from __future__ import annotations

from worldserve.offline.engine import Engine
from worldserve.offline.metrics import Counter, Gauge, Histogram, Metric, Vector
from worldserve.offline.outputs import ChatChoice, ChatOutput, ChatUsage, ImageOutput, VideoOutput

__all__ = [
    "ChatChoice", "ChatOutput", "ChatUsage", "Counter", "Engine", "Gauge", "Histogram", "ImageOutput", "Metric",
    "Vector", "VideoOutput",
]  # fmt: skip

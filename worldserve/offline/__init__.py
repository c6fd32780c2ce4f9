"""The offline Python API: `Engine` (offline/engine.py) runs the model `worldserve serve` serves in this
process, for videos (`generate_video` -> `VideoOutput`) and Reasoner chats (`chat` -> `ChatOutput`,
`stream_chat`), as vLLM's `LLM` does for its models. `worldserve.Engine` is this one (imported lazily there:
it pulls in torch)."""

from __future__ import annotations

from worldserve.offline.engine import Engine
from worldserve.offline.outputs import ChatChoice, ChatOutput, ChatUsage, VideoOutput

__all__ = ["ChatChoice", "ChatOutput", "ChatUsage", "Engine", "VideoOutput"]

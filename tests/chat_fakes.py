"""Bases of the tests' scripted chat backends and sessions: the ChatBackend / ChatSession members
(engine/outputs.py) that a scripted one leaves at their neutral values (no context bound, vLLM's neutral
sampling defaults, no prompt builder, grammars, media or prefix cache; nothing cached, nothing preempted)."""

from __future__ import annotations

from worldserve.sampling.chat_defaults import NEUTRAL


class ScriptedChatBackend:
    max_model_len = None
    sampling_defaults = NEUTRAL
    prompts = None
    grammars = None
    media_cache = None
    concurrent_with_video = False
    prefix_cache_counts = None
    preemptions = 0

    def kv_cache_usage(self) -> float:
        return 0.0


class ScriptedChatSession:
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs = None
    cached_tokens = 0
    preempted = False

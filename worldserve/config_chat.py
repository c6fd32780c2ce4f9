"""Reasoner configuration: the chat model's own settings (`ReasonerConfig`: context, K/V cache, prefix and
processor caches, SM sharing with video steps, sampling defaults, chat template) and the chat API's answer
shaping (`ChatApiConfig`: reasoning split, usage details, role, token ids, request seeds, stored Responses).

Both are frozen dataclasses of config.py's `EngineConfig` (`reasoner`, `chat`) and generate their flags the same
way (config_flags.py): the field's name is the flag, its docstring the --help text, its default the flag's.
Constructors validate; `ReasonerConfig` reads --chat-template's file (the one read of a config constructor,
checked before the model loads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from worldserve.config_values import HumanInt, JsonObject, TokenCount


@dataclass(frozen=True, slots=True, kw_only=True)
class ReasonerConfig:
    max_model_len: TokenCount = TokenCount()  # 32768
    """Context length of Reasoner chat completions (prompt + completion tokens; vLLM's 32k = 32000, 32K = 32768; auto or -1: 32768)."""
    kv_cache_memory_bytes: HumanInt | None = None
    """Bytes of the Reasoner's paged K/V cache, shared by all chats (at least --max-model-len tokens; 144 KiB a token on Cosmos3-Nano); default: room for 2 x --max-model-len tokens (1 x under --enable-layerwise-offload)."""
    enable_prefix_caching: bool = True
    """Reuse the K/V of prompt prefixes seen before (vLLM's automatic prefix caching, on by default as there): a chat whose first 64-token blocks match an earlier chat's (same tokens, images and videos) prefills only the rest; --no-enable-prefix-caching turns it off."""
    mm_processor_cache_gb: float = 4.0
    """GiB of host memory for recently processed chat images and videos, by content (vLLM's flag and default): the same image or video again (a conversation's next turn) is not decoded, resized or hashed again; 0 turns it off."""
    chat_sm_margin: int = 16
    """SMs a video step's FlashAttention-3 kernels leave free while Reasoner chats are live, so that they keep decoding beside it on one CUDA GPU (runner/chat_share.py; 8 chats beside a 720p step on an H200: 0 gives ~4 tokens/s a chat at full video speed, 16 ~26 tokens/s with the video step 1.10x as long, 32 ~57 tokens/s at 1.24x)."""
    generation_config: str = "auto"
    """Where Reasoner requests' omitted sampling fields (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens) get their values (vLLM's flag): auto, the model folder's generation_config.json when it has one; vllm, vLLM's neutral defaults (1.0, 1.0, off, 0, 1.0, up to the context); or a folder holding a generation_config.json (its max_new_tokens then bounds every request)."""
    override_generation_config: JsonObject | None = None
    """Generation config values laid over --generation-config's, a JSON object such as '{"temperature": 0.5}' (vLLM's flag; a max_new_tokens here bounds every request's completion)."""
    chat_template: str | None = field(default=None, metadata={"metavar": "PATH|TEMPLATE"})
    """The Reasoner's chat template instead of the checkpoint's (vLLM's flag): a file, or the Jinja template itself in one line (a text with {, } or a newline; backslash escapes such as \\n decoded); checked before the model loads. For images and videos it must write Qwen3-VL's vision placeholders as the checkpoint's does."""
    chat_template_text: str | None = field(default=None, repr=False, metadata={"no_flag": True})
    """--chat-template's template, read from its file or its text (set by __post_init__, from the flag's value)."""

    def __post_init__(self) -> None:
        if self.chat_template is not None:  # (a replace() reads the flag's file or text again: the same)
            from worldserve.runner.chat_template import load_chat_template

            object.__setattr__(self, "chat_template_text", load_chat_template(self.chat_template))
        if not self.generation_config:  # (`--generation-config "$DIR"` with DIR unset)
            raise ValueError("--generation-config: empty; give auto, vllm or a folder holding a "
                             "generation_config.json")  # fmt: skip
        if self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if not 0 <= self.chat_sm_margin <= 64:
            raise ValueError(f"--chat-sm-margin must be between 0 and 64 SMs, got {self.chat_sm_margin}")
        if not (math.isfinite(self.mm_processor_cache_gb) and self.mm_processor_cache_gb >= 0):
            raise ValueError(
                f"--mm-processor-cache-gb must be a number >= 0, got {self.mm_processor_cache_gb}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"--kv-cache-memory-bytes must be > 0, got {self.kv_cache_memory_bytes}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatApiConfig:
    default_chat_template_kwargs: JsonObject | None = None
    """Chat template variables that every chat request's own chat_template_kwargs lay over, key by key (vLLM's flag): e.g. '{"enable_thinking": false}'; the chat, Responses and /tokenize (chat form) routes and the offline Engine's chats."""
    enable_prompt_tokens_details: bool = False
    """Chat and text completions' usage carries prompt_tokens_details.cached_tokens, the prompt tokens found in the Reasoner's prefix cache (vLLM's flag; the Responses API always reports them)."""
    reasoning_parser: str | None = field(default=None, metadata={"choices": ("qwen3",)})
    """Split an answer that opens with <think> into reasoning_content (the thoughts) and content (the text after </think>), as vLLM's qwen3 parser; an answer without <think> stays all content (default: every answer is content)."""
    seed: int | None = None
    """Seed of the sequence Reasoner requests without a seed (chats, text completions, Responses) take theirs from, in arrival order, so that a restarted server answers the same requests sent in the same order the same way (vLLM's flag); default: random seeds. Videos without a seed keep Cosmos3's 42 (--default-sampling-params sets another)."""
    response_role: str = "assistant"
    """The role of chat answers after a generation prompt (vLLM's flag; with add_generation_prompt false an answer takes the last message's role, as vLLM's)."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name their tokens "token_id:<id>" for every chat and text completion that does not say otherwise in its own return_tokens_as_token_ids (vLLM's flag: for tokens that are no valid text)."""
    enable_force_include_usage: bool = False
    """Every streamed chat and text completion carries usage, in each chunk and in a final usage chunk, whatever its stream_options say (vLLM's flag)."""
    responses_store_mb: float = 256.0
    """Memory for stored Responses API responses (`store`, for previous_response_id and GET /v1/responses/{id}), in MiB; the least recently used go first past it; 0: none stored."""

    def __post_init__(self) -> None:
        if self.seed is not None:
            from worldserve.params import INT64

            if not -INT64 <= self.seed < INT64:
                raise ValueError(f"--seed must be in [-2**63, 2**63) (int64), got {self.seed}")
        if not self.response_role.strip():
            raise ValueError("--response-role: an empty role; give one, such as assistant")
        if not (math.isfinite(self.responses_store_mb) and self.responses_store_mb >= 0):
            raise ValueError("--responses-store-mb must be >= 0")

"""Wire shapes of POST /v1/completions, POST /tokenize and POST /detokenize (pydantic v2), as vLLM writes them.

Completions request: `prompt` (a string, a list of strings, a list of token ids or a list of lists of ids:
one set of `n` choices per prompt; at most VLLM_MAX_COMPLETION_PROMPTS of them), `max_tokens` (vLLM's default 16, also for null), the chat's
sampling fields (`temperature`, `top_p`, `top_k`, `seed`, `n`, `stop`, penalties and vLLM's token rules: see
api/sampling_request.py SamplingRequest), `logprobs` (an int:
that many alternatives per position, 0 to 20), `echo`, `stream` / `stream_options`, vLLM's
`add_special_tokens` (default true); `echo` with `logprobs`, and vLLM's `prompt_logprobs`, score the prompt
too; structured outputs as the chat's (`response_format`, `structured_outputs`, `guided_*`). `suffix` and
a `best_of` other than `n` are refused with a 400 naming the field (`refused`), as is vLLM's
`prompt_embeds` (vLLM too refuses it unless served with --enable-prompt-embeds); other unknown fields are
ignored, as vLLM ignores them.
Responses: `text_completion` objects (`choices[i].text`, legacy `logprobs` {tokens, token_logprobs,
top_logprobs, text_offset}), the same object per SSE chunk, and the /tokenize {count, max_model_len, tokens,
token_strs} and /detokenize {prompt} answers. The /tokenize chat form takes a chat's messages, media and
template options (handed to the chat's own checks as a chat completion request: `as_chat`) plus vLLM's
template switches (`add_generation_prompt`, `continue_final_message`, `add_special_tokens`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from worldserve import envs
from worldserve.api.chat import MAX_CHOICES
from worldserve.api.chat_protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    PromptLogprob,
    SSEChunk,
    Usage,
)  # fmt: skip
from worldserve.api.sampling_request import SamplingRequest
from worldserve.api.tool_calls import ToolIn

MAX_LOGPROBS = 20
"""vLLM's default --max-logprobs."""


class CompletionRequest(SamplingRequest):
    prompt_embeds: Any = Field(None, description="Refused: vLLM takes it only with --enable-prompt-embeds.")
    """Declared ahead of `prompt` so that a body of embeddings alone is told of them first, not of a missing
    prompt (pydantic reports errors in field order)."""
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text used as it is (no chat template), token ids, or a list of either (a choice set each)."
    )
    max_tokens: int = Field(
        16, ge=0, description="vLLM's default 16 (null too, as vLLM); 0 with `echo`: the prompt's text alone."
    )
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = Field(True, description="The tokenizer's special tokens (e.g. BOS) on text.")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: each prompt token's log-probability with this many alternatives (`choices[i].prompt_logprobs`)."""

    @field_validator("prompt_embeds")
    @classmethod
    def _no_prompt_embeds(cls, value: Any) -> Any:
        """vLLM refuses `prompt_embeds` unless served with --enable-prompt-embeds; this server has no such
        mode (the Reasoner's embeddings are its own tower's), so any value but null is a 400 naming it."""
        if value is not None:
            raise ValueError(
                "prompt_embeds is not supported by this server: send `prompt` as text or token ids"
            )
        return value

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any) -> Any:
        """vLLM's normalize_null_max_tokens: an explicit null is the default 16 (it had meant up to the
        context, which a client sending its SDK's null by accident did not ask for)."""
        return 16 if value is None else value

    def refused(self) -> tuple[str, str] | None:
        """(field, why) of the first option this server cannot honour, else None (the streaming rules, vLLM's
        request validators, are refused_streaming's)."""
        if not 1 <= self.n <= MAX_CHOICES:
            return "n", f"n must be between 1 and {MAX_CHOICES}, got {self.n}"
        limit = envs.max_completion_prompts()
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int) \
                and len(self.prompt) > limit:  # fmt: skip
            return "prompt", (f"prompt list length {len(self.prompt)} exceeds the maximum allowed count of "
                              f"{limit}. To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS "
                              "environment variable.")  # fmt: skip
        if self.suffix is not None:
            return "suffix", "suffix is not supported by this server (no fill-in-the-middle)"
        if self.best_of is not None and self.best_of != self.n:
            return (
                "best_of",
                f"best_of must equal n ({self.n}) or be omitted: this server returns every sample",
            )
        if (refused := self.refused_sampling()) is not None:
            return refused
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens must be at least 1, got 0 (0 only echoes the prompt: set echo)"
        return None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy per-token log-probabilities."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """vLLM's, with `prompt_logprobs`: per prompt token (the first None) its entry and the top ones, by id."""
    prompt_token_ids: list[int] | None = None
    """vLLM's, with return_token_ids: the prompt's token ids (a stream: in the choice's first chunk)."""
    token_ids: list[int] | None = None
    """vLLM's, with return_token_ids: the sampled token ids (a stream: each chunk's own)."""


class CompletionResponse(SSEChunk, BaseModel):
    """The whole answer, and each SSE chunk (`sse()`: usage only when set)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TokenizePromptRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """The chat form: a chat's messages and prompt options (checked as chat checks them: `as_chat`), and
    vLLM's template switches."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    """Refused (a 400), as vLLM refuses a request's own template by default."""
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    tools: list[ToolIn] | None = None
    """Function tools, rendered into the prompt as a chat with them would have them."""

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion request of the same messages and options (for the chat's build_params)."""
        fields = ("model", "messages", "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs", "tools",
                  "add_generation_prompt", "continue_final_message")  # fmt: skip
        return ChatCompletionRequest.model_construct(**{f: getattr(self, f) for f in fields})


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str

"""Wire shapes of POST /v1/chat/completions (pydantic v2), the subset of serving-api.md §11.2 we serve.

Request: `model`, `messages` (api/chat_messages.py: string content or parts: text, image_url, video_url
with `{"url": U}` or the bare-string shorthand, and vLLM's other spellings of them), `max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
`n` (1 to 16), `stop`, `stream`, `stream_options`, `presence_penalty` / `frequency_penalty` /
`repetition_penalty`, vLLM's `min_p`, `logit_bias`, `allowed_token_ids`, `bad_words`, `skip_special_tokens`,
`ignore_eos`, `min_tokens`, `stop_token_ids`, `include_stop_str_in_output` (`use_beam_search` refused),
`continue_final_message` / `add_generation_prompt` (chat), `logprobs` / `top_logprobs` (raw-logit
log-probabilities, as vLLM's default),
`media_io_kwargs` (video sampling), `mm_processor_kwargs` (Qwen3-VL processor pixel budgets and video
sampling: api/chat_options.py checks them), `chat_template_kwargs` (extra chat template variables, e.g.
`enable_thinking`; api/chat_options.py refuses apply_chat_template's own arguments), structured
outputs (`response_format` json_object / json_schema / structural_tag, `structured_outputs` and vLLM's older
`guided_*` fields: api/structured_fields.py reads them), `tools` / `tool_choice` and messages' `tool_calls` /
`tool_call_id` (api/tool_calls.py), an assistant message's `reasoning` (its earlier thoughts, passed to the
chat template). The legacy `functions` / `function_call` are refused with a 400 naming
the field (vLLM has them no more; never silently dropped); other unknown fields are ignored, as vLLM ignores
them.
Responses: the non-streaming `chat.completion` object and the `chat.completion.chunk` SSE events, field for
field as vLLM writes them. The fields chat and text completions share (sampling, streaming, structured
outputs) are api/sampling_request.py's SamplingRequest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, Field

from worldserve.api.chat_messages import ChatMessageIn
from worldserve.api.sampling_request import SamplingRequest
from worldserve.api.tool_calls import ToolCallOut, ToolIn

TOOLLESS_CHOICES = (None, "none", "auto")
"""Legacy `function_call` values that call nothing (any other is refused: the request should send tools)."""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    """vLLM's: each prompt token's log-probability with this many alternatives (not with `stream`)."""
    tools: list[ToolIn] | None = None
    # typed Any: a wrong value gets the 400 naming the field (api/tool_calls.py tool_mode)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    """Accepted as vLLM accepts it: the model may answer several calls either way."""
    functions: list[Any] | None = None
    """The legacy form of `tools`: refused (vLLM no longer takes it)."""
    function_call: Any = None
    media_io_kwargs: dict[str, Any] | None = Field(
        None,
        description='Per-request media loading, e.g. {"video": {"fps": 4.0}} or {"video": {"num_frames": 16}}.',
    )
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None,
        description='Qwen3-VL processor options: {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": '
        'MAX_PIXELS}} (images and videos), "min_pixels" / "max_pixels" (images), "fps" / "num_frames" '
        '(videos), or the same per modality under "images_kwargs" / "videos_kwargs".',
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description='Extra variables for the chat template, e.g. {"enable_thinking": false} for Qwen3-style '
        "templates (a key the template does not use changes nothing).",
    )
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="vLLM's: continue the last (assistant) message.")
    echo: bool = Field(
        False, description="vLLM's: the answer starts with the last message when it is the assistant's."
    )
    chat_template: str | None = Field(None, description="Refused (a 400), as vLLM refuses it by default.")
    include_reasoning: bool = Field(
        True,
        description="vLLM's: with --reasoning-parser, false leaves the reasoning out (and, as vLLM does, the "
        "logprobs, which would show its tokens).",
    )

    def echo_text(self, role: str) -> str:
        """vLLM's chat echo: the last message's text when its role is the answer's `role` (else ""): an
        assistant message continued, or any last message without add_generation_prompt (the answer then
        takes its role)."""
        last = self.messages[-1]
        if not self.echo or last.role != role or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(p.text or "" for p in last.content if p.type == "text")

    def unsupported(self) -> str | None:
        """The legacy function-calling field set, if any (answered with a 400: send `tools`)."""
        if self.functions:
            return "functions"
        return "function_call" if self.function_call not in TOOLLESS_CHOICES else None


UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. Refused request with "
    "untrusted chat template."
)
"""vLLM's refusal of a request's own `chat_template` (this server renders the checkpoint's template only)."""


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens whose K/V came from the prefix cache."""


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int
    """Completion tokens of the thoughts (--reasoning-parser), summed over the choices."""


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    """With --enable-prompt-tokens-details (vLLM's flag), else null."""
    completion_tokens_details: CompletionTokensDetails | None = None
    """A chat's, with --reasoning-parser (as vLLM reports it): null otherwise. In a stream, what is null is
    left out of the final usage chunk (SSEChunk)."""


class AssistantMessage(BaseModel):
    role: str = "assistant"
    """--response-role (after a generation prompt), else the last message's role, as vLLM answers."""
    content: str | None
    reasoning: str | None = None
    """The thoughts (--reasoning-parser): vLLM's name since v0.11.1 (the only one since early 2026) ..."""
    reasoning_content: str | None = None
    """... and the same text under its older name (vLLM up to v0.11, DeepSeek's), for the clients of either."""
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    """vLLM's, with return_token_ids: the sampled token ids (the ending one too)."""


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's log-probability at a prompt position, its rank there and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    """vLLM's, with `prompt_logprobs`: per prompt token (the first None) its entry and the top ones, by id."""
    prompt_token_ids: list[int] | None = None
    """vLLM's, with return_token_ids: the rendered prompt's token ids."""


class ChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]
    """{"role": "assistant", "content": ""} first, then {"content": piece}, {"tool_calls": [...]} or the
    thoughts as {"reasoning": piece, "reasoning_content": piece} (both names, as AssistantMessage), {} on the
    final chunk."""
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """vLLM's, on the final chunk only (set there, left out of the others): the matched stop string or stop
    token id."""
    token_ids: list[int] | None = None
    """vLLM's, with return_token_ids (left out without): the token ids this chunk's text came from."""


class _Chunk(Protocol):
    """What SSEChunk.sse reads of the pydantic chunk it is mixed into."""

    UNLESS_SET: ClassVar[tuple[str, ...]]

    @property
    def model_fields_set(self) -> set[str]: ...

    @property
    def usage(self) -> Usage | None: ...

    @property
    def choices(self) -> Sequence[BaseModel]: ...

    def model_dump_json(self, *, exclude: Any = None) -> str: ...


class SSEChunk:
    UNLESS_SET: ClassVar[tuple[str, ...]] = ()
    """Top-level fields left out unless set (vLLM's prompt_token_ids, in a stream's first chunk only)."""

    """Mixin of the streamed chunks (chat and text completions): `sse()` writes the fields vLLM's chunks carry.
    vLLM dumps a chunk with exclude_unset (a field it did not set is left out, one it set to None is null) and
    its final usage chunk with exclude_none too. So a chunk's choices and usage leave out the fields their
    makers did not set (api/chat_stream.py and api/completions_stream.py set those vLLM sets), `usage` is
    left out unless set, and the final usage chunk (no choices) has no null field. Their other values are
    written whole (vLLM builds them whole)."""

    def sse(self: _Chunk) -> str:
        """`data: <json>\\n\\n`."""
        exclude: dict[Any, Any] = {
            name: True for name in self.UNLESS_SET if name not in self.model_fields_set
        }
        if self.usage is None:
            exclude["usage"] = True
        elif gone := unset_fields(self.usage) | (set() if self.choices else null_fields(self.usage)):
            exclude["usage"] = gone
        if choices := {i: gone for i, c in enumerate(self.choices) if (gone := unset_fields(c))}:
            exclude["choices"] = choices
        return f"data: {self.model_dump_json(exclude=exclude or None)}\n\n"


def unset_fields(model: BaseModel) -> set[str]:
    """The fields of `model` its maker did not set (pydantic's exclude_unset)."""
    return set(type(model).model_fields) - model.model_fields_set


def null_fields(model: BaseModel) -> set[str]:
    """The fields of `model` that are None (pydantic's exclude_none, one level)."""
    return {name for name in type(model).model_fields if getattr(model, name) is None}


class ChatCompletionChunk(SSEChunk, BaseModel):
    UNLESS_SET: ClassVar[tuple[str, ...]] = ("prompt_token_ids",)
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None

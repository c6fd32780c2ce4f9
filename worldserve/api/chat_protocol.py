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
field as vLLM writes them.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from worldserve.api.chat_messages import ChatMessageIn
from worldserve.api.tool_calls import ToolCallOut, ToolIn
from worldserve.params import INT64, ParamError
from worldserve.sampling.chat_defaults import NEUTRAL, ChatDefaults

TOOLLESS_CHOICES = (None, "none", "auto")
"""Legacy `function_call` values that call nothing (any other is refused: the request should send tools)."""


class NullsAsDefaults(BaseModel):
    """A model whose NULLABLE fields take their default when sent as JSON null: OpenAI's spec and vLLM declare
    them `T | None` with a default, and clients (wrappers passing every argument) send nulls."""

    NULLABLE: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _nulls_as_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in cls.NULLABLE):
            return {k: v for k, v in data.items() if v is not None or k not in cls.NULLABLE}
        return data


class StreamOptions(NullsAsDefaults):
    model_config = ConfigDict(extra="ignore")
    NULLABLE = frozenset(("include_usage", "continuous_usage_stats"))
    include_usage: bool = False
    """Send one more chunk after the choices, with no choices and the request's usage."""
    continuous_usage_stats: bool = False
    """With include_usage (else ignored, as vLLM does): every chunk carries the usage so far."""


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias as (token id, bias) pairs, each bias clamped to [-100, 100] (vLLM's rule);
    ParamError("logit_bias") for a key that is not a token id or a bias that is not finite."""
    out = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ParamError("logit_bias", f"logit_bias keys are token ids, got {key!r}") from None
        if not math.isfinite(value):
            raise ParamError("logit_bias", f"logit_bias values must be finite numbers, got {value} for {key}")
        out.append((token, min(100.0, max(-100.0, value))))
    return tuple(out)


class SamplingRequest(NullsAsDefaults):
    """The request fields chat and text completions (api/completions_protocol.py) share: the model, sampling,
    streaming, and structured outputs (api/structured_fields.py reads them). `n`, `stream` and `echo` sent as
    null take their defaults, as in vLLM."""

    model_config = ConfigDict(extra="ignore")
    NULLABLE = frozenset(("n", "stream", "echo"))

    model: str | None = Field(None, description="Must equal the served model name when given.")
    temperature: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Default 1.0; above 2 too, as vLLM takes it (OpenAI caps at 2).",
    )
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    """OpenAI's: token id (as a string) -> a bias added to its logit, clamped to [-100, 100] as vLLM does."""
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    """vLLM's beam search: refused (this server samples)."""
    priority: int = 0
    """vLLM's request priority: only 0, as vLLM's default first-come-first-served scheduler takes."""
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    """vLLM's: keep only the prompt's last this-many tokens (-1: max_model_len); a prompt of text or token ids,
    not one with images or videos."""
    return_token_ids: bool | None = None
    """vLLM's: the prompt's and each choice's token ids beside the text (`prompt_token_ids`, `token_ids`;
    streamed: the prompt's in the first chunk, each chunk's own sampled ids)."""
    return_tokens_as_token_ids: bool | None = None
    """vLLM's: logprobs name their tokens as "token_id:<id>" strings (for tokens that are no valid text)."""
    cache_salt: str | None = None
    """vLLM's: only requests with the same salt share cached prompt blocks (non-empty)."""
    request_id: str | None = None
    """vLLM's: the answer's id is `chatcmpl-<request_id>` (`cmpl-` for text); an X-Request-Id header wins."""
    user: str | None = None
    """OpenAI's end-user id: typed as there (a number is a 400, as in vLLM), not used."""
    # structured outputs (vLLM extensions); typed Any so that a wrong value gets the 400 naming the field
    # (api/structured_fields.py) rather than pydantic's validation error
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structural_tag: Any = None
    guided_whitespace_pattern: Any = None

    def sampling_options(self, defaults: ChatDefaults = NEUTRAL) -> dict[str, Any]:
        """The ChatParams sampling fields of this request, `defaults`' (--generation-config) for those it
        leaves out."""
        pick = lambda value, default: default if value is None else value  # noqa: E731
        return {
            "temperature": pick(self.temperature, defaults.temperature), "top_p": pick(self.top_p, defaults.top_p),
            "top_k": pick(self.top_k, defaults.top_k),
            "seed": self.seed, "stop": (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            "presence_penalty": pick(self.presence_penalty, 0.0),
            "frequency_penalty": pick(self.frequency_penalty, 0.0),
            "repetition_penalty": pick(self.repetition_penalty, defaults.repetition_penalty),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "stop_token_ids": tuple(self.stop_token_ids or ()),
            "include_stop_str_in_output": self.include_stop_str_in_output, "min_p": pick(self.min_p, defaults.min_p),
            "logit_bias": logit_bias(self.logit_bias), "bad_words": tuple(self.bad_words or ()),
            "allowed_token_ids": None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            "skip_special_tokens": self.skip_special_tokens, "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "return_token_ids": bool(self.return_token_ids), "cache_salt": self.cache_salt,
        }  # fmt: skip

    def answer_id(self, prefix: str, header: str | None) -> str:
        """`<prefix>-<id>`, the id an X-Request-Id `header` gives, else `request_id`, else a random one (vLLM's
        `_base_request_id`: a gateway joins its trace to the answer)."""
        return f"{prefix}-{header or self.request_id or uuid.uuid4().hex}"

    def refused_sampling(self) -> tuple[str, str] | None:
        """(field, why) of a sampling option this server refuses: vLLM's beam search (it samples), a priority
        other than 0 (chats are admitted first come, first served)."""
        if self.use_beam_search:
            return "use_beam_search", "use_beam_search is not supported: this server samples"
        if self.priority != 0:  # vLLM's words (its processor), under its default --scheduling-policy fcfs
            return "priority", f"Got priority {self.priority} but Priority scheduling is not enabled."
        return None

    def text_bound(self, max_model_len: int | None) -> int | None:
        """The token count a prompt's byte size is checked against before tokenizing: max_model_len (None:
        unbounded), or None with truncate_prompt_tokens (the prompt may be longer: only its end is kept)."""
        return max_model_len if self.truncate_prompt_tokens is None else None

    def refused_streaming(self, prompt_logprobs: int | None = None) -> tuple[str, str] | None:
        """(field, why) where the request breaks vLLM's streaming rules (its request validators): non-empty
        stream_options only with stream=true; the request's `prompt_logprobs` above 0 not with stream=true
        (0 is taken, and its rows are not sent, as no vLLM chunk carries them: `prompt_logprobs_wanted`)."""
        opts = self.stream_options
        if not self.stream and opts is not None and bool(opts.model_fields_set):
            return "stream_options", "Stream options can only be defined when `stream=True`."
        if self.stream and prompt_logprobs:
            return "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."
        return None

    def prompt_logprobs_wanted(self, prompt_logprobs: int | None) -> int | None:
        """The request's `prompt_logprobs` as computed: None when streamed (only 0 passes refused_streaming, and
        vLLM's chunks carry no prompt logprobs, so nothing is computed for them)."""
        return None if self.stream else prompt_logprobs

    def stream_usage(self, forced: bool = False) -> tuple[bool, bool]:
        """(include_usage, continuous_usage_stats) as vLLM applies them: continuous needs include_usage; both
        when `forced` (--enable-force-include-usage)."""
        if forced:
            return True, True
        opts = self.stream_options
        include = bool(opts and opts.include_usage)
        return include, include and bool(opts and opts.continuous_usage_stats)


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

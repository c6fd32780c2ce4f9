"""The request fields chat and text completions share (pydantic v2): the model, sampling, streaming, token-id
and structured-output options, and what the routes ask of them.

`SamplingRequest` is the base of the chat request (api/chat_protocol.py ChatCompletionRequest) and of the text
completion request (api/completions_protocol.py CompletionRequest): `sampling_options` gives its ChatParams
sampling fields (with --generation-config's defaults for those it omits), `answer_id` the answer's id,
`refused_sampling` / `refused_streaming` the options vLLM refuses, `stream_usage` the usage a stream carries.
`NullsAsDefaults` makes the fields OpenAI's spec declares nullable take their defaults when sent as null;
`logit_bias` reads OpenAI's bias map as vLLM clamps it.
"""

from __future__ import annotations

import math
import uuid
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from worldserve.params import INT64, ParamError
from worldserve.sampling.chat_defaults import NEUTRAL, ChatDefaults


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

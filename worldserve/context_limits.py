"""vLLM's context-length refusals, worded once for every caller: the API routes (api/context_fit.py) and the
Reasoner's own budget check (runner/chat_prompt.py `completion_budget`, reached by /v1/responses, in-process
and CLI callers).

vLLM checks a request against the context in its renderer (vllm/renderers/params.py TokenizeParams) and
raises VLLMValidationError, whose text ends with "(parameter=<name>, value=<value>)"; the API answers a 400
BadRequestError whose `param` is that name. Each function here returns the refusal (`ContextRefusal`: the
param and the whole text) or None when the request fits; the caller raises it as its own error type:

- `output_budget_refusal`: a completion budget larger than the whole context, "max_tokens=N cannot be greater
  than max_model_len=max_total_tokens=L. Please request fewer output tokens." (the field the client sent:
  max_tokens, max_completion_tokens, or the Responses API's max_output_tokens);
- `prompt_fit_refusal`: a prompt and budget that do not fit together, "This model's maximum context length is
  L tokens. However, you requested M output tokens and your prompt contains N input tokens, for a total of
  N+M tokens. ..." (param input_tokens);
- `no_room_refusal`: a prompt that fills the context with no budget sent: vLLM defaults max_tokens to the
  room left, 0, which its SamplingParams refuse ("max_tokens must be at least 1, got 0.");
- `text_size_refusal`: vLLM's pre-tokenization size check ("your prompt contains C characters (more than X
  characters, which is the upper bound for Y input tokens)"); worldserve's bound counts UTF-8 bytes
  (models/cosmos3/prompt.py TextSizeBound), so the message says bytes, and names the field holding the text.
Only stdlib: the runner must not import api/, and api/ must not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ContextRefusal:
    """A request refused for the context, as vLLM words it."""

    param: str
    """The field the refusal names (the error JSON's `param`)."""
    message: str
    """The whole text, vLLM's "(parameter=..., value=...)" suffix included."""


def shown(value: int) -> str:
    """An int as vLLM's f-string prints it; past Python's int-to-text limit (4,300 digits, which a JSON body
    may reach) its size instead (printing it raised a 500)."""
    try:
        return str(value)
    except ValueError:
        return "more than 10^4300"


def _refusal(message: str, parameter: str, value: int) -> ContextRefusal:
    """vLLM's VLLMValidationError text: the message with the parameter and value appended."""
    return ContextRefusal(parameter, f"{message} (parameter={parameter}, value={shown(value)})")


def output_budget_refusal(
    max_tokens: int | None, field: str, max_model_len: int | None
) -> ContextRefusal | None:
    """The refusal of a completion budget `max_tokens` (as sent in `field`) larger than the whole context
    `max_model_len` (None: unbounded), else None."""
    if max_tokens is None or max_model_len is None or max_tokens <= max_model_len:
        return None
    return _refusal(
        f"{field}={shown(max_tokens)} cannot be greater than max_model_len=max_total_tokens={max_model_len}. "
        "Please request fewer output tokens.",
        field,
        max_tokens,
    )


def prompt_fit_refusal(
    prompt_tokens: int, max_tokens: int | None, max_model_len: int | None
) -> ContextRefusal | None:
    """The refusal of a prompt of `prompt_tokens` tokens and a completion budget `max_tokens` (None: none sent,
    counted 0 as vLLM counts it) past `max_model_len` together, else None."""
    if max_model_len is None:
        return None
    output = max_tokens or 0
    if prompt_tokens + output <= max_model_len:
        return None
    return _refusal(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{shown(output)} output tokens and your prompt contains {prompt_tokens} input tokens, for a total of "
        f"{shown(prompt_tokens + output)} tokens. Please reduce the length of the input prompt or the number "
        "of requested output tokens.",
        "input_tokens",
        prompt_tokens,
    )


def no_room_refusal(field: str = "max_tokens") -> ContextRefusal:
    """A prompt that fills the whole context with no budget sent: the room left (vLLM's default budget) is 0,
    which vLLM's SamplingParams refuse in these words."""
    return _refusal(f"{field} must be at least 1, got 0.", field, 0)


def text_size_refusal(
    size: int, limit: int, input_tokens: int, output_tokens: int | None, max_model_len: int, where: str
) -> ContextRefusal:
    """The refusal of a text of `size` UTF-8 bytes in `where` (messages / prompt), more than `limit` bytes,
    an upper bound of what `input_tokens` tokens hold, the room `output_tokens` (None: not known here) leaves
    in the context, in the shape of vLLM's character-based check."""
    asked = "" if output_tokens is None else f" you requested {shown(output_tokens)} output tokens and"
    return _refusal(
        f"This model's maximum context length is {max_model_len} tokens. However,{asked} your prompt contains "
        f"{size} bytes in the {where} (more than {limit} bytes, which is the upper bound for {input_tokens} "
        "input tokens). Please reduce the length of the input prompt or the number of requested output tokens.",
        where,
        size,
    )

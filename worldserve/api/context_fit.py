"""vLLM's context-length refusals of a chat or text completion, worded as its renderer words them today.

vLLM checks a request against the context in its renderer (vllm/renderers/params.py TokenizeParams), in the
API server, before the engine sees it, and raises VLLMValidationError, whose text ends with
"(parameter=<name>, value=<value>)"; the answer is a 400 BadRequestError whose `param` is that name:

- before the prompt is rendered, an output budget larger than the whole context: "max_tokens=N cannot be
  greater than max_model_len=max_total_tokens=L. Please request fewer output tokens." (`param`: the field the
  client sent, max_completion_tokens winning over max_tokens in a chat): `check_output_budget`;
- once the prompt's tokens are known, a prompt and budget that do not fit together: "This model's maximum
  context length is L tokens. However, you requested M output tokens and your prompt contains N input tokens,
  for a total of N+M tokens. Please reduce the length of the input prompt or the number of requested output
  tokens." (`param` "input_tokens", value N; M is 0 when no budget was sent): `check_prompt_fits`.

vLLM tokenizes a text prompt only up to one token past the room and then writes "at least N" (N the room
plus one); worldserve counts the whole prompt, so its message carries the exact count, in the wording vLLM
uses for a prompt whose count it knows (token ids). The replaced wording ("you requested T tokens (N in the
messages, M in the completion)") is vLLM's before its renderer, still what runner/chat_prompt.py raises for
in-process callers.
"""

from __future__ import annotations

from worldserve.api.errors import APIError


def _shown(value: int) -> str:
    """An int as vLLM's f-string prints it; past Python's int-to-text limit (4,300 digits, which a JSON body
    may reach) its size instead (printing it raised a 500)."""
    try:
        return str(value)
    except ValueError:
        return "more than 10^4300"


def _refusal(message: str, parameter: str, value: int) -> APIError:
    """The 400 vLLM answers for a VLLMValidationError: its text with the parameter and value appended."""
    return APIError(400, f"{message} (parameter={parameter}, value={_shown(value)})", param=parameter)


def check_output_budget(max_tokens: int | None, field: str, max_model_len: int | None) -> None:
    """APIError (400 naming `field`) when the completion budget `max_tokens` (as sent in `field`) is larger than
    the whole context `max_model_len` (None: unbounded), as vLLM refuses it before rendering the prompt."""
    if max_tokens is None or max_model_len is None or max_tokens <= max_model_len:
        return
    raise _refusal(
        f"{field}={_shown(max_tokens)} cannot be greater than max_model_len=max_total_tokens={max_model_len}. "
        "Please request fewer output tokens.",
        field,
        max_tokens,
    )


def check_prompt_fits(prompt_tokens: int, max_tokens: int | None, max_model_len: int | None) -> None:
    """APIError (400 naming `input_tokens`) when a prompt of `prompt_tokens` tokens and the completion budget
    `max_tokens` (None: none sent, counted 0 as vLLM counts it) exceed `max_model_len` together."""
    if max_model_len is None:
        return
    output = max_tokens or 0
    if prompt_tokens + output <= max_model_len:
        return
    raise _refusal(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{_shown(output)} output tokens and your prompt contains {prompt_tokens} input tokens, for a total of "
        f"{_shown(prompt_tokens + output)} tokens. Please reduce the length of the input prompt or the number "
        "of requested output tokens.",
        "input_tokens",
        prompt_tokens,
    )

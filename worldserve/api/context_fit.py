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
uses for a prompt whose count it knows (token ids). The words live in worldserve/context_limits.py, which the
Reasoner's own check (runner/chat_prompt.py `completion_budget`) uses too.
"""

from __future__ import annotations

from worldserve.api.errors import APIError
from worldserve.context_limits import ContextRefusal, output_budget_refusal, prompt_fit_refusal


def _raise(refusal: ContextRefusal | None) -> None:
    """The 400 vLLM answers for a VLLMValidationError, when there is one."""
    if refusal is not None:
        raise APIError(400, refusal.message, param=refusal.param)


def check_output_budget(max_tokens: int | None, field: str, max_model_len: int | None) -> None:
    """APIError (400 naming `field`) when the completion budget `max_tokens` (as sent in `field`) is larger than
    the whole context `max_model_len` (None: unbounded), as vLLM refuses it before rendering the prompt."""
    _raise(output_budget_refusal(max_tokens, field, max_model_len))


def check_prompt_fits(prompt_tokens: int, max_tokens: int | None, max_model_len: int | None) -> None:
    """APIError (400 naming `input_tokens`) when a prompt of `prompt_tokens` tokens and the completion budget
    `max_tokens` (None: none sent, counted 0 as vLLM counts it) exceed `max_model_len` together."""
    _raise(prompt_fit_refusal(prompt_tokens, max_tokens, max_model_len))

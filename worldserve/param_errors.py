"""The errors a request's validation raises: `ParamError` naming the offending field (the API turns it into a
400 with `param` set, as the OpenAI error JSON), `InvalidRequest` (refused as vLLM's request model validators
refuse it: typed "Bad Request"), `TextTooLong` (a text refused by its size before tokenizing); and `shown`,
how their messages quote a number a request sent.

Separate from params.py so that every module that checks a request (params.py, chat_params.py, the
resolution policy in resolution_tiers.py, the api/ routes) raises the same errors without depending on
VideoParams.
"""

from __future__ import annotations


class ParamError(ValueError):
    """A request parameter is invalid. `param` names the field, as in the OpenAI error JSON."""

    request_validation = False
    """Refused as a request model's validation refuses it (`api.errors.APIError` has the same attribute): typed
    "Bad Request" on vLLM's routes too."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


class InvalidRequest(ParamError):
    """A ParamError that vLLM raises from its request model's validators (stream_options without stream,
    top_logprobs without logprobs, tool_choice without tools, both template switches): on vLLM's routes its
    error type is the reason phrase "Bad Request", as for any request validation, not "BadRequestError"."""

    request_validation = True


class TextTooLong(ParamError):
    """A text refused by its byte size alone: more than the context's tokens can hold (before tokenizing)."""


def shown(value: object) -> str:
    """A number as error messages quote it: as it is, or its digit count past 20 characters (a request may
    send thousands of digits)."""
    text = str(value)
    sign = "a negative " if text.startswith("-") else "a "
    return text if len(text) <= 20 else f"{sign}{len(text.lstrip('-'))}-digit number"

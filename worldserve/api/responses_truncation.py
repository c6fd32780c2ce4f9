"""The Responses API's `truncation: "auto"` as OpenAI defines it: when the conversation does not fit the context
with room for the answer, whole input items are dropped from its start, and the instructions (and any other
leading system / developer message) stay, and so does the last user message (an agent loop's question: the
items after it are its tool calls and their outputs).

`fit_by_items` finds the fewest leading messages to drop, cutting at user turns (a conversation kept from a
user message on is one every template takes), by bisection over those cuts (each try renders the chat
template and counts its tokens; fewer messages render fewer tokens), drops them from the chat request
and from the ChatPaths that name each message's field, and refuses a conversation whose last item is still
too long (400 naming `input`, or `instructions` when they alone leave no room). A conversation
with images or videos is left whole: their token counts need their preprocessing, and the context check
answers a 400 if it is too long.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from worldserve.api.chat import RequestOptions, build_params
from worldserve.api.chat_media import media_parts
from worldserve.api.chat_protocol import ChatCompletionRequest
from worldserve.api.errors import APIError
from worldserve.api.responses_input import ChatPaths
from worldserve.param_errors import ParamError, TextTooLong

if TYPE_CHECKING:
    from worldserve.runner.chat_prompt import ChatPromptBuilder


def fit_by_items(
    chat: ChatCompletionRequest,
    paths: ChatPaths,
    room: int,
    count: Callable[[ChatCompletionRequest], int | None],
) -> tuple[ChatCompletionRequest, ChatPaths]:
    """(chat, paths) with the fewest leading conversation messages dropped for the prompt to take at most
    `room` tokens, never the last user message; `count(chat)`: its prompt's tokens, None when more than `room`
    (blocking: the template renders, the text tokenizes). APIError (400, `input`) when the messages left are
    still too long; nothing dropped when `room` < 1 (max_output_tokens fills the context: the context check's
    400 names it) or with media."""
    if room < 1 or next(media_parts(chat), None) is not None:  # (room < 1: the context check names it)
        return chat, paths
    first = next((i for i, m in enumerate(chat.messages) if m.role not in ("system", "developer")), 0)
    # the last user message is kept (an agent loop's question, which templates such as Qwen3's require),
    # else the last message (the item the answer follows)
    users = [i for i, m in enumerate(chat.messages) if m.role == "user" and i >= first]
    most = (users[-1] if users else len(chat.messages) - 1) - first

    def fits(drop: int) -> bool:
        try:
            tokens = count(_dropped(chat, first, drop))
        except ParamError:  # a cut conversation the template refuses (the whole one's errors are the user's)
            if drop == 0:
                raise
            return False
        return tokens is not None and tokens <= room

    if fits(0):
        return chat, paths
    # cuts at user turns only: a conversation kept from a user message on is one every template takes, and
    # fewer messages render fewer tokens, so the first cut that fits is found by bisection
    cuts = [d for d in range(1, most + 1) if chat.messages[first + d].role == "user"]
    if not users:  # (no user message at all: any leading item may go, the last kept)
        cuts = list(range(1, most + 1))
    if not cuts or not fits(cuts[-1]):
        _refuse(chat, paths, first, room, count)
    lo, hi = -1, len(cuts) - 1  # fits(cuts[hi]); cuts[lo] (no cut at -1) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(cuts[mid]) else (mid, hi)
    return _dropped(chat, first, cuts[hi]), _paths_dropped(paths, first, cuts[hi])


def _refuse(
    chat: ChatCompletionRequest,
    paths: ChatPaths,
    first: int,
    room: int,
    count: Callable[[ChatCompletionRequest], int | None],
) -> NoReturn:
    """The 400 for a conversation that does not fit with every item that may go dropped: naming the field of
    the first of the `first` leading system / developer messages with which they alone, before an empty
    question, leave the prompt no room (`instructions`, or a system item `input[j]`; the empty question has
    room without them), else `input`."""
    param, what = "input", "The input does not fit"
    question = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": ""}]}).messages

    def fits(leading: int) -> bool:  # the first `leading` system messages before an empty question
        try:
            tokens = count(chat.model_copy(update={"messages": chat.messages[:leading] + question}))
        except ParamError:  # (a template that refuses that: the input's to answer)
            return True
        return tokens is not None and tokens <= room

    # (the template's own tokens past the room: max_output_tokens', named as the input's)
    if first > 0 and fits(0) and not fits(first):
        # the leading message with which they stop fitting is the one named (instructions, or input[j])
        culprit = next(k for k in range(1, first + 1) if not fits(k)) - 1
        param = paths.messages[culprit] if culprit < len(paths.messages) else "input"
        what = f"With the {param}, the prompt does not fit"
    raise APIError(400, f"{what} the context with max_output_tokens' room ({room} tokens for the prompt), even "
                   "with truncation 'auto' dropping every input item before the last user message (or the last "
                   f"item): shorten the {param} or lower max_output_tokens.", param=param)  # fmt: skip


def prompt_tokens(
    prompts: ChatPromptBuilder, options: RequestOptions, chat: ChatCompletionRequest, room: int
) -> int | None:
    """The tokens of a text-only chat's prompt through the Reasoner's builder `prompts` (`options`: the
    request's, checked once: they do not depend on its messages), or None when its text is more than `room`
    tokens can hold (refused by its byte size, before tokenizing)."""
    # (the builder checks the size against the room the chat's own max_tokens leaves in the context it is
    # given: the context, when max_output_tokens set the room)
    context = room + (chat.max_tokens or 0)
    try:
        return len(prompts.build(build_params(chat, None, options=options), max_tokens=context).input_ids)
    except TextTooLong:
        return None


def _dropped(chat: ChatCompletionRequest, first: int, drop: int) -> ChatCompletionRequest:
    if drop == 0:
        return chat
    return chat.model_copy(update={"messages": chat.messages[:first] + chat.messages[first + drop :]})


def _paths_dropped(paths: ChatPaths, first: int, drop: int) -> ChatPaths:
    """The field names of the messages that stay, at their new indexes."""

    def moved(index: dict) -> dict:
        return {(i if i < first else i - drop): v for i, v in index.items() if not first <= i < first + drop}

    return ChatPaths(
        messages=paths.messages[:first] + paths.messages[first + drop :], calls=moved(paths.calls),
        contents=moved(paths.contents),
    )  # fmt: skip

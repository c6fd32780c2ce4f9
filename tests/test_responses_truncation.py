"""The Responses API's truncation "auto" (api/responses_truncation.py `fit_by_items`) against a counting stub:
the fewest leading messages dropped, the instructions and the last user message kept, a cut conversation the
template refuses taken as not fitting, the error paths remapped; nothing dropped without room or with media.
Over HTTP on the tiny model: tests/test_api_responses.py."""

from __future__ import annotations

import pytest

from worldserve.api.chat_protocol import ChatCompletionRequest
from worldserve.api.errors import APIError
from worldserve.api.responses_input import ChatPaths
from worldserve.api.responses_truncation import fit_by_items
from worldserve.params import ParamError


def _chat(*messages: tuple[str, str]) -> tuple[ChatCompletionRequest, ChatPaths]:
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": role, "content": text} for role, text in messages]}
    )
    return chat, ChatPaths(
        messages=[f"m{i}" for i in range(len(messages))], contents={len(messages) - 1: "last"}
    )


def _count(chat: ChatCompletionRequest) -> int:
    """A template that needs a user turn (as Qwen3's): one token a character."""
    if not any(m.role == "user" for m in chat.messages):
        raise ParamError("messages", "No user query found in messages.")
    return sum(len(m.content) for m in chat.messages)


def test_the_fewest_leading_turns_go_and_the_instructions_and_question_stay():
    chat, paths = _chat(("system", "s" * 5), ("user", "a" * 40), ("assistant", "b" * 40), ("user", "c" * 20),
                        ("assistant", "d" * 20), ("user", "q" * 10), ("tool", "t" * 30))  # fmt: skip
    cut, where = fit_by_items(chat, paths, 90, _count)  # 165 tokens whole; cut at a user turn: 85
    assert [m.content[0] for m in cut.messages] == ["s", "c", "d", "q", "t"]
    assert where.messages == ["m0", "m3", "m4", "m5", "m6"] and where.contents == {4: "last"}
    cut, _ = fit_by_items(chat, paths, 50, _count)  # down to the last user message, never past it
    assert [m.content[0] for m in cut.messages] == ["s", "q", "t"]
    with pytest.raises(APIError) as err:
        fit_by_items(chat, paths, 40, _count)
    assert err.value.param == "input"
    assert fit_by_items(chat, paths, 1000, _count)[0] is chat  # fits whole


def test_no_room_or_media_leave_it_whole_and_the_whole_ones_errors_stand():
    chat, paths = _chat(("user", "a" * 40), ("user", "q"))
    assert fit_by_items(chat, paths, 0, _count)[0] is chat  # (the context check names max_output_tokens)
    pictured = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})  # fmt: skip
    assert fit_by_items(pictured, ChatPaths(), 1, _count)[0] is pictured
    replies, paths = _chat(
        ("system", "s"), ("assistant", "a" * 40), ("assistant", "b" * 40), ("assistant", "c")
    )
    kept = fit_by_items(replies, paths, 50, lambda chat: sum(len(m.content) for m in chat.messages))[0]
    assert [m.content[0] for m in kept.messages] == ["s", "b", "c"]  # no user message: cut at any item
    tools_only, paths = _chat(("assistant", "a" * 40), ("tool", "t"))
    with pytest.raises(ParamError, match="No user query"):  # the whole conversation's own error
        fit_by_items(tools_only, paths, 10, _count)


def test_instructions_that_leave_no_room_are_named_not_the_input():
    chat, paths = _chat(("system", "s" * 60), ("user", "a" * 40), ("user", "q" * 10))
    paths.messages[0] = "instructions"
    with pytest.raises(APIError) as err:  # the instructions alone (60) take more than the room (40)
        fit_by_items(chat, paths, 40, _count)
    assert err.value.param == "instructions" and "shorten the instructions" in err.value.message
    with pytest.raises(
        APIError
    ) as err:  # the question is too long with them (70), not they alone: the input's
        fit_by_items(chat, paths, 65, _count)
    assert err.value.param == "input"
    mixed, where = _chat(("system", "s" * 5), ("system", "x" * 60), ("user", "q" * 10))
    where.messages[:2] = ["instructions", "input[0]"]  # brief instructions, then a long system item
    with pytest.raises(APIError) as err:
        fit_by_items(mixed, where, 40, _count)
    assert err.value.param == "input[0]", err.value.message
    paths.messages[0] = "input[0]"  # a leading system item of the input
    with pytest.raises(APIError) as err:
        fit_by_items(chat, paths, 40, _count)
    assert err.value.param == "input[0]"

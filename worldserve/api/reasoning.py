"""vLLM's `--reasoning-parser qwen3` for the Reasoner's chats: an answer that opens with <think> has its thoughts
in `reasoning_content` and the text after </think> in `content`; an answer that does not open with <think>
is all content. (The Cosmos3 Reasoner thinks only when asked to, in that format: serving-api.md §11.2. A parser
that takes everything before </think> as reasoning, as DeepSeek-R1's does, routes whole plain answers to
reasoning_content: the pain point the docs record.)

`split_reasoning(text)` splits a finished answer; `ReasoningStream` splits a streamed one into
`reasoning_content` / `content` deltas that add up to the same (a possible "<think>" or "</think>" still
being written is held back). An unfinished thought (cut by max_tokens) is reasoning, streamed or not. The
content then goes through tool-call parsing (api/tool_stream.py), as vLLM extracts tool calls from the content
only. `include_reasoning: false` (vLLM's request field) drops the thoughts from the answer. The chat answer
sends the thoughts under both of vLLM's names, `reasoning` and `reasoning_content` (api/chat_stream.py).
"""

from __future__ import annotations

from typing import Any

from worldserve.api.tool_calls import partial_suffix
from worldserve.chat_params import THINK_END, THINK_START


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished answer; each None when empty."""
    body = text.lstrip()
    if not body.startswith(THINK_START):
        return None, text
    body = body[len(THINK_START) :]
    end = body.find(THINK_END)
    if end < 0:
        return body or None, None
    return body[:end] or None, body[end + len(THINK_END) :] or None


class ReasoningStream:
    """One streamed choice's text deltas -> `reasoning_content` and `content` deltas."""

    def __init__(self) -> None:
        self._text = ""  # every piece so far
        self._sent = 0  # characters of _text settled (sent, or a tag)
        self._state = "start"  # "start": not yet known whether the answer opens with <think>

    def feed(self, piece: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas for this text `piece` (the last one when `finished`)."""
        self._text += piece
        out: list[dict[str, Any]] = []
        if self._state == "start":
            head = self._text.lstrip()
            if head.startswith(THINK_START):
                self._state = "reasoning"
                self._sent = len(self._text) - len(head) + len(THINK_START)
            elif THINK_START.startswith(head) and not finished:
                return out  # whitespace or a part of "<think>" so far: wait
            else:
                self._state = "content"
        rest = self._text[self._sent :]
        if self._state == "reasoning":
            end = rest.find(THINK_END)
            if end < 0:
                keep = 0 if finished else partial_suffix(rest, THINK_END)
                self._emit(out, "reasoning_content", rest[: len(rest) - keep])
                return out
            self._emit(out, "reasoning_content", rest[:end])
            self._sent += len(THINK_END)
            self._state = "content"
            rest = self._text[self._sent :]
        self._emit(out, "content", rest)
        return out

    def _emit(self, out: list, key: str, text: str) -> None:
        if text:
            out.append({key: text})
        self._sent += len(text)

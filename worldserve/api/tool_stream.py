"""Tool calls read out of the Reasoner's text (formats and modes: api/tool_calls.py), finished or streamed.

`final_message` gives a finished choice's (content, tool_calls, finish_reason); `ToolStream` turns a
choice's text deltas into the streamed deltas: content outside calls (a possible "<tool_call>" prefix held
back); each call announced (id, name, arguments "") as soon as its name is written, then its arguments'
canonical JSON text as it settles (`JsonStream`), as vLLM's hermes parser streams them: an auto answer's
<tool_call> blocks, a required answer's JSON list (in order: a call without arguments gets "{}" when the next
begins); a named call's arguments as they come (a call written whole in one text piece: its announcement,
then its arguments). The streamed calls add up to the finished answer's, except that a call once announced
stands: should its text stop being JSON, be cut by max_tokens, or (required) the list turn out not to be a
list of calls, its arguments are what was sent, where the unstreamed answer (vLLM's too) has the text as
content; the calls sent before a block that turns out not to be a call stand too (with finish_reason
tool_calls), where the unstreamed answer is then all text with the chat's own finish reason (vLLM's hermes
rule: any block that does not parse); and a repeated key in a call's JSON streams as written (the finished parse keeps the last value).
"""

from __future__ import annotations

from typing import Any

from worldserve.api.json_stream import JsonStream
from worldserve.api.tool_calls import (
    CALL_END,
    CALL_START,
    ToolCallOut,
    ToolMode,
    call_out,
    hermes_call,
    partial_suffix,
    required_calls,
)


def hermes_calls(text: str) -> tuple[str | None, list[ToolCallOut]] | None:
    """(content or None, the calls) of a finished text holding <tool_call> blocks, each JSON {"name",
    "arguments"}: the content is the text before the first block, text between and after blocks is
    dropped; None (then it is all content, with the chat's own finish reason) when no block is a call or
    any block is not one (cut mid-JSON by max_tokens, or not JSON: vLLM's hermes parser answers the whole
    text then). An unterminated last block that parses is a call. The same parser as a streamed answer's
    (ToolStream), fed the whole text at once."""
    stream = ToolStream(ToolMode(choice="auto", tools=()))
    stream.feed(text, finished=True)
    if not stream.calls or stream.calls_refused:
        return None
    return stream.content or None, stream.calls


def final_message(
    text: str | None, mode: ToolMode | None, finish_reason: str | None
) -> tuple[str | None, list, str | None]:
    """A finished choice's (content, tool_calls, finish_reason) under `mode` (`text` None: no content)."""
    if text is None or mode is None or not mode.parsed:
        return text, [], finish_reason
    if mode.choice == "named":  # (no text, e.g. the answer only thought: no call)
        assert mode.name is not None  # (tool_mode names a named choice's function)
        return (
            ("", [call_out(mode.name, text, text=True)], finish_reason) if text else (text, [], finish_reason)
        )
    if mode.choice == "required":
        calls = required_calls(text)
        if calls is None:
            return text, [], finish_reason
        return "", calls if mode.parallel else calls[:1], required_finish(finish_reason)
    found = hermes_calls(text)
    if found is None:
        return text, [], finish_reason
    return found[0], found[1] if mode.parallel else found[1][:1], "tool_calls"


def required_finish(reason: str | None) -> str | None:
    """A required choice's calls that ended ("stop") finish with "tool_calls", as vLLM's (OpenAI's rule:
    "tool_calls" for auto and required calls, "stop" for a named one); a cut keeps its "length"."""
    return "tool_calls" if reason == "stop" else reason


class ToolStream:
    """One streamed choice's text deltas -> its chunk deltas under a parsed ToolMode."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""  # every text delta so far
        self._sent = 0  # characters of text settled (sent as content, or inside a call)
        self._calls = 0  # calls sent
        self.content = ""  # (auto) the content sent: the text before the first call
        self.calls: list[ToolCallOut] = []  # (auto, required) the calls sent
        self.calls_refused = False  # (auto) a <tool_call> block was not a call (its text went as content)
        self._block: _CallReader | None = None  # (auto) the <tool_call> block being written, read so far
        self._fed = 0  # (auto) characters of that block's body fed to its reader
        self._json = JsonStream()  # (required) the answer's JSON list
        self._items: list[_CallReader] = []  # (required) a reader per call whose name was written

    def feed(self, piece: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas to send for this text `piece` (the last one when `finished`)."""
        self.text += piece
        if (
            self.mode.choice == "named"
        ):  # the call opens with its first argument text (none: no call, as unstreamed)
            if not piece:
                return []
            assert self.mode.name is not None  # (tool_mode names a named choice's function)
            out = [] if self._calls else [self._call_delta(call_out(self.mode.name, "", text=True))]
            self.calls[0].function.arguments += piece
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return out
        deltas = self._required(piece, finished) if self.mode.choice == "required" else self._auto(finished)
        if not self.mode.parallel:  # parallel_tool_calls false: the first call only (vLLM's rule)
            deltas = [d for d in deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]
        return deltas

    @property
    def called(self) -> bool:
        return self._calls > 0

    def finish_reason(self, reason: str | None) -> str | None:
        """auto: "tool_calls" once a call was sent; required: "tool_calls" for calls that ended ("stop");
        otherwise (a named call, a cut) the chat's own."""
        if self.mode.choice == "auto" and self.called:
            return "tool_calls"
        return required_finish(reason) if self.mode.choice == "required" and self.called else reason

    def _required(self, piece: str, finished: bool) -> list[dict[str, Any]]:
        """The JSON list of {"name", "parameters"}: item i's call once its name is written, then its
        parameters (an item without them gets "{}" once the next begins, so calls complete in order); at the
        end, the text itself when no call was announced and it is not a list of calls (a cut)."""
        self._json.feed(piece)
        if finished:
            self._json.close()
        out: list[dict[str, Any]] = []
        while (i := len(self._items), "name") in self._json.strings:
            if self._items:
                out += self._items[-1].read(self) + self._items[-1].without_arguments()
            start = self._items[-1].start if self._items else 0  # item i's reader looks at its pieces on
            while self._json.pieces[start][0][:1] != (i,):
                start += 1
            self._items.append(_CallReader(self._json, (i,), ("parameters",), start))
        if self._items:
            out += self._items[-1].read(self)  # (the earlier items are complete)
        if not finished:
            return out
        announced = [item for item in self._items if item.call is not None]
        calls = required_calls(self.text)
        if calls is None and not announced:
            return [{"content": self.text}]
        for item in announced:
            out += item.finish(None if calls is None else calls[item.prefix[0]].function.arguments)
        return out

    def _auto(self, finished: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            rest = self.text[self._sent :]
            start = rest.find(CALL_START)
            if start < 0:  # content, holding back what could still become "<tool_call>"
                keep = 0 if finished else partial_suffix(rest, CALL_START)
                self._content(out, rest[: len(rest) - keep])
                return out
            if start:
                self._content(out, rest[:start])
                continue
            end = rest.find(CALL_END)
            body = rest[len(CALL_START) : end if end >= 0 else len(rest)]
            if self._block is None:
                self._block, self._fed = _CallReader(JsonStream(), (), ("arguments", "parameters")), 0
            if end < 0 and not finished:  # inside a call: its name, then its arguments as they settle
                body = body[: len(body) - partial_suffix(body, CALL_END)]
                self._block.json.feed(body[self._fed :])
                self._fed = len(body)
                out += self._block.read(self)
                return out
            block_end = end + len(CALL_END) if end >= 0 else len(rest)  # an unterminated block: to the end
            block, self._block = self._block, None
            if block.call is not None:  # announced while streaming: the call stands
                block.json.feed(body[self._fed :])
                block.json.close()
                final = hermes_call(body)
                out += block.read(self) + block.finish(None if final is None else final.function.arguments)
            elif (
                call := hermes_call(body)
            ) is not None:  # whole in this piece: announced, then its arguments
                args, call.function.arguments = call.function.arguments, ""
                out.append(self._call_delta(call))
                call.function.arguments = args
                out.append({"tool_calls": [{"index": self._calls - 1, "function": {"arguments": args}}]})
            else:  # not a call after all: its text is content (and a finished answer all text: hermes_calls)
                self.calls_refused = True
                self._content(out, rest[:block_end])
                continue
            self._sent += block_end

    def _content(self, out: list, text: str) -> None:
        """Settle `text` as content: sent before the first call, dropped after it (the whole answer's content
        is the text before its first call, as vLLM's hermes parser gives it)."""
        if text and not self.called:
            out.append({"content": text})
            self.content += text
        self._sent += len(text)

    def _call_delta(self, call: ToolCallOut) -> dict[str, Any]:
        delta = {"tool_calls": [{"index": self._calls, **call.model_dump()}]}
        self._calls += 1
        self.calls.append(call)
        return delta


class _CallReader:
    """One call while the model writes it, from a `JsonStream` of its text (the caller feeds it): the call
    is announced (id, name, arguments "") once the string at `prefix` + ("name",) is complete, then its
    arguments follow as the canonical text under `prefix` + (member,) settles (the first of `members` met:
    a hermes block naming both "arguments" and "parameters" streams the first)."""

    def __init__(self, json: JsonStream, prefix: tuple, members: tuple[str, ...], start: int = 0) -> None:
        self.json, self.prefix, self.members = json, prefix, members
        self.call: ToolCallOut | None = None
        self.index = 0
        self.member: tuple = ()  # the arguments' path, once met
        self.start = self.seen = start  # pieces of the JSON text looked at (before `start`: not this call's)
        self.sent = ""  # the arguments text sent

    def read(self, stream: ToolStream) -> list[dict[str, Any]]:
        """The deltas of what the JSON text now settles: the announcement, then more arguments."""
        if self.call is None:
            name = self.json.strings.get((*self.prefix, "name"))
            if name is None or self.json.failed:
                return []
            self.index = stream._calls
            self.call = call_out(name, "", text=True)
            return [stream._call_delta(self.call), *self._more_arguments()]
        return self._more_arguments()

    def without_arguments(self) -> list[dict[str, Any]]:
        """A call whose text ended without arguments: "{}" (what the finished answer gives it)."""
        if self.call is None or self.member or self.sent:
            return []
        self.sent = "{}"
        return [self._arguments_delta("{}")]

    def finish(self, final: str | None) -> list[dict[str, Any]]:
        """The last delta of an announced call whose text ended: the rest of the finished arguments `final`
        when what was sent begins them (e.g. none were written: "{}"); the arguments sent stand otherwise."""
        assert self.call is not None  # (called for an announced call only)
        args = final if final is not None and final.startswith(self.sent) else self.sent
        rest, self.call.function.arguments = args[len(self.sent) :], args
        return [self._arguments_delta(rest)] if rest else []

    def _more_arguments(self) -> list[dict[str, Any]]:
        n, new = len(self.prefix), ""
        for path, text in self.json.pieces[self.seen :]:
            if not self.member and len(path) > n and path[:n] == self.prefix and path[n] in self.members:
                self.member = path[: n + 1]
            if self.member and path[: n + 1] == self.member:
                new += text
        self.seen = len(self.json.pieces)
        if not new:
            return []
        self.sent += new
        return [self._arguments_delta(new)]

    def _arguments_delta(self, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.index, "function": {"arguments": text}}]}

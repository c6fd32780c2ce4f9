"""Tool calling on chat completions, as vLLM serves Qwen models (`--enable-auto-tool-choice --tool-call-parser
hermes`: Qwen3-VL's chat template tells the model to answer a call as <tool_call>{"name", "arguments"}
</tool_call>).

Request: `tools` (function tools: name, description, parameters schema) are rendered into the prompt by the
chat template; `tool_choice`: "auto" (the default with tools: the model decides; its <tool_call> blocks
become `tool_calls`, finish_reason "tool_calls"), "none" (plain text), "required" (the output is constrained
to a JSON list of {"name", "parameters"} of the given tools, one call at least) or {"type": "function",
"function": {"name": N}} (the output is constrained to N's parameters schema: one call of N). As vLLM answers
them, a required or named call's message has content "" and the chat's own finish_reason ("stop").
Messages: an assistant turn's `tool_calls` (their JSON `arguments` handed to the template as objects, as
vLLM does) and a tool turn's `tool_call_id` reach the template. Each bad tool, choice or call is a 400 naming
its field. Call ids are vLLM's `chatcmpl-tool-<hex>`.

`ToolStream` turns a choice's text deltas into the streamed deltas: content outside calls (a possible
"<tool_call>" prefix held back); an auto call announced (id, name) once its name is written, then its
arguments' canonical JSON text as it settles (`_OpenCall`, as vLLM's hermes parser streams them); a
required answer's calls in one delta each at the end; a named call's arguments as they come.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from worldserve.api.bodies import check_unicode
from worldserve.api.errors import APIError
from worldserve.api.json_stream import JsonStream
from worldserve.chat_params import StructuredOutput
from worldserve.params import ParamError

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
"""A hermes call block's tags (an unterminated last block, a length cut or a missing end tag, runs to the end
of the text, as vLLM's hermes parser takes it)."""


class FunctionIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionIn


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    """An earlier assistant turn's call, sent back with the conversation."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")
    type: Literal["function"] = "function"
    function: FunctionCallOut


@dataclass(frozen=True, slots=True)
class ToolMode:
    """A request's tools and how it lets the model call them."""

    choice: Literal["none", "auto", "required", "named"]
    tools: tuple[dict, ...]
    """The tools as the chat template takes them ({"type": "function", "function": {...}})."""
    name: str | None = None
    """The named choice's function."""

    @property
    def parsed(self) -> bool:
        """Whether the output turns into tool calls."""
        return self.choice != "none"


def tool_mode(tools: list[ToolIn] | None, choice: Any) -> ToolMode | None:
    """The request's ToolMode (None: no tools, nothing to parse); ParamError naming the field."""
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if (
            choice.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise ParamError(
                "tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}'
            )
        named = fn["name"]
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise ParamError("tool_choice", f'tool_choice must be "none", "auto", "required" or a named function, '
                         f"got {choice!r}")  # fmt: skip
    else:
        named = None
    if not tools:
        if choice in ("required", "named"):
            raise ParamError("tool_choice", "When using `tool_choice`, `tools` must be set.")
        return None
    names = [t.function.name for t in tools]
    if named is not None and named not in names:
        raise ParamError("tool_choice", f"Tool '{named}' has not been passed in `tools`.")
    return ToolMode(choice=choice, tools=tuple(t.model_dump(exclude_none=True) for t in tools), name=named)


def parameters(tool: dict) -> dict:
    """A tool's parameters schema (any JSON object when it gives none)."""
    return tool["function"].get("parameters") or {"type": "object"}


def tool_constraint(mode: ToolMode | None) -> StructuredOutput | None:
    """The output constraint of a required or named choice (vLLM's): one call of the named function's
    parameters, or a non-empty JSON list of {"name", "parameters"} of the tools."""
    if mode is None or mode.choice in ("none", "auto"):
        return None
    if mode.choice == "named":
        tool = next(t for t in mode.tools if t["function"]["name"] == mode.name)
        schema = parameters(tool)
    else:  # the tools' own $defs lifted to the list's top level, where their "#/$defs/..." refs now point
        defs: dict[str, Any] = {}
        alternatives = []
        for t in mode.tools:
            params = dict(parameters(t))
            for name, definition in params.pop("$defs", {}).items():
                if defs.setdefault(name, definition) != definition:
                    raise ParamError("tools", f"Tool definitions have conflicting $defs {name!r}: with "
                                     'tool_choice "required" all tools share one set of $defs')  # fmt: skip
            alternatives.append({"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": params}, "required": ["name", "parameters"]})  # fmt: skip
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
        if defs:
            schema["$defs"] = defs
    return StructuredOutput(kind="json", spec=json.dumps(schema), field="tools")


def message_calls(calls: list[ToolCallIn] | None, where: str = "messages") -> tuple[dict, ...]:
    """An assistant turn's calls as the chat template takes them: JSON arguments as objects (vLLM's way;
    Qwen's template prints them back as JSON). `where`: the message's field, for a ParamError naming the
    arguments when their JSON escapes a lone surrogate (no text a tokenizer takes)."""
    out = []
    for j, call in enumerate(calls or ()):
        args = call.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # not JSON: handed over as the text it is
            else:
                try:
                    check_unicode(args, call.function.arguments)
                except APIError:
                    field = f"{where}.tool_calls[{j}].function.arguments"
                    raise ParamError(field, f"{field}: not valid Unicode text (a lone surrogate)") from None
        out.append(
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}
        )
    return tuple(out)


def hermes_calls(text: str) -> tuple[str | None, list[ToolCallOut]] | None:
    """(content or None, the calls) of a finished text holding <tool_call> blocks, each JSON {"name",
    "arguments"}: the content is the text before the first block that parses (a block that does not parse,
    e.g. cut mid-JSON, is text; an unterminated one that parses is a call), the rest after it is dropped;
    None when no block parses (then it is all content). The same parser as a streamed answer's (ToolStream),
    fed the whole text at once."""
    stream = ToolStream(ToolMode(choice="auto", tools=()))
    stream.feed(text, finished=True)
    return (stream.content or None, stream.calls) if stream.calls else None


def call_out(name: str, arguments: Any, *, text: bool = False) -> ToolCallOut:
    """A call of `name` with a fresh id: `arguments` serialized as vLLM does (JSON, non-ASCII kept), or
    taken as the text it is (`text`: a named choice's generated arguments)."""
    args = arguments if text else json.dumps(arguments, ensure_ascii=False)
    return ToolCallOut(function=FunctionCallOut(name=name, arguments=args))


def _call(body: str) -> ToolCallOut | None:
    """A hermes block's {"name", "arguments"} as a call, or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return call_out(obj["name"], args)


def required_calls(text: str) -> list[ToolCallOut] | None:
    """A required choice's JSON list of {"name", "parameters"} as calls (None when it does not parse: a
    length cut)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(
        isinstance(i, dict) and isinstance(i.get("name"), str) for i in items
    ):
        return None
    return [call_out(i["name"], i.get("parameters", {})) for i in items]


def final_message(
    text: str | None, mode: ToolMode | None, finish_reason: str | None
) -> tuple[str | None, list, str | None]:
    """A finished choice's (content, tool_calls, finish_reason) under `mode` (`text` None: no content)."""
    if text is None or mode is None or not mode.parsed:
        return text, [], finish_reason
    if mode.choice == "named":
        return "", [call_out(mode.name, text, text=True)], finish_reason
    if mode.choice == "required":
        calls = required_calls(text)
        return ("", calls, finish_reason) if calls is not None else (text, [], finish_reason)
    found = hermes_calls(text)
    if found is None:
        return text, [], finish_reason
    return found[0], found[1], "tool_calls"


class ToolStream:
    """One streamed choice's text deltas -> its chunk deltas under a parsed ToolMode."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.text = ""  # every text delta so far
        self._sent = 0  # characters of text settled (sent as content, or inside a call)
        self._calls = 0  # calls sent
        self.content = ""  # (auto) the content sent: the text before the first call
        self.calls: list[ToolCallOut] = []  # (auto, required) the calls sent
        self._open: _OpenCall | None = None  # (auto) the <tool_call> block being written

    def feed(self, piece: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas to send for this text `piece` (the last one when `finished`)."""
        self.text += piece
        if (
            self.mode.choice == "named"
        ):  # the call opens with its first argument text (none: no call, as unstreamed)
            if not piece:
                return []
            out = [] if self._calls else [self._call_delta(call_out(self.mode.name, "", text=True))]
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            return out
        if self.mode.choice == "required":
            if not finished:
                return []
            calls = required_calls(self.text)
            return [{"content": self.text}] if calls is None else [self._call_delta(c) for c in calls]
        return self._auto(finished)

    @property
    def called(self) -> bool:
        return self._calls > 0

    def finish_reason(self, reason: str | None) -> str | None:
        """auto: "tool_calls" once a call was sent; otherwise the chat's own."""
        return "tool_calls" if self.mode.choice == "auto" and self.called else reason

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
            if self._open is None:
                self._open = _OpenCall()
            if end < 0 and not finished:  # inside a call: its name, then its arguments as they settle
                out += self._open.read(self, body[: len(body) - partial_suffix(body, CALL_END)])
                return out
            block_end = end + len(CALL_END) if end >= 0 else len(rest)  # an unterminated block: to the end
            opened, self._open = self._open, None
            if opened.call is not None:  # announced while streaming: the call stands
                out += opened.finish(body)
            elif (call := _call(body)) is not None:
                out.append(self._call_delta(call))
            else:  # not a call after all: its text is content
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


class _OpenCall:
    """An auto answer's <tool_call> block while the model writes it: the call is announced (id, name,
    arguments "") once its "name" string is complete, then its arguments follow as their canonical text
    settles (`JsonStream`), so they add up to the finished answer's `json.dumps` of them. Once announced a
    call stands: should its block stop being JSON (or be cut by max_tokens), its arguments are what was
    sent, where the unstreamed answer (vLLM's too) would count the block as text. A block naming both
    "arguments" and "parameters" streams the first it meets."""

    def __init__(self) -> None:
        self.json = JsonStream()
        self.fed = 0  # characters of the body fed
        self.call: ToolCallOut | None = None
        self.index = 0
        self.member = ""  # "arguments" or "parameters", once met
        self.sent = ""  # the arguments text sent

    def read(self, stream: ToolStream, body: str) -> list[dict[str, Any]]:
        """The deltas of the block's new text (`body`: all of it so far, without a partial end tag)."""
        self.json.feed(body[self.fed :])
        self.fed = len(body)
        if self.call is None:
            name = self.json.strings.get(("name",))
            if name is None or self.json.failed:
                return []
            self.index = stream._calls
            self.call = call_out(name, "", text=True)
            return [stream._call_delta(self.call), *self._more_arguments()]
        return self._more_arguments()

    def finish(self, body: str) -> list[dict[str, Any]]:
        """The last deltas of an announced call, its block complete (or cut): the rest of the finished
        arguments when what was sent begins them (e.g. none: "{}"), else nothing more."""
        self.json.feed(body[self.fed :])
        self.json.close()
        out = self._more_arguments()
        final = _call(body)
        args = self.sent if final is None else final.function.arguments
        self.call.function.arguments = args if args.startswith(self.sent) else self.sent
        rest = self.call.function.arguments[len(self.sent) :]
        return out + ([self._arguments_delta(rest)] if rest else [])

    def _more_arguments(self) -> list[dict[str, Any]]:
        if not self.member:
            self.member = next(
                (p[0] for p, _ in self.json.pieces if p[:1] in (("arguments",), ("parameters",))), ""
            )
        text = self.json.text((self.member,)) if self.member else ""
        if len(text) <= len(self.sent):
            return []
        delta, self.sent = text[len(self.sent) :], text
        return [self._arguments_delta(delta)]

    def _arguments_delta(self, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.index, "function": {"arguments": text}}]}


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)

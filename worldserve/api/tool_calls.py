"""Tool calling on chat completions, as vLLM serves Qwen models (`--enable-auto-tool-choice --tool-call-parser
hermes`: Qwen3-VL's chat template tells the model to answer a call as <tool_call>{"name", "arguments"}
</tool_call>).

Request: `tools` (function tools: name, description, parameters schema) are rendered into the prompt by the
chat template; `tool_choice`: "auto" (the default with tools: the model decides; its <tool_call> blocks
become `tool_calls`, finish_reason "tool_calls"), "none" (plain text), "required" (the output is constrained
to a JSON list of {"name", "parameters"} of the given tools, one call at least) or {"type": "function",
"function": {"name": N}} (the output is constrained to N's parameters schema: one call of N). As vLLM answers
them, a required or named call's message has content ""; finish_reason "tool_calls" for required calls that
ended, the chat's own ("stop") for a named one (OpenAI's rule, vLLM's serving_chat; a cut stays "length").
Messages: an assistant turn's `tool_calls` (their JSON `arguments` handed to the template as objects, as
vLLM does) and a tool turn's `tool_call_id` reach the template. Each bad tool, choice or call is a 400 naming
its field. Call ids are vLLM's `chatcmpl-tool-<hex>`.

Reading the calls out of an answer, finished or streamed: api/tool_stream.py.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from worldserve.api.bodies import check_depth, check_unicode, too_deep
from worldserve.api.errors import APIError
from worldserve.api.json_stream import canonical_json
from worldserve.chat_params import StructuredOutput
from worldserve.param_errors import InvalidRequest, ParamError

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
    arguments: str | dict[str, Any] | None = None
    """JSON text (or an object); none, null or "": no arguments, {} (as vLLM takes them)."""


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
    parallel: bool = True
    """`parallel_tool_calls`: False answers the first call only (vLLM's rule; a required choice's grammar
    then allows one call)."""

    @property
    def parsed(self) -> bool:
        """Whether the output turns into tool calls."""
        return self.choice != "none"


def tool_mode(tools: list[ToolIn] | None, choice: Any, parallel: bool | None = None) -> ToolMode | None:
    """The request's ToolMode (None: no tools, nothing to parse; `parallel`: parallel_tool_calls, default
    true); ParamError naming the field (InvalidRequest where vLLM's request validator check_tool_usage refuses)."""
    if choice is None:
        choice = "auto" if tools else "none"
        tools = tools or []  # (no choice given: nothing to check)
    if isinstance(choice, dict):
        fn = choice.get("function")
        if (
            choice.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise InvalidRequest(
                "tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}'
            )
        named = fn["name"]
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequest("tool_choice", f'tool_choice must be "none", "auto", "required" or a named '
                             f"function, got {choice!r}")  # fmt: skip
    else:
        named = None
    if not tools:  # (vLLM's check_tool_usage: any tool_choice but "none" needs `tools`; [] is tools given)
        if choice in ("required", "named") or (choice == "auto" and tools is None):
            raise InvalidRequest("tool_choice", "When using `tool_choice`, `tools` must be set.")
        return None
    names = [t.function.name for t in tools]
    if named is not None and named not in names:
        raise InvalidRequest("tool_choice", f"Tool '{named}' has not been passed in `tools`.")
    return ToolMode(choice=choice, tools=tuple(t.model_dump(exclude_none=True) for t in tools), name=named,
                    parallel=parallel is not False)  # fmt: skip


def parameters(tool: dict) -> dict:
    """A tool's parameters schema (any JSON object when it gives none)."""
    return tool["function"].get("parameters") or {"type": "object"}


def tool_constraint(mode: ToolMode | None) -> StructuredOutput | None:
    """The output constraint of a required or named choice (vLLM's): one call of the named function's
    parameters, or a non-empty JSON list of {"name", "parameters"} of the tools (each tool's parameters one
    of the list schema's $defs, so that their own references, recursive ones too, still name them)."""
    if mode is None or mode.choice in ("none", "auto"):
        return None
    if mode.choice == "named":
        tool = next(t for t in mode.tools if t["function"]["name"] == mode.name)
        schema = parameters(tool)
    else:  # each tool's parameters a definition of their own, their "#..." refs rewritten to point into it
        defs: dict[str, Any] = {}
        alternatives = []
        for i, t in enumerate(mode.tools):
            params = parameters(t)
            if not isinstance(params.get("$defs", {}), dict):
                raise ParamError(
                    "tools", f"Tool {t['function']['name']!r}: parameters.$defs must be an object"
                )
            # (an $id would make the rewritten pointers resolve against the tool's own document)
            defs[f"tool{i}"] = _rooted({k: v for k, v in params.items() if k != "$id"}, f"#/$defs/tool{i}")
            alternatives.append({"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": {"$ref": f"#/$defs/tool{i}"}},
                                 "required": ["name", "parameters"]})  # fmt: skip
        schema = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": alternatives},
            "$defs": defs,
        }
        if not mode.parallel:
            schema["maxItems"] = 1
    return StructuredOutput(kind="json", spec=json.dumps(schema), field="tools")


SCHEMA_DATA = frozenset({"const", "enum", "default", "examples"})
"""JSON Schema keywords whose values are data, not schemas: a {"$ref": ...} there is left as it is."""
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose values map names to schemas: the names are no keywords (a property may be named "default")."""


def _rooted(schema: Any, root: str) -> Any:
    """`schema` (a tool's parameters) with its references to its own document ("#", "#/$defs/X",
    "#/definitions/X", "#/properties/...") pointing at `root`, where the required choice's list schema keeps
    it: left at the list's root, a recursive "#" had made a tool's argument a list of calls, and draft-07
    `definitions` were refused ("Pointer ... does not exist"). Data (`const`, `enum`, ...) is left as it is."""
    if isinstance(schema, list):
        return [_rooted(v, root) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and (v == "#" or v.startswith("#/")):
            out[k] = root + v[1:]
        elif k in SCHEMA_DATA:
            out[k] = v
        elif k in SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: _rooted(sub, root) for name, sub in v.items()}
        else:
            out[k] = _rooted(v, root)
    return out


def message_calls(calls: list[ToolCallIn] | None, where: str = "messages") -> tuple[dict, ...]:
    """An assistant turn's calls as the chat template takes them: JSON arguments as objects (vLLM's way;
    Qwen's template prints them back as JSON); JSON that escapes a lone surrogate (no text a tokenizer takes
    once parsed) stays the text it is. `where`: the message's field, for a ParamError naming the arguments."""
    out = []
    for j, call in enumerate(calls or ()):
        args: Any = call.function.arguments if call.function.arguments is not None else {}
        if isinstance(args, str) and not args.strip():  # a call without arguments: {} (vLLM's rule; the
            args = {}  # template would print nothing where its JSON goes)
        if isinstance(args, str):
            text, field = args, f"{where}.tool_calls[{j}].function.arguments"
            try:
                args = json.loads(text)
            except ValueError:
                pass  # not JSON: handed over as the text it is
            except RecursionError:
                raise ParamError(field, too_deep(field)) from None
            else:
                check_depth(args, field)  # (the template renders them recursively)
                try:
                    check_unicode(args, text)
                except APIError:  # JSON escaping a lone surrogate (as canonical_json writes this server's own
                    args = text  # answers): its text, which is plain, goes to the template
        out.append(
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}
        )
    return tuple(out)


def call_out(name: str, arguments: Any, *, text: bool = False) -> ToolCallOut:
    """A call of `name` with a fresh id: `arguments` serialized as vLLM does (JSON, non-ASCII kept; a lone
    surrogate stays escaped: `canonical_json`), or taken as the text it is (`text`: a named choice's
    generated arguments)."""
    args = arguments if text else canonical_json(arguments)
    return ToolCallOut(function=FunctionCallOut(name=name, arguments=args))


def hermes_call(body: str) -> ToolCallOut | None:
    """A hermes block's {"name", "arguments"} as a call, or None when it is not one ("parameters" is taken
    for "arguments" too; with both, the first in the text, as a streamed call sends it)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # (nesting deeper than the decoder's recursion limit)
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((v for k, v in obj.items() if k in ("arguments", "parameters")), {})
    return call_out(obj["name"], args)


def required_calls(text: str) -> list[ToolCallOut] | None:
    """A required choice's JSON list of {"name", "parameters"} as calls (None when it does not parse: a
    length cut)."""
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(items, list) or not all(
        isinstance(i, dict) and isinstance(i.get("name"), str) for i in items
    ):
        return None
    return [call_out(i["name"], i.get("parameters", {})) for i in items]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)

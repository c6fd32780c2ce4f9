"""Structured outputs: the Reasoner's tokens constrained to a JSON schema, any JSON object, a regex, a list of
choices, a Lark / GBNF grammar or structural tags (vLLM's `structured_outputs`, `response_format`), through
llguidance (vLLM's "guidance" backend: a Rust Earley parser that computes each step's token mask lazily,
with no per-grammar precompilation over the vocabulary).

Here, without torch (the API uses it): `grammar_text(StructuredOutput)` is the llguidance grammar of a
request; `check(StructuredOutput)` raises ParamError naming the request field when it does not compile (the
API calls it before accepting a request). sampling/token_grammar.py applies a grammar to the logits.
llguidance's compiler recurses once per rule of a chain (a 2,000-deep $ref chain overflows an 8 MiB thread
stack and kills the process), so every compile runs `on_big_stack` and a spec is at most MAX_SPEC_BYTES.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from worldserve.chat_params import StructuredOutput
from worldserve.params import ParamError

MAX_SPEC_BYTES = 1 << 20
"""Largest constraint (schema, regex, grammar, choice list) taken, in UTF-8 bytes: far above any schema a
prompt would carry, and within what COMPILE_STACK_BYTES compiles (a 50,000-rule chain needs ~500 MiB)."""
COMPILE_STACK_BYTES = 1 << 30
"""The compile thread's stack (virtual memory: only the pages a deep grammar touches are ever committed)."""
SCHEMA_KEYWORDS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))
"""Keywords whose value maps names to schemas (`closed_objects` walks each of those schemas)."""
LITERAL_KEYWORDS = frozenset(("const", "enum", "default", "examples", "required", "x-guidance"))
"""Keywords whose value is data, not a schema (`closed_objects` leaves them as they are; it walks every other
value, which is a schema, a list of schemas, or an extension's data it cannot tell from one)."""

T = TypeVar("T")
_STACK_LOCK = threading.Lock()
COMPILE_THREADS = 4
"""Grammar compiles running at once (each thread reserves COMPILE_STACK_BYTES of address space); the rest
wait their turn."""
_COMPILES = threading.BoundedSemaphore(COMPILE_THREADS)


def on_big_stack(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a thread of its own with COMPILE_STACK_BYTES of stack (the caller waits; at most
    COMPILE_THREADS such threads at a time)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller
            result["error"] = exc

    with _COMPILES:
        with _STACK_LOCK:  # threading.stack_size is process-wide: set, start, restore
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
                thread.start()
            finally:
                threading.stack_size(previous)
        thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar of `so`; ParamError(so.field) when its spec is not even well-formed."""
    if len(so.spec.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise ParamError(so.field, f"the {so.kind} constraint is longer than {MAX_SPEC_BYTES} bytes")
    options: JsonCompileOptions = {"whitespace_flexible": so.any_whitespace}
    if so.whitespace_pattern is not None:
        options["whitespace_pattern"] = so.whitespace_pattern
    try:
        if so.kind == "json":
            schema = json.loads(so.spec)
            if not isinstance(schema, dict | bool):
                raise ParamError(so.field, "the JSON schema must be a JSON object")
            if schema is False:
                raise ParamError(so.field, "the JSON schema false matches no document")
            schema = {} if schema is True else schema  # true: any JSON document, as {}
            if not so.additional_properties:
                schema = closed_objects(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if so.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if so.kind == "regex":
            if (
                len(so.spec) - len(so.spec.rstrip("\\"))
            ) % 2:  # llguidance takes a dangling escape as a literal
                raise ParamError(
                    so.field, "invalid regex constraint: the pattern ends with an unfinished escape (\\)"
                )
            return llguidance.LLMatcher.grammar_from_regex(so.spec)
        if so.kind == "choice":  # one terminal (a single lexeme): Earley rules per choice stop at ~2,000
            choices = json.loads(so.spec)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            )
        if so.kind == "grammar":
            return llguidance.grammar_from("grammar", so.spec)  # Lark, or GBNF / EBNF converted to Lark
        if so.kind == "structural_tag":
            return structural_tag_grammar(json.loads(so.spec), so.field)
    except ParamError:
        raise
    except (ValueError, TypeError, RecursionError) as exc:  # json.JSONDecodeError is a ValueError
        raise ParamError(so.field, f"invalid {so.kind} constraint: {exc}") from None
    raise ParamError(so.field, f"unknown structured output kind {so.kind!r}")


def check(so: StructuredOutput) -> None:
    """Compile `so`'s grammar once (no tokenizer needed): ParamError naming its field when it is invalid."""
    text = grammar_text(so)
    is_error, messages = on_big_stack(llguidance.LLMatcher.validate_grammar_with_warnings, text)
    if is_error:
        raise ParamError(so.field, f"invalid {so.kind} constraint: {messages[0].strip()}")


def closed_objects(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema without `additionalProperties` gets
    `additionalProperties: false` (only the listed properties may appear). Literals (const, enum, default,
    examples) are left as they are. RecursionError past Python's depth (the caller answers a 400)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in LITERAL_KEYWORDS:
            out[key] = value
        elif key in SCHEMA_KEYWORDS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            out[key] = closed_objects(value)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def structural_tag_grammar(tag: Any, field: str) -> str:
    """vLLM's structural tag {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text in
    which a trigger starts one of the structures, whose body then follows its JSON schema up to its end."""
    if isinstance(tag, dict) and "format" in tag and "structures" not in tag:
        raise ParamError(field, 'a structural tag\'s "format" form (xgrammar\'s newer one) is not supported: give '
                         'its "structures" list and "triggers" (vLLM\'s structural tag)')  # fmt: skip
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not tag["structures"]:
        raise ParamError(field, 'a structural tag needs a non-empty "structures" list')
    triggers = tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ParamError(field, 'a structural tag needs a non-empty "triggers" list of non-empty strings')
    tags = []
    for i, s in enumerate(tag["structures"]):
        if (
            not isinstance(s, dict)
            or not isinstance(s.get("begin"), str)
            or not isinstance(s.get("end"), str)
        ):
            raise ParamError(field, f'structures[{i}] needs string "begin" and "end" and a "schema"')
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ParamError(field, f"structures[{i}].begin {s['begin']!r} starts with none of the triggers")
        schema = s.get("schema", {})
        if not isinstance(schema, dict | bool):
            raise ParamError(field, f"structures[{i}].schema must be a JSON schema object")
        if schema is False:
            raise ParamError(field, f"structures[{i}].schema false matches no document")
        schema = {} if schema is True else schema  # true: any JSON document, as {} (llguidance takes no bool)
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    # a trigger such as "<tool_call>" or "<a>" is text: llguidance would take one of the form <...> for a special
    # token's name, which Qwen's <tool_call> is not here (only the truly special ids are), and refuse the grammar
    return llguidance.StructTag.to_grammar(tags, assume_special=False)

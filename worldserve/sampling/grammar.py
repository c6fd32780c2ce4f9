"""Structured outputs: the Reasoner's tokens constrained to a JSON schema, any JSON object, a regex, a list of
choices, a Lark / GBNF grammar or structural tags (vLLM's `structured_outputs`, `response_format`), through
llguidance (vLLM's "guidance" backend: a Rust Earley parser that computes each step's token mask lazily,
with no per-grammar precompilation over the vocabulary).

Here, without torch (the API uses it): `grammar_text(StructuredOutput)` is the llguidance grammar of a
request; `check(StructuredOutput)` raises ParamError naming the request field when it does not compile (the
API calls it before accepting a request). sampling/token_grammar.py applies a grammar to the logits.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from worldserve.chat_params import StructuredOutput
from worldserve.params import ParamError


def grammar_text(so: StructuredOutput) -> str:
    """The llguidance grammar of `so`; ParamError(so.field) when its spec is not even well-formed."""
    options: dict[str, Any] = {"whitespace_flexible": so.any_whitespace}
    if so.whitespace_pattern is not None:
        options["whitespace_pattern"] = so.whitespace_pattern
    try:
        if so.kind == "json":
            schema = json.loads(so.spec)
            if not isinstance(schema, dict | bool):
                raise ParamError(so.field, "the JSON schema must be a JSON object")
            if not so.additional_properties:
                schema = closed_objects(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if so.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if so.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(so.spec)
        if so.kind == "choice":
            choices = json.loads(so.spec)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            )
        if so.kind == "grammar":
            return llguidance.grammar_from("grammar", so.spec)  # Lark, or GBNF / EBNF converted to Lark
        if so.kind == "structural_tag":
            return structural_tag_grammar(json.loads(so.spec), so.field)
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise ParamError(so.field, f"invalid {so.kind} constraint: {exc}") from None
    raise ParamError(so.field, f"unknown structured output kind {so.kind!r}")


def check(so: StructuredOutput) -> None:
    """Compile `so`'s grammar once (no tokenizer needed): ParamError naming its field when it is invalid."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(so))
    if is_error:
        raise ParamError(so.field, f"invalid {so.kind} constraint: {messages[0].strip()}")


def closed_objects(schema: Any) -> Any:
    """vLLM's disable_additional_properties: every object schema without `additionalProperties` gets
    `additionalProperties: false` (only the listed properties may appear)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def structural_tag_grammar(tag: Any, field: str) -> str:
    """vLLM's structural tag {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text in
    which a trigger starts one of the structures, whose body then follows its JSON schema up to its end."""
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
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return llguidance.StructTag.to_grammar(tags)

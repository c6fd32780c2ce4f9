"""The structured-output fields of chat and text completions, read into one StructuredOutput (vLLM's names).

- `response_format`: {"type": "text"} (free text), {"type": "json_object"} (any JSON object),
  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (OpenAI's; "name" is required, as
  in OpenAI's and vLLM's request models, and "schema" too, as vLLM needs it),
  {"type": "structural_tag", "structures": [...], "triggers": [...]} (vLLM's).
- `structured_outputs` (vLLM >= 0.10): exactly one of json (a schema, object or JSON text), regex, choice
  (a list of strings), grammar (Lark or GBNF / EBNF), json_object (true), structural_tag (JSON text); with
  the options disable_any_whitespace, disable_additional_properties, whitespace_pattern (disable_fallback
  and backend choose among vLLM's backends: ignored, there is one); options alone shape the constraint
  another field gives (`response_format`, a tool choice, a guided_* field), as vLLM writes that one into
  the structured_outputs sent.
- vLLM's older top-level guided_json / guided_regex / guided_choice / guided_grammar / structural_tag, with
  guided_whitespace_pattern (guided_decoding_backend is ignored, as above).

At most one of these may constrain a request (a 400 naming the second, as vLLM refuses several); each
malformed value, or grammar that does not compile or fails at its first two tokens, is a 400 naming its field (sampling/grammar.py builds the grammar, sampling/token_grammar.py compiles it
with the tokenizer).
With other token rules, as vLLM combines them: `allowed_token_ids` and the grammar both mask each step (a
token must pass both); ids none of which the grammar takes first are a 400 naming `allowed_token_ids`, as
vLLM's sampling would have no token left (it fails such a request mid-answer). `min_tokens` holds the end
back while the grammar allows any other token; once the grammar allows only the end, the end wins and the
answer stops short of min_tokens (vLLM's since its PR #54218: before, the empty mask failed the request).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from worldserve.api.bodies import check_depth, too_deep
from worldserve.chat_params import StructuredOutput
from worldserve.params import ParamError
from worldserve.sampling.grammar import check

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The constraint keys of `structured_outputs` (vLLM's StructuredOutputsParams)."""
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "structural_tag": "structural_tag"}  # fmt: skip
"""vLLM's older top-level fields and the constraint each one is."""


def is_set(value: Any) -> bool:
    """Whether a request field asks for something, as vLLM counts them: anything but null and false (an
    empty schema is any JSON, an empty regex the empty text; json_object: false asks for nothing)."""
    return value is not None and value is not False


def structured_output(
    body: Any, tools: StructuredOutput | None = None, compiler: Any = None, thinks: bool = False
) -> StructuredOutput | None:
    """The request's one structured-output constraint, checked, or None for free text. `body`: a chat or text
    completion request (api/sampling_request.py SamplingRequest); `tools`: a required or named tool choice's
    constraint (api/tool_calls.py), which counts as one; `compiler`: the Reasoner's GrammarCompiler
    (`grammar_compiler`), which compiles the grammar with its tokenizer, tries its first two tokens and keeps
    it for the chat (blocking: call this off the event loop), and checks the request's allowed_token_ids
    against it (`thinks`: the answer may open with <think>, --reasoning-parser); without one (no Reasoner, test
    fakes) the grammar is compiled alone. Raises ParamError."""
    own, options = _structured_outputs(body.structured_outputs)
    found = [so for so in (tools, _response_format(body.response_format), own) if so is not None]
    pattern = body.guided_whitespace_pattern
    if pattern is not None and not isinstance(pattern, str):
        raise ParamError("guided_whitespace_pattern", "guided_whitespace_pattern must be a string")
    for name, kind in GUIDED_FIELDS.items():
        if isinstance(value := getattr(body, name), bool):  # (vLLM's request model takes no boolean here)
            raise ParamError(name, f"{name} takes a constraint (text, a JSON object or a list), not {value}")
        if is_set(value):
            found.append(_constraint(kind, value, name, whitespace_pattern=pattern))
    if len(found) > 1:
        raise ParamError(
            found[1].field,
            f"only one structured output constraint may be given, got {found[0].field} and {found[1].field}",
        )
    if own is None and is_set(body.structured_outputs):  # options alone: they shape the constraint given
        if not found:  # elsewhere (vLLM writes response_format into the structured_outputs sent)
            raise ParamError("structured_outputs", f"structured_outputs takes exactly one constraint of "
                             f"{', '.join(CONSTRAINTS)}; none is given")  # fmt: skip
        found[0] = dataclasses.replace(found[0], **options)
    if not found:
        return None
    if compiler is not None:
        compiler.compile(found[0])
        _check_allowed_ids(found[0], body.allowed_token_ids, compiler, thinks)
    else:
        check(found[0])
    return found[0]


def _check_allowed_ids(so: StructuredOutput, allowed: list[int] | None, compiler: Any, thinks: bool) -> None:
    """ParamError("allowed_token_ids") when none of the request's allowed_token_ids may start the answer
    under `so`'s grammar. vLLM applies both masks to every step's logits (each token must pass both); where
    they leave no token it samples from nothing and fails the request (finish_reason "error", or a 500).
    Refused here, before any model work, when it shows at the first token."""
    if allowed and not compiler.allows_first(so, allowed, thinks):
        raise ParamError("allowed_token_ids", f"allowed_token_ids holds no token the structured output "
                         f"({so.field}) allows as the answer's first token: each token must pass both, so "
                         "none could be sampled")  # fmt: skip


def grammar_compiler(worker: Any) -> Any:
    """The chat worker's Reasoner's GrammarCompiler, or None (no Reasoner, or a backend without grammars)."""
    return worker.backend.grammars if worker is not None else None


def _response_format(rf: dict[str, Any] | None) -> StructuredOutput | None:
    if rf is None:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(kind="json_object", field="response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        # "name" is required by OpenAI's and vLLM's request models
        if isinstance(js, dict) and not isinstance(js.get("name"), str):
            raise ParamError(
                "response_format.json_schema.name", 'response_format json_schema needs its "name" (a string)'
            )
        schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
        if schema is None:
            raise ParamError(
                "response_format", 'response_format json_schema needs "json_schema": {"schema": ...}'
            )
        return _constraint("json", schema, "response_format.json_schema.schema")
    if kind == "structural_tag":
        return _constraint("structural_tag", {k: v for k, v in rf.items() if k != "type"}, "response_format")
    raise ParamError(
        "response_format",
        f"response_format type must be text, json_object, json_schema or structural_tag, got {kind!r}",
    )


def _structured_outputs(so: Any) -> tuple[StructuredOutput | None, dict[str, Any]]:
    """`structured_outputs`' constraint (None when it gives none: its options may shape another field's
    constraint) and its options, as StructuredOutput's keywords."""
    if not is_set(so):
        return None, {}
    if not isinstance(so, dict):
        raise ParamError("structured_outputs", "structured_outputs must be an object")
    given = [k for k in CONSTRAINTS if is_set(so.get(k))]
    if len(given) > 1:
        raise ParamError("structured_outputs", f"structured_outputs takes exactly one constraint of "
                         f"{', '.join(CONSTRAINTS)}; {len(given)} are ({', '.join(given)}) given")  # fmt: skip
    options: dict[str, Any] = {}
    for key, flag in (("disable_any_whitespace", "any_whitespace"),
                      ("disable_additional_properties", "additional_properties")):  # fmt: skip
        if so.get(key) is not None:
            if not isinstance(so[key], bool):
                raise ParamError(f"structured_outputs.{key}", f"{key} must be a boolean")
            options[flag] = not so[key]
    if (pattern := so.get("whitespace_pattern")) is not None:
        if not isinstance(pattern, str):
            raise ParamError("structured_outputs.whitespace_pattern", "whitespace_pattern must be a string")
        options["whitespace_pattern"] = pattern
    if not given:
        return None, options
    return _constraint(given[0], so[given[0]], f"structured_outputs.{given[0]}", **options), options


def _constraint(kind: str, value: Any, field: str, **options: Any) -> StructuredOutput:
    """One constraint's StructuredOutput, its value's type checked (ParamError naming `field`)."""
    if kind == "json_object":
        return StructuredOutput(kind=kind, field=field, **options)
    if kind in ("json", "structural_tag"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ParamError(field, f"{field} is not valid JSON: {exc}") from None
            except RecursionError:
                raise ParamError(field, too_deep(field)) from None
            check_depth(value, field)
        if not isinstance(value, dict | bool) or (kind == "structural_tag" and not isinstance(value, dict)):
            raise ParamError(field, f"{field} must be a JSON object")
        return StructuredOutput(kind=kind, spec=json.dumps(value), field=field, **options)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ParamError(field, f"{field} must be a non-empty list of strings")
        return StructuredOutput(kind=kind, spec=json.dumps(value), field=field, **options)
    if not isinstance(value, str):
        raise ParamError(field, f"{field} must be a string")
    return StructuredOutput(kind=kind, spec=value, field=field, **options)

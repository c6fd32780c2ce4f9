"""Nested values in a form, as the OpenAI SDK sends them.

`client.videos.create(...)` posts multipart/form-data, and the SDK writes a nested value given through
`extra_body` key by key in brackets (openai/_qs.py, array_format "brackets"): `extra_body={"extra_params":
{"seed": 3, "l": [1, 2], "d": {"x": "y"}}}` arrives as the fields `extra_params[seed]=3`,
`extra_params[l][]=1`, `extra_params[l][]=2` and `extra_params[d][x]=y`. A form's unknown fields are ignored
(FastAPI's, so vLLM-Omni's, way), so such a request had run without its extra_params, in silence.
`fold_brackets` gives those fields of the request's own names back as the objects they were: each value a
JSON number or true / false where it is one (the SDK writes 3, 2.0, true), else its text. The objects
are held to the JSON bodies' depth (bodies.MAX_JSON_DEPTH): a name of 3,000 `[a]`s built an object too deep
for what reads it recursively (the 400 naming a bad key became a 500).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import Any

from worldserve.api.bodies import check_depth
from worldserve.api.errors import APIError

BRACKETED = re.compile(r"([^\[\]]+)((?:\[[^\[\]]*\])+)")
"""`head[key][key]...`, a key empty for a list item (`head[l][]`)."""
_KEY = re.compile(r"\[([^\[\]]*)\]")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


def fold_brackets(items: Iterable[tuple[str, Any]], known: Collection[str]) -> dict[str, dict[str, Any]]:
    """{field: object} of the bracketed text items (name, value) whose field is in `known`; a 400 naming
    the field when one key is given twice, both a value and keys below it, a list of objects, or keys nested
    deeper than a JSON body may nest."""
    folded: dict[str, dict[str, Any]] = {}
    for name, value in items:
        match = BRACKETED.fullmatch(name)
        if match is None or match.group(1) not in known or not isinstance(value, str):
            continue
        head, keys = match.group(1), _KEY.findall(match.group(2))
        _insert(folded, name, [head, *keys], _scalar(value))
    # as deep as the same fields in a JSON body (`{"extra_params": {...}}`), and named the same way
    check_depth(folded)
    return folded


def _insert(root: dict[str, Any], name: str, path: list[str], value: Any) -> None:
    """root[path[0]][path[1]]... = value, a key "" appending to a list (only as the last key)."""
    head, node = path[0], root
    for depth, key in enumerate(path[:-1]):
        if path[depth + 1] == "":  # a list item: the last key
            items = node.setdefault(key, [])
            if not isinstance(items, list):
                raise _clash(head, name)
            if depth + 2 != len(path):
                raise APIError(400, f"{name}: a list of objects cannot be sent as bracketed form fields; send "
                               f"{head} as one JSON text field", param=head)  # fmt: skip
            items.append(value)
            return
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise _clash(head, name)
        node = child
    if path[-1] in node:
        raise _clash(head, name)
    node[path[-1]] = value


def _clash(head: str, name: str) -> APIError:
    return APIError(400, f"{name} was given twice, or beside a value of the key above it: send each of "
                    f"{head}'s keys once", param=head)  # fmt: skip


def _scalar(text: str) -> Any:
    """A bracketed field's value as the SDK wrote it: a JSON number or true / false where it is one, else
    the text (inf, nan and numbers past Python's int-from-text limit stay text, for validation to name)."""
    if text in ("true", "false"):
        return text == "true"
    if _NUMBER.fullmatch(text):
        try:
            return int(text) if text.lstrip("-").isdigit() else float(text)
        except ValueError:
            return text
    return text

"""The vocabulary of serve_compat.py's table of vLLM / vLLM-Omni flags: `CompatFlag` (one flag worldserve takes
with no effect, possibly only at some values, refusing the others with a reason) and the argparse types and
keyword shorthands its rows use (`checked`, `json_object`, `level_or_json`, POSITIVE_INT, FLOAT, JSON, ON,
SWITCH, and the value tests NEVER and EMPTY). Imports no torch: the table is read at every CLI start.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from worldserve.config import FlagValueError, json_flag


def checked(kind: type, ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` when `ok` accepts it, else FlagValueError (argparse: exit 2, naming the flag)."""

    def parse(text: str) -> Any:
        """`kind(text)`, checked."""
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise FlagValueError(f"expected {expected}, got {text!r}")
        return value

    return parse


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object, as vLLM's `--hf-overrides '{"architectures": [...]}'`."""
    value = json_flag(text, "a JSON object")
    if not isinstance(value, dict):
        raise FlagValueError(f"expected a JSON object, got {text!r}")
    return value


def level_or_json(text: str) -> int | dict[str, Any]:
    """An argparse type: vLLM's `-O` / `--compilation-config`, an optimization level or a JSON object."""
    try:
        return int(text)
    except ValueError:
        return json_object(text)


POSITIVE_INT = checked(int, lambda v: v >= 1, "an integer >= 1")
FLOAT = checked(float, math.isfinite, "a number")
JSON = {"type": json_object, "metavar": "JSON"}
ON = {"action": "store_true"}
SWITCH = {"action": argparse.BooleanOptionalAction}  # (vLLM's bool fields: --flag / --no-flag, get_kwargs)
NEVER: Callable[[Any], bool] = lambda v: False  # noqa: E731  (a flag that is refused whenever it is given)
EMPTY: Callable[[Any], bool] = lambda v: v == {}  # noqa: E731


@dataclass(frozen=True, slots=True)
class CompatFlag:
    """One vLLM / vLLM-Omni flag that worldserve accepts (possibly only at some values) without an effect."""

    flag: str
    """Its vLLM spelling; the dest is its name in snake case."""
    why: str
    """Why an accepted value has no effect here ({gpus} / {max_batch_size}: filled in at startup)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """argparse keywords (type, action, choices, metavar, nargs)."""
    ok: Callable[[Any], bool] | None = None
    """Which given values are accepted; None: all (that parse). The others are refused at startup."""
    accepts: str = ""
    """The accepted values, for --help (e.g. "only at none")."""
    refusal: str = ""
    """Why other values are refused, with what to do instead: the startup error after `--flag value: `."""
    level: int = logging.INFO
    """The log level of the accepted line (a warning where vLLM's meaning changes outputs)."""
    aliases: tuple[str, ...] = ()
    shown: bool = True
    """Whether the refusal quotes the value given (False: a secret, such as a token)."""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

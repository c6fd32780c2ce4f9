"""Type checks of a request's parameters, run first thing by VideoParams.validate and ChatParams.validate so that
a value of the wrong type (a string, None, 64.0, True) is a ParamError naming the field, never a raw TypeError
from a comparison deep inside or a silent acceptance that fails after the prompt's prefill.

Ints are `numbers.Integral` (numpy integer scalars too, as vLLM and torch take them), reals `numbers.Real`
(ints and numpy floats too); a bool is neither, as a request's `true` is no number. The HTTP routes convert their
fields (pydantic) before building params, so these checks only ever refuse what the Python API was handed.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable

import numpy as np

from worldserve.param_errors import ParamError

BOOLS = (bool, np.bool_)
"""What a boolean field takes (numpy's bool scalar too: what a comparison of arrays gives)."""


def type_name(value: object) -> str:
    """How an error names the type a value came as (None as itself)."""
    return "None" if value is None else type(value).__name__


def is_int(value: object) -> bool:
    """An integer (a Python or numpy one), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, BOOLS)


def is_real(value: object) -> bool:
    """A real number (int, float, numpy scalar), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, BOOLS)


def check_int(param: str, name: str, value: object, optional: bool = False) -> None:
    """ParamError(param, "<name> must be an integer, got <type>") unless `value` is one (or None, `optional`)."""
    if not (is_int(value) or (optional and value is None)):
        raise ParamError(param, f"{name} must be an integer, got {type_name(value)}")


def check_real(param: str, name: str, value: object, optional: bool = False) -> None:
    """ParamError(param, "<name> must be a number, got <type>") unless `value` is one (or None, `optional`)."""
    if not (is_real(value) or (optional and value is None)):
        raise ParamError(param, f"{name} must be a number, got {type_name(value)}")


def check_bool(param: str, name: str, value: object, optional: bool = False) -> None:
    """ParamError(param, "<name> must be a boolean, got <type>") unless `value` is one (or None, `optional`):
    "yes", 1 or "false" is no switch."""
    if not (isinstance(value, BOOLS) or (optional and value is None)):
        raise ParamError(param, f"{name} must be a boolean, got {type_name(value)}")


def check_str(param: str, name: str, value: object, optional: bool = False) -> None:
    """ParamError(param, "<name> must be a string, got <type>") unless `value` is one (or None, `optional`)."""
    if not (isinstance(value, str) or (optional and value is None)):
        raise ParamError(param, f"{name} must be a string, got {type_name(value)}")


def check_items(param: str, name: str, values: object, kind: str, optional: bool = False) -> None:
    """ParamError naming `param` unless `values` is a list or tuple (or None, `optional`) whose every item is
    of `kind`: "int" or "str" (a string is no list of strings: "END" is not ("E", "N", "D"))."""
    if optional and values is None:
        return
    if not isinstance(values, (list, tuple)):
        raise ParamError(param, f"{name} must be a list, got {type_name(values)}")
    if kind == "int":
        # (the exact-type test first: a raw prompt's 100k ids are plain ints, and the ABC check is slower)
        _check_all(param, name, values, lambda v: type(v) is int or is_int(v), "integers")
    else:
        _check_all(param, name, values, lambda v: isinstance(v, str), "strings")


def check_real_pair(param: str, name: str, value: object) -> None:
    """ParamError naming `param` unless `value` is a list or tuple of exactly two numbers ([lo, hi])."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        got = f"{len(value)} values" if isinstance(value, (list, tuple)) else type_name(value)
        raise ParamError(param, f"{name} must be [lo, hi], two numbers, got {got}")
    _check_all(param, name, value, is_real, "numbers")


def _check_all(
    param: str, name: str, values: Iterable[object], test: Callable[[object], bool], noun: str
) -> None:
    for value in values:
        if not test(value):
            raise ParamError(
                param, f"{name} must be a list of {noun}, got an item of type {type_name(value)}"
            )

"""The bridge between config.py's frozen dataclasses and argparse: one flag per field, its help the string
written below the field (vLLM's way), its default the field's default, its type the field's; and back, a
dataclass from the parsed flags. Field metadata may mark a flag positional, hidden or flagless, or give it
choices, aliases or nargs. A bool field is a `--flag` / `--no-flag` pair, as vLLM's bool fields are
(arg_utils.get_kwargs' BooleanOptionalAction), unless its metadata says store_true (`--flag` alone: flags
that vLLM or vLLM-Omni define so, and worldserve's own switches). A field that may be None reads "None" as
None, its default, as vLLM's optional_type does (`--seed None`, `--revision None`). The offline Engine's options
(offline/options.py) read a value given as text with the same types and choices (`parse_flag_text`)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing

from worldserve.config_values import FlagValueError


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal written right below it in the class body (vLLM's get_attr_docs)."""
    class_def = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(class_def, ast.ClassDef), cls
    body = class_def.body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def scalar_type(hint: object) -> type:
    """A config field's type hint without its `| None`: `int | None` -> int, `HumanInt` -> HumanInt. The type
    argparse converts the flag's text with, and the one the offline Engine (offline/options.py) converts a
    keyword argument's value to; an assertion error for a hint that is no type (a list[str] field has nargs)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner
    assert isinstance(hint, type), hint
    return hint


def none_or(kind: typing.Callable[[str], typing.Any]) -> typing.Callable[[str], typing.Any]:
    """vLLM's optional_type: "None" is None, any other text `kind(text)`; argparse's "invalid int value"
    still names `kind`. Unlike vLLM, "" stays `kind("")`, which the configs refuse where it matters: an unset
    variable in `--storage-dir "$DIR"` or `--lora-path "$ADAPTER"` is an error, not the default."""

    def parse(text: str) -> typing.Any:
        return None if text == "None" else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def may_be_none(hint: object) -> bool:
    """`int | None` and the like: a union with None in it."""
    is_union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return is_union and type(None) in typing.get_args(hint)


class ChoicesOrNone(tuple[typing.Any, ...]):
    """A flag's choices and the None its "None" reads as: argparse's usage, help and invalid-choice message
    list them without None (they iterate the choices: `{fp8,None}` read as if None were a value to type),
    its check (`value in choices`) takes None."""

    def __contains__(self, value: object) -> bool:
        return value is None or super().__contains__(value)


def value_kwargs(f: dataclasses.Field[typing.Any], hint: object) -> dict[str, typing.Any]:
    """How the flag of field `f` (type hint `hint`) reads its value: argparse's action, type, choices, nargs
    and metavar (add_config_arguments adds the help and default); the offline Engine's options read a value
    given as text the same way (parse_flag_text)."""
    meta = f.metadata
    kind = str if "nargs" in meta else scalar_type(hint)  # nargs: a list of strings
    kwargs: dict[str, typing.Any] = {}
    if kind is bool:  # vLLM's get_kwargs: a bool field is --flag / --no-flag; metadata store_true: --flag
        kwargs["action"] = "store_true" if meta.get("store_true") else argparse.BooleanOptionalAction
    elif may_be_none(hint) and "nargs" not in meta and not meta.get("positional"):
        kwargs["type"] = none_or(kind)
    else:
        kwargs["type"] = kind
    if "choices" in meta:
        kwargs["choices"] = meta["choices"]
        # (the None that "None" reads as is one of them, as in vLLM, but not listed)
        if kwargs.get("type") not in (None, kind):
            kwargs["choices"] = ChoicesOrNone(meta["choices"])
    if "nargs" in meta:
        kwargs["nargs"] = meta["nargs"]
    if "metavar" in meta:
        kwargs["metavar"] = meta["metavar"]
    return kwargs


def parse_flag_text(f: dataclasses.Field[typing.Any], hint: object, text: str) -> typing.Any:
    """`text` read as `--flag text` reads it (a flag that takes one value): the flag's type, then its
    choices; FlagValueError with argparse's message (`invalid int value: 'x'`, `invalid choice: ...`)."""
    convert = value_kwargs(f, hint).get("type", str)
    try:
        value = convert(text)
    except argparse.ArgumentTypeError as exc:  # (a FlagValueError too: its message as it is)
        raise FlagValueError(str(exc)) from None
    except (TypeError, ValueError):
        raise FlagValueError(f"invalid {getattr(convert, '__name__', 'value')} value: {text!r}") from None
    check_choice(f, hint, value)
    return value


def check_choice(f: dataclasses.Field[typing.Any], hint: object, value: typing.Any) -> None:
    """FlagValueError with argparse's message unless `value` is one of the flag's choices (if it has any)."""
    choices = value_kwargs(f, hint).get("choices")
    if choices is not None and value not in choices:
        listed = ", ".join(repr(c) for c in choices if c is not None)
        raise FlagValueError(f"invalid choice: {value!r} (choose from {listed})")


def add_config_arguments(
    parser: argparse.ArgumentParser, cls: type, only: typing.Collection[str] | None = None
) -> None:
    """One flag per dataclass field (none for metadata no_flag; with `only`, for those fields alone: a verb
    that uses some of a config's fields); metadata may mark it positional, hidden, or give
    choices/aliases/metavar."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if meta.get("no_flag") or (only is not None and f.name not in only):
            continue
        text = docs.get(f.name, "")
        if f.default not in (None, False, ""):
            text += f" (default: {f.default})"
        elif f.default is None and "choices" in meta and "default" not in text.lower():
            # (its choices list no None: say what leaving it out means)
            text += " (default: none)"
        kwargs: dict[str, typing.Any] = {"help": argparse.SUPPRESS if meta.get("hidden") else text}
        kwargs.update(value_kwargs(f, hints[f.name]))
        if meta.get("positional"):
            group.add_argument(f.name, nargs="?", default=f.default, metavar=f.name.upper(), **kwargs)
        else:
            flags = ["--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
            group.add_argument(*flags, dest=f.name, default=f.default, **kwargs)


def config_from_args(cls: type, args: argparse.Namespace) -> typing.Any:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

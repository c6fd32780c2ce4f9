"""`worldserve serve --config FILE`: a YAML file of flags, as vLLM reads it (keys spelled as the flags without
`--`, `false` a flag's `--no-` form, a list a repeatable flag's values); a flag the command line also gives
keeps the command line's value, even at its default (vLLM puts the file's flags before the command line's).

`record_given` marks which flags the command line gave (their dests in the namespace's GIVEN set);
`apply_config_file` then fills the others from the file. Inputs: the parsed namespace and a factory of the
same parser; output: the namespace, filled in place; a file that cannot be read, a key that is no flag or a
value that does not parse is a FlagValueError naming the file (exit 2, before anything binds or loads).
Separate from serve_http.py (the HTTP server's flags): this reads every flag of `serve`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any, NoReturn, cast

from worldserve.config import FlagValueError

GIVEN = "_given_on_command_line"
"""The namespace attribute record_given fills: the dests of the flags the command line gave."""
_RECORDING: dict[type, type] = {}


def record_given(parser: argparse.ArgumentParser) -> None:
    """Make every flag of `parser` note its dest in the namespace's GIVEN set when the command line gives it,
    so that --config fills only the others (a flag given at its default value still wins, as in vLLM, where
    the command line's flags come after the file's)."""
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            cls = type(action)
            if cls not in _RECORDING:
                _RECORDING[cls] = type(cls.__name__, (cls,), {"__call__": _recorded})
            action.__class__ = _RECORDING[cls]


def _recorded(
    self: argparse.Action, parser: Any, namespace: Any, values: Any, option_string: Any = None
) -> None:
    # record_given's subclass has one base, the flag's own Action class (store, append, BooleanOptional...)
    base = cast(type[argparse.Action], type(self).__bases__[0])
    base.__call__(self, parser, namespace, values, option_string)
    setattr(namespace, GIVEN, {*getattr(namespace, GIVEN, ()), self.dest})


def _config_argv(path: str, data: dict, parser: argparse.ArgumentParser, model_given: bool) -> list[str]:
    """The flags of a --config mapping as command-line words, as vLLM spells them: true is the switch, false
    the --no- form where the flag has one, a list the flag's values (repeated flag for a repeatable one)."""
    argv: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if flag not in ("--model", "--config") and (
            action is None or isinstance(action, argparse._HelpAction | argparse._VersionAction)
        ):
            # (exactly a flag's name: argparse took `help: true` as --help, printed it and exited 0, and an
            # abbreviation as the flag it abbreviates)
            raise FlagValueError(f"--config {path}: {key!r} is not a `worldserve serve` option (a key is a "
                                 "flag's name without its --, as `worldserve serve --help` lists them)")  # fmt: skip
        if flag == "--model" and not model_given:
            argv.insert(0, str(value))  # the positional MODEL
        elif flag in ("--model", "--config"):
            continue  # the command line's MODEL wins; no nested config files
        elif value is True:
            argv.append(flag)
        elif value is False:
            if "--no-" + flag[2:] in parser._option_string_actions:
                argv.append("--no-" + flag[2:])
        elif isinstance(value, list):
            words = [json.dumps(v) if isinstance(v, dict | list) else str(v) for v in value]
            if action is not None and action.nargs is None:  # one value a flag: each item its own flag
                if len(words) > 1 and not isinstance(action, argparse._AppendAction):
                    raise FlagValueError(f"--config {path}: {flag} takes one value, got the list {value}")
                argv += [w for word in words for w in (flag, word)]
            else:
                argv += [flag, *words]
        elif value is not None:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def apply_config_file(args: argparse.Namespace, parser_for: Callable[[], argparse.ArgumentParser]) -> None:
    """--config FILE: its flags fill `args` where the command line gave none (vLLM: the command line wins;
    a namespace from a parser without record_given: where the value is the default). FlagValueError naming
    the file for a file that cannot be read or a flag that does not parse."""
    path = getattr(args, "config", None)
    if not path:
        return
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
        why = " ".join(str(exc).split())  # (YAML's errors span lines: one line, as every flag error)
        why = f"not UTF-8 text: {why}" if isinstance(exc, UnicodeDecodeError) else why
        raise FlagValueError(f"--config {path}: cannot read it ({why})") from None
    if not isinstance(data, dict):
        raise FlagValueError(f"--config {path}: expected a mapping of flags to values")
    parser = parser_for()
    argv = _config_argv(path, data, parser, getattr(args, "model", None) is not None)

    def refuse(message: str) -> NoReturn:
        raise FlagValueError(f"--config {path}: {message}")

    # argparse would exit naming the wrong command; mypy refuses any assignment to a method, which Python allows
    parser.error = refuse  # type: ignore[method-assign]
    defaults, given = vars(parser.parse_args([])), vars(parser.parse_args(argv))
    on_command_line = getattr(args, GIVEN, None)
    for dest, value in given.items():
        if dest == GIVEN or value == defaults.get(dest):
            continue
        if dest == "model" and getattr(args, "model", None) is not None:
            continue  # the command line's MODEL
        if dest in (on_command_line or ()) or (
            on_command_line is None and getattr(args, dest, None) != defaults.get(dest)
        ):
            continue
        setattr(args, dest, value)

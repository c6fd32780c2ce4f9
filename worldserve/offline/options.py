"""`Engine(model, **options)`'s options as an `EngineConfig`: each keyword is a field of one of the config
dataclasses (config.py, config_chat.py, config_server.py, config_lora.py), the same name as `worldserve serve`'s
flag without its dashes (`max_batch_size=2` is `--max-batch-size 2`), so one source of truth serves the CLI and
the Python API (vLLM's `LLM(model, **engine_args)` is built the same way from its EngineArgs).

A value may be what the flag's text would be (`max_model_len="32k"`, `max_batch_size="2"`,
`default_sampling_params='{"0": {...}}'`), read by the flag's own type and choices (config_flags.py
`parse_flag_text`), or the Python value itself: an int (a float only when whole, never a bool) for an int
option, a number for a float one, True / False for a bool one (whose flags take no text), a dict for a JSON
flag, a string or a list of them for a many-valued one, a `torch.dtype` / `torch.device` for `dtype` /
`device` (as vLLM's `LLM(dtype=torch.float16)`). Each is checked before anything loads: a TypeError for a
value of the wrong type, a ValueError for a bad one (a choice not offered, text the flag refuses), the
message starting with the option's name; a config's own check of the value says `name (--flag) ...`. A name
that is no field is a TypeError, as an unexpected keyword argument is; the HTTP server's own options (`port`,
`api_key`, ...) are refused the same way, since no server runs here.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import sys
import typing
from typing import Any

from worldserve.config import EngineConfig
from worldserve.config_flags import check_choice, may_be_none, parse_flag_text, scalar_type

SECTIONS = ("model", "reasoner", "parallel", "scheduler", "video", "lora", "media", "chat")
"""EngineConfig's sections whose fields are options here (not `server`: the HTTP server's, which no
offline Engine runs)."""

SERVER_ONLY_VIDEO_FIELDS = (
    "storage_dir",
    "sync_timeout",
    "job_ttl",
    "job_sweep_interval",
    "openai_failed_job_status",
)
"""VideoApiConfig fields about the HTTP server's job store and sync route: nothing here stores jobs."""


def option_sections() -> dict[str, str]:
    """Option name -> the EngineConfig section (field) whose dataclass owns it."""
    owners: dict[str, str] = {}
    for section in SECTIONS:
        cls = _section_class(section)
        for f in dataclasses.fields(cls):
            if f.metadata.get("no_flag") or (section == "video" and f.name in SERVER_ONLY_VIDEO_FIELDS):
                continue
            owners[f.name] = section
    return owners


def _section_class(section: str) -> type:
    hints = typing.get_type_hints(EngineConfig)
    cls = hints[section]
    assert isinstance(cls, type), cls
    return cls


def engine_config(model: str | None, options: dict[str, Any]) -> EngineConfig:
    """The EngineConfig of `Engine(model, **options)`: TypeError for an unknown option or a value of the wrong
    type, ValueError for a bad value, each naming the option."""
    owners = option_sections()
    if "model" in options:
        raise TypeError("Engine() got the model twice: pass it once, as the first argument")
    by_section: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    by_section["model"]["model"] = None if model is None else str(model)
    for name, value in options.items():
        section = owners.get(name)
        if section is None:
            raise TypeError(_unknown(name))
        by_section[section][name] = _converted(_section_class(section), name, value)
    sections = {}
    for section, values in by_section.items():
        try:
            sections[section] = _section_class(section)(**values)
        except ValueError as exc:
            raise ValueError(_said_of_option(str(exc), options)) from None
    return EngineConfig(**sections)


def _said_of_option(message: str, options: dict[str, Any]) -> str:
    """A config's error as the caller's: one that starts with the flag of an option given (`--max-batch-size
    must be >= 1`) starts with the option's name too (`max_batch_size (--max-batch-size) must be >= 1`)."""
    for name in options:
        flag = "--" + name.replace("_", "-")
        rest = message.removeprefix(flag)
        if rest != message and not rest[:1].isalnum() and rest[:1] != "-":
            return f"{name} ({flag}){rest}"
    return message


def _unknown(name: str) -> str:
    server = {f.name for f in dataclasses.fields(_section_class("server"))} | set(SERVER_ONLY_VIDEO_FIELDS)
    if name in server:
        return f"Engine() got {name!r}, an option of the HTTP server (`worldserve serve`), which Engine runs none of"
    return (
        f"Engine() got an unexpected keyword argument {name!r} (options are `worldserve serve`'s flags, "
        "without dashes: max_batch_size, device, dtype, max_model_len, ...)"
    )


def _converted(cls: type, name: str, value: Any) -> Any:
    """`value` as the field's flag would give it (checked here, before any load): text read by the flag's own
    type and choices, a Python value of the field's type checked (config_flags.py `parse_flag_text`,
    `check_choice`); TypeError / ValueError starting with `name` otherwise."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    hint = typing.get_type_hints(cls)[name]
    value = _plain_value(value)
    kind = str if "nargs" in f.metadata else scalar_type(hint)
    if value is None:
        if may_be_none(hint):
            return None
        raise TypeError(
            f"{name}: expected {_expected(kind)}, got None (leave the option out for its default)"
        )
    if "nargs" in f.metadata:
        return _names(name, value)
    if kind is bool:
        if not isinstance(value, bool):
            flag = "--" + name.replace("_", "-")
            flags = f"{flag} takes" if f.metadata.get("store_true") else f"{flag} / --no-{flag[2:]} take"
            raise TypeError(
                f"{name}: expected True or False, got {_shown(value)} (the CLI's {flags} no text)"
            )
        return value
    if not isinstance(value, str):
        value = _as_kind(name, kind, value)
        if kind in (int, float, str) or isinstance(value, kind):
            try:
                check_choice(f, hint, value)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
            return value
        # (a flag type of config_values.py: built from the text its flag would get)
        try:
            value = str(value) if isinstance(value, int) else json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name}: expected a JSON value ({exc})") from None
    try:
        return parse_flag_text(f, hint, value)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _as_kind(name: str, kind: type, value: Any) -> Any:
    """A Python value (not text) for a field of type `kind`: an integer for an int one (a whole float becomes
    one; a bool or a fraction does not), a number for a float one, a string for a str one, numpy's numbers as
    Python's; a dict or list (JSON) or a number for a flag type; TypeError / ValueError naming `name`
    otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected {_expected(kind)}, got {value!r}")
    if isinstance(value, kind):
        return value
    if isinstance(value, numbers.Integral):
        value = int(value)
    elif isinstance(value, numbers.Real):
        value = float(value)
    if issubclass(kind, int) and isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{name}: expected {_expected(kind)}, got {value!r}")
        return int(value)
    if kind is float and isinstance(value, int | float):
        return float(value)
    flag_type = kind not in (int, float, str)
    taken = (int, dict, list, tuple) if flag_type else (kind,)
    if not isinstance(value, (kind, *taken)):
        raise TypeError(f"{name}: expected {_expected(kind)}, got {_shown(value)}")
    return value


def _names(name: str, value: Any) -> list[str]:
    """A many-valued option (`served_model_name`, `allowed_media_domains`): a string or a non-empty list of
    them, as the flag's values (the config checks them as the CLI's)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{name}: expected a string or a list of strings, got {_shown(value)}")
    if not names:
        raise ValueError(f"{name}: expected at least one value, got an empty list")
    return list(names)


def _plain_value(value: Any) -> Any:
    """A `torch.dtype` or `torch.device` as its flag text (`torch.float16` -> "float16", `torch.device("cuda",
    1)` -> "cuda:1"), a numpy scalar as the Python int / float / bool of its kind (`np.True_` -> True); other
    values as they are. (Neither library's types exist unless it was imported.)"""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.dtype | torch.device):
        return str(value).removeprefix("torch.")
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):
        return value.item()
    return value


def _expected(kind: type) -> str:
    """What a value of a field of type `kind` is, said in an error."""
    plain = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}
    return plain.get(kind, f"the flag's text or a number / JSON value ({kind.__name__})")


def _shown(value: Any) -> str:
    """A wrong value in an error: its repr (cut at 60 characters) and type."""
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:60] + '...'} ({type(value).__name__})"

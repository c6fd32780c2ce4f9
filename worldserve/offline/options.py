"""`Engine(model, **options)`'s options as an `EngineConfig`: each keyword is a field of one of the config
dataclasses (config.py, config_chat.py, config_server.py, config_lora.py), the same name as `worldserve serve`'s
flag without its dashes (`max_batch_size=2` is `--max-batch-size 2`), so one source of truth serves the CLI and
the Python API (vLLM's `LLM(model, **engine_args)` is built the same way from its EngineArgs).

A value may be what the flag's text would be (`max_model_len="32k"`, `default_sampling_params='{"0": {...}}'`)
or the Python value itself (an int, a dict for a JSON flag, a list for a many-valued one). A name that is no
field is a TypeError, as an unexpected keyword argument is; the HTTP server's own options (`port`, `api_key`,
...) are refused the same way, since no server runs here. A bad value is the config's ValueError naming the flag.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from worldserve.config import EngineConfig
from worldserve.config_flags import scalar_type

SECTIONS = ("model", "reasoner", "parallel", "scheduler", "video", "lora", "media", "chat")
"""EngineConfig's sections whose fields are options here (not `server`: the HTTP server's, which no
offline Engine runs)."""

SERVER_ONLY_VIDEO_FIELDS = ("storage_dir", "sync_timeout", "job_ttl", "job_sweep_interval")
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
    """The EngineConfig of `Engine(model, **options)`: TypeError for an unknown option, the configs'
    ValueError (naming the flag) for a bad value."""
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
    sections = {name: _section_class(name)(**values) for name, values in by_section.items()}
    return EngineConfig(**sections)


def _unknown(name: str) -> str:
    server = {f.name for f in dataclasses.fields(_section_class("server"))} | set(SERVER_ONLY_VIDEO_FIELDS)
    if name in server:
        return f"Engine() got {name!r}, an option of the HTTP server (`worldserve serve`), which Engine runs none of"
    return (
        f"Engine() got an unexpected keyword argument {name!r} (options are `worldserve serve`'s flags, "
        "without dashes: max_batch_size, device, dtype, max_model_len, ...)"
    )


def _converted(cls: type, name: str, value: Any) -> Any:
    """`value` as the field's type, where that is one of config_values.py's flag types (HumanInt, TokenCount,
    JsonObject, SamplingDefaults, MediaLimits...) built from the flag's text: a dict or list becomes its JSON
    text first, an int its digits. Other values go to the dataclass as they are (it checks them)."""
    if value is None:
        return None
    kind = scalar_type(typing.get_type_hints(cls)[name])
    flag_type = kind.__module__ in ("worldserve.config_values", "worldserve.config_server")
    if not flag_type or isinstance(value, kind):
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int, dict, list, tuple)):
        raise ValueError(f"{name}: expected the flag's text or a number / JSON value, got {value!r}")
    if isinstance(value, str):
        text = value
    else:
        text = str(value) if isinstance(value, int) else json.dumps(value)
    try:
        return kind(text)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name}: {exc}") from None

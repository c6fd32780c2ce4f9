"""vLLM's command-line spellings, rewritten into the forms argparse takes before any verb parses them (vLLM's
FlexibleArgumentParser accepts them, so a pasted `vllm serve` line must too):

- underscores in a flag's name, `--max_model_len 16k` / `--tensor_parallel_size=2`: dashes (only the name up
  to its first `.`; a value, after `=` or in its own word, is left as it is);
- a JSON flag's keys as dotted flags, `--media-io-kwargs.video.num_frames 16` (or `=16`): one
  `--media-io-kwargs '{"video": {"num_frames": 16}}'` per flag, the keys of all its dotted flags merged as
  vLLM merges them (objects key by key, lists concatenated); a value is JSON where it parses (16, true, "x"),
  else a human-readable integer (1M: 1048576, as vLLM's human_readable_int), else the text; `--flag.key+
  a,b` is the list ["a", "b"], and a second `--flag.key+ c` adds to it; `-O.level 3` is
  `--compilation-config.level 3`;
- newest vLLM's optimization levels: `-O3`, `-O=3`, `-Odecode` and `-O 3` (a digit 0-3 in its own word) are
  `--optimization-level 3`; `-O '{"level": 3}'` stays `--compilation-config`.
"""

from __future__ import annotations

import json
from typing import Any

from worldserve.config_values import HumanInt


def vllm_argv(argv: list[str]) -> list[str]:
    """`argv` with vLLM's underscore and dotted-key spellings rewritten (module docstring)."""
    out: list[str] = []
    objects: dict[str, dict[str, Any]] = {}  # a JSON flag -> its dotted keys' object
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg.startswith("-O."):  # (vLLM's -O is --compilation-config: its keys dotted too, -O.level 3)
            arg = "--compilation-config" + arg[2:]
        elif arg.startswith("-O") and arg != "-O" and not arg.startswith(("-O{", "-O={")):
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
            continue
        elif arg == "-O" and i < len(argv) and argv[i] in ("0", "1", "2", "3"):
            arg = "--optimization-level"
        if not arg.startswith("--") or arg == "--":
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        head, dot, keys = name.partition(".")
        head = "--" + head[2:].replace("_", "-")
        if not dot:
            out.append(head + eq + value)
            continue
        if not eq:
            if i == len(argv):  # no value: argparse names the flag as given
                out.append(arg)
                continue
            value, i = argv[i], i + 1
        parsed: Any
        if keys.endswith("+"):
            keys, parsed = keys[:-1], value.split(",")
        else:
            parsed = _dotted_value(value)
        for key in reversed(keys.split(".")):
            parsed = {key: parsed}
        _merge(objects.setdefault(head, {}), parsed)
    for flag, obj in objects.items():
        out += [flag, json.dumps(obj)]
    return out


def _dotted_value(text: str) -> Any:
    """A dotted key's value as vLLM reads it: JSON where it parses, else a human-readable integer (`80g`,
    `1M`), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return int(HumanInt(text))
    except ValueError:
        return text


def _merge(into: dict[str, Any], update: dict[str, Any]) -> None:
    """`update` laid over `into` as vLLM merges dotted keys (recursive_dict_update): objects merge key by key,
    lists are concatenated (`--flag.key+ a --flag.key+ b,c` is ["a", "b", "c"]), any other value replaces
    the one before (a key given a value, then keys below it: the keys win)."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] = into[key] + value
        else:
            into[key] = value

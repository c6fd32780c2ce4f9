"""The `lora` field of POST /v1/videos, /v1/videos/sync, /v1/realtime/video and /v1/images/generations (vLLM-Omni's
request-level LoRA object) into a `params.LoraRequest`, and the server's LoRA flags that decide what a request runs
with.

A request's `lora` is a JSON object, or its JSON text (a form field; a JSON body may send either): `{name |
lora_name | adapter, local_path | path | lora_path | lora_local_path, scale | lora_scale, int_id | lora_int_id}`,
each read in vLLM-Omni's key order, the first non-empty value winning. The scale defaults to 1.0 (a number, or a
numeric string as float() reads it; 0 runs the base model); int_id is accepted for compatibility (an int) and
unused. `LoraSettings` is the server's side: a request's own adapter only under --enable-lora (adapters are read
from the server's disk), else --lora-path's, else none. Every error is a ParamError naming `lora` (a 400); the
adapter's files are the backend's to check (its validate, at every scale, 0 included: runner/lora_cache.py),
not this module's. The offline Engine's `lora` argument (`lora_argument`) takes the same object as a dict,
or a LoraRequest.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worldserve.param_types import is_real
from worldserve.params import URL_SCHEME, LoraRequest, ParamError, VideoParams, shown

NAME_KEYS = ("name", "lora_name", "adapter")
PATH_KEYS = ("local_path", "path", "lora_path", "lora_local_path")
"""vLLM-Omni's order (its parse_lora_request): a `local_path` wins over a `path`."""
SCALE_KEYS = ("scale", "lora_scale")
INT_ID_KEYS = ("int_id", "lora_int_id")
LORA_EXAMPLE = '{"name": "style", "path": "/adapters/style", "scale": 1.0}'
"""A `lora` object, as an error that asks for one shows it."""
PER_REQUEST_OFF = "per-request LoRA adapters are off on this server: start it with --enable-lora"
ENGINE_PER_REQUEST_OFF = "per-request LoRA adapters are off on this Engine: build it with enable_lora=True"
"""PER_REQUEST_OFF as the offline Engine says it."""


def parse_lora(raw: Any) -> LoraRequest | None:
    """The adapter a request's `lora` value names (None: not given), validated; ParamError naming `lora` for
    text that is not JSON, a value that is not an object, a missing name or path, a non-string name or path,
    a scale that is not a finite number, or an int_id that is not an int."""
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):  # (RecursionError: nested too deep to parse)
            raise ParamError("lora", "Invalid lora object: not valid JSON.") from None
    if not isinstance(raw, dict):
        raise ParamError("lora", "Invalid lora object: expected a JSON object.")
    name = next((raw[k] for k in NAME_KEYS if raw.get(k)), None)
    path = next((raw[k] for k in PATH_KEYS if raw.get(k)), None)
    if not (name and path):
        raise ParamError("lora", "Invalid lora object: both name and path are required.")
    if not (isinstance(name, str) and isinstance(path, str)):
        raise ParamError("lora", "Invalid lora object: name and path must be strings.")
    if URL_SCHEME.match(path):  # (made absolute, "https://host/a" had been refused as "/cwd/https:/host/a")
        raise ParamError("lora", f"Invalid lora object: path must be a file or folder on the server, not a URL "
                         f"({_quoted(path)}).")  # fmt: skip
    int_id = _given(raw, INT_ID_KEYS)
    if int_id is not None and (isinstance(int_id, bool) or not isinstance(int_id, int)):
        raise ParamError("lora", f"Invalid lora object: int_id must be an integer, got {_quoted(int_id)}.")
    # (a relative path is the server's working folder's: kept absolute, a job re-run after a restart from
    # another folder finds it)
    return LoraRequest(
        name=name, path=os.path.abspath(path), scale=_scale(_given(raw, SCALE_KEYS))
    ).validate()


def lora_argument(value: Any) -> LoraRequest | None:
    """The offline Engine's `lora` (generate_video / generate_image): None, a `LoraRequest`, or a dict read as
    the routes read their `lora` object (parse_lora: vLLM-Omni's keys, the scale defaulting to 1.0); a
    ParamError naming `lora` for anything else, saying what it takes."""
    if value is None or isinstance(value, LoraRequest):
        return value
    if isinstance(value, Mapping):
        return parse_lora(dict(value))
    raise ParamError("lora", f"lora must be a worldserve.params.LoraRequest or a dict such as {LORA_EXAMPLE} "
                     f"(the HTTP routes' lora object), got {type(value).__name__}")  # fmt: skip


def _given(raw: dict[str, Any], keys: tuple[str, ...]) -> Any:
    """The value of the first of `keys` that `raw` holds and is not null (0 is a value: a scale of 0)."""
    return next((raw[k] for k in keys if raw.get(k) is not None), None)


def _scale(value: Any) -> float:
    """A request's scale as a float (None: 1.0); ParamError naming `lora` unless it is a finite number or a
    string float() reads as one."""
    if value is None:
        return 1.0
    scale = math.nan
    if is_real(value) or isinstance(value, str):  # (a number, numpy's too: the offline Engine's dicts)
        try:
            scale = float(value)
        except (ValueError, OverflowError):  # (OverflowError: an int past a float's range)
            pass
    if not math.isfinite(scale):
        raise ParamError("lora", f"Invalid lora object: scale must be a finite number, got {_quoted(value)}.")
    return scale


def _quoted(value: Any) -> str:
    """A request's value as an error message quotes it: a string in quotes (cut at 40 characters), a number as
    `shown` writes it, anything else its JSON type."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else repr(value[:40]) + "..."
    if isinstance(value, int | float) and not isinstance(value, bool):
        return shown(value)
    return {bool: "a boolean", dict: "an object", list: "an array"}.get(type(value), type(value).__name__)


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """The server's LoRA flags, as the video and image routes apply them to each request."""

    per_request: bool = False
    """--enable-lora: a request may name an adapter of its own."""
    static: LoraRequest | None = None
    """--lora-path / --lora-scale: the adapter of requests that name none (None: the base model)."""
    off: str = PER_REQUEST_OFF
    """The refusal of a request's own adapter without per_request (the offline Engine's words its own)."""

    def check_restored(self, params: VideoParams) -> None:
        """A job stored before a restart runs again only with an adapter this server would give it (its own
        under --enable-lora, or this server's --lora-path): ParamError naming `lora` otherwise (a server restarted
        without --enable-lora had run the queued jobs' own adapters, read from paths the operator turned off)."""
        self._check_given(params.lora)

    def for_argument(self, value: Any) -> LoraRequest | None:
        """The adapter an offline Engine's request whose `lora` argument is `value` (lora_argument: None, a
        LoraRequest or the routes' dict) runs with: its own (under per_request, or the static one named
        again), else the static one, else None; ParamError naming `lora` otherwise."""
        own = lora_argument(value)
        if own is None:
            return self.static
        self._check_given(own)
        return own

    def _check_given(self, lora: LoraRequest | None) -> None:
        if lora is not None and lora != self.static and not self.per_request:
            raise ParamError("lora", self.off)

    def for_request(self, raw: Any) -> LoraRequest | None:
        """The adapter a request whose `lora` field is `raw` runs with: its own (parse_lora; without
        --enable-lora a 400 naming `lora`), else the static one, else None."""
        own = parse_lora(raw)
        if own is None:
            return self.static
        if not self.per_request:
            raise ParamError("lora", self.off)
        return own

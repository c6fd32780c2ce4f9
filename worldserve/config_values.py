"""The value types of config flags, parsed from their command-line text (config.py's dataclasses use them as
field types, so argparse converts a flag's text with them): vLLM's JSON lists (`--allowed-origins`), media
limits (`--limit-mm-per-prompt`), JSON objects (`--override-generation-config`), video defaults (`--default-sampling-params`), token counts with vLLM's
human-readable suffixes (`--max-model-len 32k`),
and the error they raise (`FlagValueError`: argparse shows it as `argument --flag: <message>`, exit 2); the
bounds of a duration (`check_seconds`: flags and environment variables alike).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import threading
import typing


class FlagValueError(argparse.ArgumentTypeError, ValueError):
    """A malformed flag value: argparse reports it as `argument --flag: <message>` (exit 2); a ValueError
    to Python callers."""


def int64_seed(text: str) -> int:
    """A `--seed` value: an integer in torch's and VideoParams' int64 range (one past it failed with a
    traceback after the model had loaded)."""
    try:
        value = int(text)
    except ValueError:
        raise FlagValueError(f"invalid int value: {text!r}") from None
    from worldserve.params import INT64

    if not -INT64 <= value < INT64:
        raise FlagValueError(f"must be in [-2**63, 2**63) (int64), got {text}")
    return value


def json_flag(text: str, expected: str) -> typing.Any:
    """A JSON flag value parsed; FlagValueError (naming what was `expected`) when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise FlagValueError(f"not valid JSON ({e.msg}): {text!r}; expected {expected}") from None


class JsonStrList(tuple):
    """A flag whose value is a JSON list of strings (vLLM's CORS flags: `--allowed-origins '["https://x.org"]'`).
    Built from the flag's text or from an iterable of strings; a tuple, so the frozen configs stay hashable;
    str() gives the JSON back (the --help default)."""

    __slots__ = ()

    def __new__(cls, value: str | typing.Iterable[str] = ()) -> JsonStrList:
        """Parse `value` (JSON text, or already a list/tuple of strings); FlagValueError when it is not one."""
        if isinstance(value, str):
            value = json_flag(value, "a list such as '[\"*\"]'")
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise FlagValueError(
                f"expected a JSON list of strings such as '[\"*\"]', got {json.dumps(value)}"
            )
        return super().__new__(cls, value)

    def __str__(self) -> str:
        """The JSON text of the list."""
        return json.dumps(list(self))


_Pairs = typing.Iterable[tuple[str, typing.Any]]
"""(key, value) pairs: what the tuple-of-pairs flag types below are built from besides their JSON text (a
replace() or a copy passes the tuple itself)."""


class JsonObject(tuple):
    """A flag whose value is a JSON object (vLLM's `--override-generation-config '{"temperature": 0.5}'`): a
    tuple of sorted (key, value) pairs, so the frozen configs stay hashable; str() gives the JSON back."""

    __slots__ = ()

    def __new__(cls, value: str | typing.Mapping[str, typing.Any] | _Pairs = ()) -> JsonObject:
        if isinstance(value, str):
            parsed = json_flag(value, "an object such as '{\"key\": 1}'")
            if not isinstance(parsed, dict):
                raise FlagValueError(f"expected a JSON object such as '{{\"key\": 1}}', got "
                                     f"{json.dumps(parsed)}")  # fmt: skip
            value = parsed
        return super().__new__(cls, sorted(dict(value).items()))

    def as_dict(self) -> dict[str, typing.Any]:
        return dict(self)

    def __str__(self) -> str:
        return json.dumps(dict(self))


class MediaLimits(tuple):
    """vLLM's `--limit-mm-per-prompt '{"image": 4, "video": 1}'`: the most images / videos one chat request may
    carry; newer vLLM's per-modality objects (`{"video": {"count": 1, "num_frames": 32}}`) give the count as
    `count` (their size keys only size vLLM's start-up memory profiling, which worldserve does not run: they
    are read and left unused); `"audio": 0` is accepted and dropped. A tuple of sorted (modality, count)
    pairs, so the frozen configs stay hashable; str() is the JSON of the counts."""

    __slots__ = ()
    MODALITIES = ("image", "video")
    NOT_TAKEN = ("audio",)
    """vLLM's other modality, which the Reasoner takes none of: accepted at 0 (vLLM command lines turn it off so),
    refused above."""
    SIZE_HINTS = ("width", "height", "num_frames")
    DEFAULT_COUNT = 999
    """The count of a per-modality object without one (vllm/config/multimodal.py: BaseDummyOptions.count)."""

    def __new__(cls, value: str | typing.Mapping[str, typing.Any] | _Pairs = ()) -> MediaLimits:
        if isinstance(value, str):
            value = json_flag(value, 'an object such as \'{"image": 4, "video": 1}\'')
        if not isinstance(value, typing.Mapping | tuple):
            raise FlagValueError(f'expected {{"image": N, "video": M}}, got {json.dumps(value)}')
        pairs = {k: cls._count(k, v) for k, v in dict(value).items()}
        known = (*cls.MODALITIES, *cls.NOT_TAKEN)
        if set(pairs) - set(known) or not all(type(v) is int and v >= 0 for v in pairs.values()):
            raise FlagValueError(
                f'expected {{"image": N, "video": M}} with counts >= 0, got {json.dumps(pairs)}'
            )
        taken = [f"{k}: {v}" for k, v in pairs.items() if k in cls.NOT_TAKEN and v]
        if taken:
            raise FlagValueError(
                f"{', '.join(taken)}: the Reasoner takes images and videos only (0 is accepted)"
            )
        return super().__new__(cls, sorted((k, v) for k, v in pairs.items() if k in cls.MODALITIES))

    @classmethod
    def _count(cls, modality: str, value: typing.Any) -> typing.Any:
        """A modality's count: the value, or a per-modality object's `count` (checked with the plain form);
        an object without one counts 999, as vLLM's (BaseDummyOptions.count's default)."""
        if not isinstance(value, typing.Mapping):
            return value
        if set(value) - {"count", *cls.SIZE_HINTS}:
            raise FlagValueError(f'expected {{"{modality}": {{"count": N}}}} (and only {", ".join(cls.SIZE_HINTS)} '
                                 f"besides), got {json.dumps(dict(value))}")  # fmt: skip
        return value.get("count", cls.DEFAULT_COUNT)

    def get(self, modality: str) -> int | None:
        """The limit for `modality`, or None (no limit)."""
        return dict(self).get(modality)

    def __str__(self) -> str:
        return json.dumps(dict(self))


class SamplingDefaults(tuple):
    """vLLM-Omni's `--default-sampling-params '{"0": {"num_inference_steps": 20}}'`: the server's values for the
    video fields a request omits, keyed by stage id (worldserve generates in one stage, "0"). A tuple of sorted
    (field, value) pairs, so the frozen configs stay hashable; str() is the JSON. Only each value's type is
    checked here; ServerConfig checks the values together as a request's (VideoParams.validate)."""

    __slots__ = ()
    FIELDS: typing.ClassVar[dict[str, tuple[type, ...]]] = {
        "width": (int,), "height": (int,), "num_frames": (int,), "fps": (int, float),
        "num_inference_steps": (int,), "guidance_scale": (int, float), "flow_shift": (int, float),
        "seed": (int,), "max_sequence_length": (int,), "negative_prompt": (str,), "generate_sound": (bool,),
    }  # fmt: skip
    """The VideoParams fields a default may set, and the JSON types each takes."""
    STAGE = "0"

    def __new__(cls, value: str | typing.Mapping[str, typing.Any] | _Pairs = ()) -> SamplingDefaults:
        """Parse `value` (the flag's JSON text, its object, or (field, value) pairs); FlagValueError naming the
        stage or field that is wrong."""
        if isinstance(value, str):
            stages = json_flag(value, 'an object such as \'{"0": {"num_inference_steps": 20}}\'')
            if not isinstance(stages, dict):
                raise FlagValueError(f'expected an object of stages such as {{"0": {{"num_inference_steps": 20}}}}, '
                                     f"got {json.dumps(stages)}")  # fmt: skip
            if other := sorted(k for k, v in stages.items() if k != cls.STAGE and v):
                raise FlagValueError(f'stage {other[0]!r}: worldserve generates in one stage, "0"')
            fields = stages.get(cls.STAGE) or {}
            if not isinstance(fields, dict):
                raise FlagValueError(f'stage "0": expected an object of fields, got {json.dumps(fields)}')
            value = fields
        pairs = dict(value)
        for name, v in pairs.items():
            if name not in cls.FIELDS:
                raise FlagValueError(f'stage "0": unknown field {name!r}; the fields a default may set: '
                                     f"{', '.join(cls.FIELDS)}")  # fmt: skip
            kinds = cls.FIELDS[name]
            if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
                names = " or ".join({"int": "an integer", "float": "a number", "str": "a string",
                                     "bool": "true or false"}[k.__name__] for k in kinds)  # fmt: skip
                raise FlagValueError(f'stage "0": {name} must be {names}, got {json.dumps(v)}')
        if ("width" in pairs) != ("height" in pairs):
            raise FlagValueError('stage "0": width and height must be given together')
        return super().__new__(cls, sorted(pairs.items()))

    def as_dict(self) -> dict[str, typing.Any]:
        return dict(self)

    def __str__(self) -> str:
        return json.dumps({self.STAGE: dict(self)})


DEFAULT_MAX_MODEL_LEN = 32768
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class HumanInt(int):
    """vLLM's human-readable integers (`--max-num-batched-tokens 16k`, `--kv-cache-memory-bytes 8G`): a lowercase
    suffix is decimal (k = 1000, decimals allowed: 25.6k), an uppercase one binary (K = 1024, whole numbers
    only)."""

    __slots__ = ()
    EXAMPLE = "such as 8192, 8k (8000) or 8K (8192)"

    def __new__(cls, value: str | int) -> HumanInt:
        text = str(value).strip()
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text)
        if match is None or ("." in match[1] and not match[2].islower()):
            raise FlagValueError(f"expected a whole number {cls.EXAMPLE}, got {text!r}")
        number, suffix = match.groups()
        return super().__new__(cls, int(float(number) * _SUFFIXES[suffix]) if suffix else int(number))


class TokenCount(HumanInt):
    """A context length (`--max-model-len 32k`), a HumanInt; `auto` or -1 (vLLM: fit the model) is
    worldserve's default, 32768 tokens (`TokenCount.auto` tells it was asked for)."""

    __slots__ = ()
    auto: bool = False
    EXAMPLE = "of tokens such as 32768, 32k (32000) or 32K (32768), or auto"

    def __new__(cls, value: str | int = DEFAULT_MAX_MODEL_LEN) -> TokenCount:
        if str(value).strip() in ("auto", "-1"):
            return AutoTokenCount(DEFAULT_MAX_MODEL_LEN)
        return typing.cast(TokenCount, super().__new__(cls, value))


class AutoTokenCount(TokenCount):
    """`auto` / -1: worldserve's default length (vLLM would derive one from the model or the free memory)."""

    __slots__ = ()
    auto = True


def check_seconds(flag: str, value: float, *, zero: bool) -> None:
    """A duration flag: finite, > 0 (>= 0 with `zero`) and at most what Python's waits take
    (threading.TIMEOUT_MAX, ~292 years): `inf` or 1e20 would fail a join or a timestamp later, mid-run."""
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0) and value <= threading.TIMEOUT_MAX):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{flag} must be a finite number of seconds {bound} (at most "
                         f"{threading.TIMEOUT_MAX:.3g}), got {value}")  # fmt: skip

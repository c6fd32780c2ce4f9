"""The sampling values Reasoner requests (chat, text completions, Responses) take for the fields they omit, as
vLLM's `--generation-config` and `--override-generation-config` set them.

vLLM's rule (ModelConfig.get_diff_sampling_param): start from the model's `generation_config.json` (`auto`, the
default), from nothing (`vllm`: the neutral 1.0 / 1.0 / off / 0 / 1.0), or from the `generation_config.json` of
another folder (a path); lay `--override-generation-config`'s JSON over it; keep `temperature`, `top_p`, `top_k`,
`min_p`, `repetition_penalty` and `max_new_tokens` (vLLM's `max_tokens`). A request's own value always wins.
`max_new_tokens` is the completion budget of a request that sends none (with `auto` / `vllm`), and a bound
on every request's budget when it comes from a folder or from the override (vLLM's `override_max_tokens`);
the room the prompt leaves in the context bounds both, without an error (runner/chat_prompt.py
completion_budget). Its `eos_token_id`s end chats too (vLLM adds them to a request's stop tokens), read from
the model's file under `vllm` as well; its other keys (do_sample, ...) are not read.

Unlike vLLM, which fails each request against a bad value (or serves neutral defaults from a folder it cannot
read), a bad value or a folder without `generation_config.json` stops the server at start, naming the file and key.

An omitted `seed` is the other such field: under `--seed N` (`RequestSeeds`) it is the next of one sequence N
starts; without the flag, a random one (the sampler's own).
"""

from __future__ import annotations

import json
import math
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from worldserve.weights.checkpoint import CheckpointError, read_json_object

FILE = "generation_config.json"
KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
"""The generation config keys vLLM takes as sampling defaults (ModelConfig.get_diff_sampling_param)."""
MODES = ("auto", "vllm")
"""--generation-config's words; anything else is a folder."""


@dataclass(frozen=True, slots=True)
class ChatDefaults:
    """The values of the sampling fields a Reasoner request omits (vLLM's neutral ones unless a generation
    config set them), and the bound on every request's completion budget."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0: off."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    """The completion budget of a chat that sends no max_tokens (None: the room the context leaves)."""
    max_tokens_cap: int | None = None
    """The most completion tokens any request gets, whatever max_tokens it sends (None: no bound)."""
    source: str = ""
    """Where the values came from, for the start-up log ("" : vLLM's neutral defaults)."""
    eos_token_ids: tuple[int, ...] = ()
    """The generation config's `eos_token_id`s: more tokens that end every chat (vLLM adds them to its stop
    tokens), read from the model's file under auto and vllm alike, or from the folder's."""
    given: frozenset[str] = frozenset()
    """The fields above that the generation config or the overrides set (max_new_tokens: max_tokens)."""

    @classmethod
    def load(
        cls, mode: str, model_dir: Path | None, overrides: Mapping[str, Any] | None = None
    ) -> ChatDefaults:
        """The defaults for `--generation-config mode` (auto: `model_dir`'s generation_config.json when it has
        one; vllm: none; a folder: its generation_config.json, which must exist) with `overrides`
        (--override-generation-config) laid over them. ValueError naming the file or flag and the key of a
        value the sampler cannot take."""
        path = Path(mode) / FILE if mode not in MODES else model_dir / FILE if model_dir is not None else None
        found = path is not None and path.is_file()
        if mode not in MODES and not found:
            raise ValueError(f"--generation-config {mode}: "
                             + (f"no {FILE} in that folder" if Path(mode).is_dir() else "no such folder"))  # fmt: skip
        data, where = (
            _read(path) if path is not None and found else {},
            str(path),
        )  # (vllm: read for its eos ids)
        sources = [where] if found and mode != "vllm" else []
        values = {} if mode == "vllm" else {k: data[k] for k in KEYS if data.get(k) is not None}
        eos = _eos_ids(data.get("eos_token_id"), where)
        given = {k: v for k, v in (overrides or {}).items() if k in KEYS and v is not None}
        for key, value in values.items():
            _check(key, value, where)
        for key, value in given.items():
            _check(key, value, "--override-generation-config")
        if given:
            sources.append("--override-generation-config")
        values.update(given)
        values = {k: int(v) if k in ("top_k", "max_new_tokens") else float(v) for k, v in values.items()}
        budget = values.pop("max_new_tokens", None)
        # vLLM: a folder's max_new_tokens bounds every request; with auto / vllm only the override's does
        cap = budget if mode not in MODES or "max_new_tokens" in given else None
        given_fields = frozenset(values) | ({"max_tokens"} if budget is not None else frozenset())
        return cls(
            **values, max_tokens=budget, max_tokens_cap=cap, source=" + ".join(sources), eos_token_ids=eos,
            given=given_fields,
        )  # fmt: skip

    def changed(self) -> dict[str, Any]:
        """The sampling values that differ from vLLM's neutral defaults (the start-up log's)."""
        neutral = ChatDefaults()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("source", "eos_token_ids", "given")
                and getattr(self, f.name) != getattr(neutral, f.name)}  # fmt: skip

    def budget(self, requested: int | None) -> int | None:
        """The bound on a request's completion budget beside the max_tokens it sent (`requested`; None: sent
        none): the default budget when it sent none, and the cap either way (None: no bound but the context)."""
        bounds = [
            b for b in (self.max_tokens if requested is None else None, self.max_tokens_cap) if b is not None
        ]
        return min(bounds) if bounds else None


class RequestSeeds:
    """vLLM's `--seed`: the seeds of Reasoner requests that send none, drawn in arrival order from a sequence
    that `seed` starts, so a restarted server answers the same requests, sent in the same order, the same
    way (vLLM draws them from its seeded global generator). Thread-safe (the API builds params in threads)."""

    def __init__(self, seed: int) -> None:
        self._rng, self._lock = random.Random(seed), threading.Lock()

    def next(self) -> int:
        with self._lock:
            return self._rng.getrandbits(63)


NEUTRAL = ChatDefaults()
"""vLLM's neutral defaults (`--generation-config vllm`, or a model without a generation_config.json)."""


def _read(path: Path) -> dict[str, Any]:
    """A generation_config.json's object; ValueError naming the file when it is no JSON object."""
    try:
        return read_json_object(path)
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None


def _eos_ids(value: Any, where: str) -> tuple[int, ...]:
    """A generation config's `eos_token_id` (one id or a list; null or absent: none) as ids; ValueError naming
    the file for anything else."""
    ids = [] if value is None else [value] if not isinstance(value, list) else value
    if not all(type(i) is int and i >= 0 for i in ids):
        raise ValueError(
            f"{where}: eos_token_id must be a token id or a list of them, got {json.dumps(value)}"
        )
    return tuple(ids)


def _check(key: str, value: Any, where: str) -> None:
    """ValueError naming `where` and `key` when the value is one the sampler (ChatParams.validate) refuses."""
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    whole = number and float(value).is_integer()
    ok = {
        "temperature": number and value >= 0,
        "top_p": number and 0 < value <= 1,
        "top_k": whole and value >= -1,
        "min_p": number and 0 <= value <= 1,
        "repetition_penalty": number and value > 0,
        "max_new_tokens": whole and value >= 1,
    }[key]
    if not ok:
        want = {
            "temperature": "a number >= 0", "top_p": "a number in (0, 1]", "top_k": "an integer >= -1",
            "min_p": "a number in [0, 1]", "repetition_penalty": "a number > 0", "max_new_tokens": "an integer >= 1",
        }[key]  # fmt: skip
        raise ValueError(f"{where}: {key} must be {want}, got {json.dumps(value)}")

"""A LoRA adapter's files and its LoraConfig, before any tensor is read: which safetensors file a path names
(PEFT's folder, diffusers' LoRA file or its folder, any one `.safetensors` file), the PEFT config beside it
or the one diffusers wrote into the file's header (`lora_adapter_metadata`), and that config checked as PEFT
would take it (LoRA only, no variant that computes more than a scaled (x A^T) B^T, r / lora_alpha /
rank_pattern / alpha_pattern values PEFT accepts).

Separate from weights/lora_adapter.py, which checks the tensors' keys and shapes against the model and loads
them: this is what the adapter's files say about it. Every refusal is a ParamError naming `lora` (a 400 at
the API), never a default put in its place.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from worldserve.params import ParamError

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"


def refuse_adapter(path: str, why: str) -> ParamError:
    """The ParamError, naming `lora`, that refuses the adapter at `path` for `why`."""
    return ParamError("lora", f"LoRA adapter {path!r}: {why}")


def find_adapter_files(path: str) -> tuple[Path, dict | None]:
    """(the safetensors file, the PEFT config or None) of the adapter at `path`; ParamError naming `lora`."""
    p = Path(path)
    try:
        exists = p.exists()
    except OSError as exc:  # (a name the file system refuses: too long, ...)
        raise refuse_adapter(path, f"not a usable path on the server ({exc.strerror})") from None
    if not exists:
        raise refuse_adapter(path, "no such file or folder on the server")
    if p.name == PEFT_WEIGHTS:
        _check_regular(p.parent / PEFT_CONFIG, path)
    if p.is_dir():
        _check_regular(p / PEFT_CONFIG, path)
    if p.is_file() and p.name == PEFT_WEIGHTS and (p.parent / PEFT_CONFIG).is_file():
        return p, _read_config(
            p.parent / PEFT_CONFIG, path
        )  # (a PEFT folder's weights named: its config too)
    if p.is_dir():
        if (p / PEFT_CONFIG).is_file():
            if not (p / PEFT_WEIGHTS).is_file():
                found = (
                    "adapter_model.bin (pickle: convert it to safetensors)"
                    if (p / "adapter_model.bin").exists()
                    else "none"
                )
                raise refuse_adapter(
                    path, f"a PEFT folder needs {PEFT_WEIGHTS} beside {PEFT_CONFIG} (found {found})"
                )
            return p / PEFT_WEIGHTS, _read_config(p / PEFT_CONFIG, path)
        candidates = (
            [p / DIFFUSERS_WEIGHTS] if (p / DIFFUSERS_WEIGHTS).is_file() else sorted(p.glob("*.safetensors"))
        )
        if len(candidates) != 1:
            raise refuse_adapter(path, f"expected {PEFT_CONFIG} + {PEFT_WEIGHTS}, {DIFFUSERS_WEIGHTS}, or one .safetensors "
                          f"file in the folder; found {len(candidates)} .safetensors files")  # fmt: skip
        p = candidates[0]
    if p.suffix != ".safetensors":
        raise refuse_adapter(path, "adapter weights must be a .safetensors file")
    if not p.is_file():  # (a FIFO or a device would block the open, and every thread with it: safetensors
        raise refuse_adapter(path, f"{p.name} is not a regular file")  # holds the GIL there)
    return p, None


def _check_regular(config: Path, path: str) -> None:
    """A PEFT config that is there in another form than a regular file (a dangling link, a folder, a FIFO) is
    refused: read as no config, the adapter would run at another strength (lora_alpha = r)."""
    if os.path.lexists(config) and not config.is_file():
        raise refuse_adapter(path, f"{config.name} is there but is not a readable regular file")


def _read_config(file: Path, path: str) -> dict:
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise refuse_adapter(path, f"{file.name} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise refuse_adapter(path, f"{file.name} is not a JSON object")
    return config


def pattern_value(patterns: dict | None, module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module name."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


_VARIANTS = {
    "use_dora": "DoRA adapters are not supported", "lora_bias": "LoRA biases are not supported",
    "fan_in_fan_out": "fan_in_fan_out weights are not supported", "use_qalora": "QALoRA adapters are not supported",
    "use_bdlora": "BD-LoRA adapters are not supported", "alora_invocation_tokens": "aLoRA adapters are not supported",
    "velora_config": "VeLoRA adapters are not supported", "monteclora_config": "MonteCLoRA adapters are not supported",
    "arrow_config": "Arrow routing is not supported", "kasa_config": "KaSA adapters are not supported",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable tokens are not supported",
    "target_parameters": "LoRA on parameters (target_parameters) is not supported",
    "modules_to_save": "modules_to_save (whole modules saved beside the adapter) is not supported",
}  # fmt: skip
"""PEFT LoraConfig keys whose set values change what an adapter computes beyond a scaled (x A^T) B^T."""


def check_peft_config(config: dict, path: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise refuse_adapter(path, f"peft_type {config.get('peft_type')!r} is not LORA")
    for key, why in _VARIANTS.items():
        if config.get(key):
            raise refuse_adapter(path, why)
    if config.get("bias", "none") != "none":
        raise refuse_adapter(path, f"bias {config.get('bias')!r} is not supported (only 'none')")
    _check_values(config, path)


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # (an int past a float's range)
        return False


def _check_values(config: dict, path: str) -> None:
    """The config's numbers and patterns as PEFT would take them: r a positive integer, lora_alpha a finite
    number, rank_pattern / alpha_pattern objects of regular expressions to such values (else a 400 naming
    lora; they had been TypeErrors, regex errors or a NaN scaling: 500s and black videos)."""
    if "r" in config and (
        isinstance(config["r"], bool) or not isinstance(config["r"], int) or config["r"] < 1
    ):
        raise refuse_adapter(
            path, f"its config's r must be a positive integer, not {json.dumps(config['r'])[:40]}"
        )
    if "lora_alpha" in config and not _finite_number(config["lora_alpha"]):
        raise refuse_adapter(path, f"its config's lora_alpha must be a finite number, not "
                      f"{json.dumps(config['lora_alpha'])[:40]}")  # fmt: skip
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise refuse_adapter(path, f"its config's {key} must be an object of patterns")
        for pattern, value in patterns.items():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise refuse_adapter(path, f"its config's {key} key {pattern[:60]!r} is not a regular expression "
                              f"({exc})") from None  # fmt: skip
            if not _finite_number(value) or (key == "rank_pattern" and (value != int(value) or value < 1)):
                raise refuse_adapter(path, f"its config's {key}[{pattern[:60]!r}] must be a "
                              + ("positive integer" if key == "rank_pattern" else "finite number"))  # fmt: skip


def metadata_config(metadata: dict, path: str) -> dict | None:
    """The LoraConfig diffusers wrote into the header (`lora_adapter_metadata`): a transformer's own
    (`save_lora_adapter`), or a pipeline's with its keys prefixed `transformer.` (`save_lora_weights`)."""
    if "lora_adapter_metadata" not in metadata:
        return None
    try:
        config = json.loads(metadata["lora_adapter_metadata"])
    except json.JSONDecodeError:
        raise refuse_adapter(path, "its lora_adapter_metadata is not JSON") from None
    if not isinstance(config, dict):
        raise refuse_adapter(path, "its lora_adapter_metadata is not a JSON object")
    if any(k.startswith("transformer.") for k in config):  # (a pipeline's: the transformer's part of it)
        config = {
            k.removeprefix("transformer."): v for k, v in config.items() if k.startswith("transformer.")
        }
    return config

"""Argument types, input and output checks the CLI commands share (generate, chat, bench, make-tiny).

Each fails before any model work, with the field and the flag named: a path this run could not write is
found before minutes of generation, not after them.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from worldserve.params import LoraRequest, ParamError


def check_writable(path: Path, param: str, flag: str, *, folder: bool = False) -> None:
    """ParamError naming `param` unless this run can write the file (or, `folder`, fill the folder) at `path`,
    creating its missing parents: checked before any model work, not after minutes of it."""
    if path.exists() and path.is_dir() != folder:
        raise ParamError(
            param,
            f"{flag} {path} is " + ("not a directory" if folder else "a directory; name the file to write"),
        )
    ancestor = path.parent  # the nearest folder that exists: the writer creates the rest
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ParamError(param, f"{flag} {path}: {ancestor} is not a directory")
    if not os.access(path if path.exists() else ancestor, os.W_OK) or not _can_create_in(ancestor):
        raise ParamError(param, f"{flag} {path} is not writable")


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be made in `folder` (os.access says yes to root on /proc or a read-only mount)."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".worldserve-probe-"):
            return True
    except OSError:
        return False


def lora_arg(path: Path | None, scale: float | None) -> LoraRequest | None:
    """generate's --lora / --lora-scale as the adapter the run uses, named after its folder (a file: its name
    less the suffix), at its absolute path; ParamError naming `lora` when nothing is at the path (its files are
    the pipeline's to check), `lora_scale` for a scale without --lora or one that is not finite."""
    if path is None:
        if scale is not None:
            raise ParamError(
                "lora_scale", "--lora-scale scales a --lora adapter: give --lora too, or leave it out"
            )
        return None
    if not path.exists():
        raise ParamError("lora", f"{path}: no such file or folder")
    if scale is not None and not math.isfinite(scale):
        raise ParamError("lora_scale", f"--lora-scale must be a finite number, got {scale}")
    full = Path(os.path.abspath(path))
    name = full.name if full.is_dir() else full.stem
    return LoraRequest(name=name, path=str(full), scale=1.0 if scale is None else scale)


def text_arg(value: str) -> str:
    """argparse type of a text flag: text UTF-8 can encode (argv bytes that are not UTF-8 reach Python as lone
    surrogates, which the tokenizer refused with a traceback after the model had loaded)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None
    return value

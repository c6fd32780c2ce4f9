"""Argument types and output checks the CLI commands share (generate, chat, bench, make-tiny).

Each fails before any model work, with the field and the flag named: a path this run could not write is
found before minutes of generation, not after them.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from worldserve.params import ParamError


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


def text_arg(value: str) -> str:
    """argparse type of a text flag: text UTF-8 can encode (argv bytes that are not UTF-8 reach Python as lone
    surrogates, which the tokenizer refused with a traceback after the model had loaded)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None
    return value

"""Argument types, input and output checks the CLI commands share (generate, chat, bench, make-tiny).

Each fails before any model work, with the field and the flag named: a path this run could not write is
found before minutes of generation, not after them.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
import sys
import tempfile
import typing
from pathlib import Path

from worldserve.params import LoraRequest, ParamError, missing_adapter

MAX_MEDIA_FILE_BYTES = 4 << 30
"""--image / --video file size at most (generate and chat read a file whole before decoding it)."""
READ_CHUNK_BYTES = 1 << 20


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
        raise ParamError("lora", f"{path}: {missing_adapter(str(path))}")
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


def read_input(path: Path, param: str, limit: int, *, stdin_for_dash: bool = False) -> bytes:
    """The file's bytes (standard input's for `-` with `stdin_for_dash`), at most `limit`: a regular file
    larger is refused from its size, before a byte is read; a stream is read in chunks and refused once past
    it (/dev/zero: `limit` bytes read, never more). ParamError naming `param`, also for a closed stdin."""
    try:
        if stdin_for_dash and str(path) == "-":
            if sys.stdin is None:  # (started with stdin closed: `<&-`)
                raise ParamError(param, "standard input is closed: give the file's path instead of -")
            return _bounded(sys.stdin.buffer, path, param, limit)
        with path.open("rb") as f:
            info = os.fstat(f.fileno())
            if stat.S_ISREG(info.st_mode) and info.st_size > limit:
                raise _too_large(path, param, limit)
            return _bounded(f, path, param, limit)
    except OSError as e:
        raise ParamError(param, f"cannot read {path}: {e.strerror}") from e


def _bounded(f: typing.BinaryIO, path: Path, param: str, limit: int) -> bytes:
    data = bytearray()
    while chunk := f.read(min(READ_CHUNK_BYTES, limit + 1 - len(data))):
        data += chunk
        if len(data) > limit:
            raise _too_large(path, param, limit)
    return bytes(data)


def _too_large(path: Path, param: str, limit: int) -> ParamError:
    return ParamError(param, f"{path} is larger than {limit >> 20} MiB")

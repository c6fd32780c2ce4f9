"""Writing a file whole or not at all: `generate`'s -o (MP4, PNG, npz) and --save-latents, the offline
Engine's saves, and the job store's videos and references (`private`).

`writing_atomically(path)` hands out a temporary file beside `path` (`.NAME.<hex>.tmp`, in the mode of the
file it replaces, else the umask's as a plain write gives), then fsyncs it and renames it over `path`. A
failure on the way (a full disk midway, Ctrl-C, SIGTERM: any BaseException) removes the temporary file and
re-raises, so `path` is either the whole new file or what it was before (an older good file there survives;
a half-written one never appears). A symlink at `path` keeps pointing where it did (its target is replaced);
a path that is not a regular file (a FIFO, a character device such as /dev/null) is written in place, since
nothing can be renamed over it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def writing_atomically(path: str | os.PathLike[str], *, private: bool = False) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s bytes into: on a clean exit they replace `path` in one rename; on
    any exception the temporary file is removed and `path` is left as it was. `private`: the file is made
    0600 whatever it replaces, and the folder is fsynced after the rename, so that the rename itself
    survives a power loss (the job store's videos and references: engine/job_files.py)."""
    target = Path(os.path.realpath(path))
    try:
        older: os.stat_result | None = target.stat()
    except FileNotFoundError:
        older = None
    if older is not None and not stat.S_ISREG(older.st_mode):
        with open(target, "wb") as direct:
            yield direct
        return
    # (a name near NAME_MAX, 255 bytes, is cut: the temporary name must fit where the target's does)
    tmp = target.with_name(f".{os.fsdecode(os.fsencode(target.name)[:200])}.{uuid.uuid4().hex}.tmp")
    try:
        # (mode 0o666 less the umask, as open() gives: mkstemp's 0600 had made outputs private)
        mode = 0o600 if private else 0o666
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except (
            OSError
        ) as exc:  # (named as the caller's path: a missing folder had named the hidden temp file)
            raise type(exc)(exc.errno, exc.strerror, os.fspath(path)) from None
        with os.fdopen(fd, "wb") as fh:
            if older is not None and not private:
                # (the older file's mode, as writing over it in place kept it)
                os.fchmod(fh.fileno(), stat.S_IMODE(older.st_mode))
            yield fh
            fh.flush()
            # (a file system may report a full disk only here; and the rename must not outrun the data)
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):  # (a read-only disk refuses this too: the first error is the one)
            tmp.unlink(missing_ok=True)
        raise
    if private:
        folder = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def write_atomically(path: str | os.PathLike[str], data: bytes, *, private: bool = False) -> None:
    """`data` as the whole of `path`, or `path` unchanged when the write fails (`writing_atomically`)."""
    with writing_atomically(path, private=private) as fh:
        fh.write(data)

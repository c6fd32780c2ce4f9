"""What the job store does when its disk refuses a write (full, over quota, an I/O error) while serving.

`storage_failure` turns the OSError / sqlite3.OperationalError into a StorageError that says what could not
be saved and why, without paths (it reaches HTTP clients): `StorageFull` (507) for no space, quota or file
size, else 503. The route that met it answers that status; a job that met it fails with it.

`UnsavedFailures` holds the failures of jobs the database could not record (a full disk takes SQLite's
commits too): reads show the job failed, with its reason, so a waiting sync request is answered and a poll
sees the end, and the store writes them at its next write that succeeds (once space is back). Kept in memory
only: if the process stops first, the row is still queued / in progress and the restart runs the job again.

`remove_or_leave` removes a file the store no longer needs (a finished job's reference, a video no row
names) where a refusal must not undo what was saved: a disk made read-only refuses unlinks too (EROFS, before
the name is looked up: `missing_ok` does not cover it), and a job failing for that reason must still end. The
file is logged and left: the start-up sweep (`remove_strays`), the job's DELETE or its expiry removes it.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

from worldserve.engine.job_files import StorageError

if TYPE_CHECKING:
    from worldserve.engine.job_schema import Job

# (the store's logger: its operators and tests follow one name)
log = logging.getLogger("worldserve.engine.jobs")
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
FULL_SQLITE_CODES = frozenset({13})  # SQLITE_FULL ("database or disk is full")


class StorageFull(StorageError):
    """The storage directory has no space left (or the quota / file-size limit is reached)."""

    status_code = 507


def storage_failure(exc: BaseException, what: str) -> StorageError:
    """`exc`, met saving `what`, as the StorageError a client is told (no paths: they stay in the log)."""
    if isinstance(exc, OSError):
        full, reason = exc.errno in FULL_ERRNOS, exc.strerror or type(exc).__name__
    else:
        full, reason = getattr(exc, "sqlite_errorcode", None) in FULL_SQLITE_CODES, str(exc)
    kind = StorageFull if full else StorageError
    return kind(f"the server's storage could not save {what}: {reason}")


def remove_or_leave(path: Path, job_id: str, what: str) -> bool:
    """Remove `path` (job `job_id`'s `what`) if it is there; False, logged, when the disk refuses (the file
    stays for the start-up sweep, the job's DELETE or its expiry)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        if not path.exists():  # (a read-only disk refuses the unlink of a missing file too: nothing left)
            return True
        log.warning("job %s: its %s could not be removed (%s); it is left for the next start's sweep",
                    job_id, what, exc)  # fmt: skip
        return False
    return True


class UnsavedFailures:
    """job id -> (code, message, param, completed_at, expires_at) of failures not yet in the database."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[int, str, str | None, float, float | None]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._pending

    def add(self, job_id: str, failure: tuple[int, str, str | None, float, float | None]) -> None:
        self._pending[job_id] = failure

    def discard(self, job_id: str) -> None:
        self._pending.pop(job_id, None)

    def shown(self, job: Job) -> Job:
        """`job` as a client sees it: failed if its failure waits to be written (and it has not ended)."""
        pending = self._pending.get(job.id)
        if pending is None or job.status.terminal:
            return job
        code, message, param, completed_at, expires = pending
        status = type(job.status)("failed")
        return dataclasses.replace(job, status=status, error_code=code, error_message=message, error_param=param,
                                   completed_at=completed_at, expires_at=expires)  # fmt: skip

    def write(self, db: sqlite3.Connection) -> None:
        """Write them (inside the caller's transaction; the caller clears them once it has committed)."""
        rows = [(*failure, i) for i, failure in self._pending.items()]
        db.executemany(
            "UPDATE jobs SET status='failed', error_code=?, error_message=?, error_param=?, completed_at=?,"
            " expires_at=? WHERE id=? AND status IN ('queued', 'in_progress')",
            rows,
        )

    def clear(self) -> None:
        self._pending.clear()

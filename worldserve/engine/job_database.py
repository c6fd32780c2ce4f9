"""The job store's storage folder and its SQLite database (stdlib sqlite3, WAL): what JobStore (jobs.py)
stands on.

Layout: `<root>/jobs.sqlite3`, `<root>/videos/<id>.mp4` (the output), `<root>/inputs/<id>.ref` (the uploaded
reference, image or video, kept so that an interrupted job can be re-run); folders 0700, files 0600 (the
server user's alone: prompts, references, videos). One process per storage folder (an exclusive lock on
`<root>/.lock`, held until `close()`). A disk that refuses a write while serving (full, an I/O error) raises
StorageError naming what was not saved (job_faults.py); the failures the database refused are kept in memory
and written at the next write that goes through.
Thread-safe: one writing connection behind `_lock`, shared by the event loop, the engine thread and the
encoders, and a read-only one behind `_read_lock` (in WAL mode it sees the last commit without waiting for a
write).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from worldserve.engine.job_faults import UnsavedFailures, storage_failure
from worldserve.engine.job_files import (
    StorageError,
    database_gone,
    file_identity,
    folder_unwritable,
    lock_storage,
)
from worldserve.engine.job_schema import JOB_ID_PATTERN, prepared


class JobDatabase:
    """The storage folder held by this process and its job table's two connections; every write is one
    short transaction under `_lock`. Reads go through the second connection under `_read_lock`, so a write
    stuck on a locked database (another process, a slow fsync) holds no status read."""

    def __init__(self, root: str | Path):
        """Open (or create) the store in `root`; StorageError, naming the folder or file, when it cannot be
        used (not a folder, not writable, a database that is not one, another server holding it)."""
        self.root = Path(root)
        self.videos_dir = self.root / "videos"
        self.inputs_dir = self.root / "inputs"
        self.db_path = self.root / "jobs.sqlite3"
        try:  # (folders and files it creates are the server user's alone: prompts, references, videos)
            for d in (self.root, self.videos_dir, self.inputs_dir):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self.db_path.exists():  # (SQLite gives its WAL and shared-memory files the same mode)
                os.close(os.open(self.db_path, os.O_WRONLY | os.O_CREAT, 0o600))
            for d in (self.videos_dir, self.inputs_dir):  # (folders kept from an earlier run, chmod'ed since)
                if folder_unwritable(d) is not None:
                    raise PermissionError(f"{d} is not writable by this user")
        except OSError as exc:
            raise StorageError(f"cannot use {self.root} as the storage directory: {exc}") from None
        self._owner = lock_storage(self.root)  # held until close(): one server per storage directory
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._unsaved = UnsavedFailures()  # failures the database refused (a full disk), shown by the reads
        try:
            self._db = self._open_database(self.db_path)
            self._reader = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
            self._reader.row_factory = sqlite3.Row
            self._reader.execute("PRAGMA query_only=1")
            self._db_identity = file_identity(self.db_path)
            newest = self._db.execute("SELECT MAX(created_at) FROM jobs").fetchone()[0]
        except (sqlite3.Error, OSError, StorageError) as exc:
            if hasattr(self, "_db"):
                self._db.close()
            self._owner.close()
            raise StorageError(f"cannot use the job database {self.db_path}: {exc}") from None
        self._newest_created = float(newest or 0.0)
        """The latest created_at stored: a job committed after another is never stamped before it (create)."""

    def _open_database(self, path: Path) -> sqlite3.Connection:
        """The job table at `path`, created or migrated to SCHEMA_VERSION (closed again on any failure)."""
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            return prepared(db)
        except BaseException:
            db.close()
            raise

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """BEGIN ... COMMIT, rolled back on any error (an open transaction would swallow later writes)."""
        self._db.execute("BEGIN")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:  # (a COMMIT the disk refused may or may not have rolled back)
                self._db.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """Under `_lock`, after writing the failures still unsaved: a write the disk refuses (full, an I/O
        error) raises StorageError saying what was not saved. Those still unsaved after the write are tried
        once more: a deletion frees the space they need only once its files are gone."""
        with self._lock:
            try:
                self._write_unsaved()
                yield
            except (OSError, sqlite3.OperationalError) as exc:
                raise storage_failure(exc, what) from exc
            self._write_unsaved()

    def _write_unsaved(self) -> None:
        """Under `_lock`: the failures still unsaved, written if the disk takes them now (else kept)."""
        if self._unsaved:
            with contextlib.suppress(sqlite3.OperationalError):
                with self._transaction():
                    self._unsaved.write(self._db)
                self._unsaved.clear()  # once committed (a COMMIT the disk refuses is rolled back: kept)

    def _update(self, sql: str, args: tuple) -> bool:
        with self._writing("the job's state"):
            return self._db.execute(sql, args).rowcount > 0

    def close(self) -> None:
        with self._lock, self._read_lock:
            self._write_unsaved()  # (space back since: a restart must not run those jobs again)
            self._reader.close()
            self._db.close()
            self._owner.close()  # releases the directory's lock

    def problem(self) -> str | None:
        """Why this store cannot keep what it is given any more (its database removed under the server, or its
        videos folder not writable: every job would run to its end and fail saving it), else None."""
        return database_gone(self.db_path, self._db_identity) or folder_unwritable(self.videos_dir)

    # -- paths ----------------------------------------------------------------------------------------
    def video_path(self, job_id: str) -> Path:
        assert JOB_ID_PATTERN.match(job_id), job_id  # ids never reach the disk unchecked
        return self.videos_dir / f"{job_id}.mp4"

    def reference_path(self, job_id: str) -> Path:
        assert JOB_ID_PATTERN.match(job_id), job_id
        return self.inputs_dir / f"{job_id}.ref"

    def _remove_files(self, job_id: str) -> None:
        self.video_path(job_id).unlink(missing_ok=True)
        self.reference_path(job_id).unlink(missing_ok=True)

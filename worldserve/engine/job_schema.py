"""What a video job is (JobStatus, JobSpec, Job, its id) and how the job table stores it: the schema, its
migration (older databases gain `interrupted`, `error_param`, and the `list_anchors` table of deleted jobs'
places in the list order: job_anchors.py) and the row <-> Job conversion. The store itself is jobs.py (on its
folder and database: job_database.py).
"""

from __future__ import annotations

import enum
import json
import re
import shutil
import sqlite3
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worldserve.engine.job_files import StorageError

SCHEMA_VERSION = 3  # v2: `interrupted`, v3: `error_param` (older databases gain them when opened)
JOB_ID_PATTERN = re.compile(r"^video_gen_[0-9a-f]{32}$")
"""A job id; the store names no file, and reads no row, for an id that does not match it."""


def new_job_id() -> str:
    return f"video_gen_{uuid.uuid4().hex}"


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """What the job object echoes from the request (fixed at creation)."""

    model: str
    prompt: str
    size: str | None
    seconds: str
    quality: str
    fps: float
    num_frames: int
    user: str | None = None
    upsampled_prompt: str | None = None
    """The prompt the Reasoner wrote for the video (extra_params.upsample_prompt), once written."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    id: str
    status: JobStatus
    progress: int
    """0..100: denoising steps done / total (99 at most until the file is saved)."""
    created_at: float
    spec: JobSpec
    started_at: float | None = None
    completed_at: float | None = None
    expires_at: float | None = None
    error_code: int | None = None
    error_message: str | None = None
    error_param: str | None = None
    """The request field the failure is about (a sync request's error names it), if any."""
    file_name: str | None = None
    inference_time_s: float | None = None
    stage_durations: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float | None = None


def expired(job: Job, now: float) -> bool:
    """Whether `job` is past its expires_at (the sweep deletes it within its period; reads hide it now)."""
    return job.expires_at is not None and job.expires_at <= now


SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    spec TEXT NOT NULL,
    inputs TEXT NOT NULL,
    has_reference INTEGER NOT NULL,
    started_at REAL, completed_at REAL, expires_at REAL,
    error_code INTEGER, error_message TEXT, error_param TEXT,
    file_name TEXT, inference_time_s REAL, stage_durations TEXT, peak_memory_mb REAL,
    interrupted INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_by_time ON jobs (created_at, seq);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status);
CREATE INDEX IF NOT EXISTS jobs_by_expiry ON jobs (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS list_anchors (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    seq INTEGER NOT NULL,
    deleted_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS list_anchors_by_age ON list_anchors (deleted_at);
"""
# (`list_anchors` came without a version: a database of any version gains it as it opens, and an older
# worldserve reads a database holding it as before, only writing no anchors)


def prepared(db: sqlite3.Connection) -> sqlite3.Connection:
    """`db` with its pragmas set and the job table created or migrated to SCHEMA_VERSION. A database already
    at SCHEMA_VERSION, its tables all there, is only read: a server stopped on a full disk starts again
    (JobStore.recover() then serves what is stored and takes the DELETEs that free it). StorageError naming
    the full disk, its folder and what to free when SQLite cannot open the database for want of space."""
    db.row_factory = sqlite3.Row
    try:
        # (the first access: WAL mode sizes its 32 KiB -shm file here, an I/O error on a disk without room)
        db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before it returns, so an acknowledged create survives a power loss too
        # (NORMAL in WAL mode may lose the last commits then); one fsync per write, against ~5 s a step.
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=5000")
        damage = db.execute("PRAGMA quick_check(1)").fetchone()[0]  # (before the model loads, not after)
        if damage != "ok":
            raise StorageError(f"the database is damaged ({damage}); move it aside to start with no jobs, or "
                               "restore it from a backup")  # fmt: skip
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if not 0 <= version <= SCHEMA_VERSION:
            raise StorageError(f"schema v{version}; this worldserve reads v1 to v{SCHEMA_VERSION}")
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if version != SCHEMA_VERSION or not {"jobs", "list_anchors"} <= tables:
            _migrate(db)
    except sqlite3.OperationalError as exc:
        if (full := _full_disk(db, exc)) is not None:
            raise StorageError(full) from exc
        raise
    return db


def _migrate(db: sqlite3.Connection) -> None:
    """The tables created (a new database; `list_anchors` in one from before it), the columns added and the
    version written, in one transaction (DDL is transactional in SQLite)."""
    db.execute("BEGIN")
    try:
        for statement in SCHEMA.split(";"):
            if statement.strip():
                db.execute(statement)
        columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
        if "interrupted" not in columns:  # a v1 database
            db.execute("ALTER TABLE jobs ADD COLUMN interrupted INTEGER NOT NULL DEFAULT 0")
        if "error_param" not in columns:  # v1, v2
            db.execute("ALTER TABLE jobs ADD COLUMN error_param TEXT")
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


ROOM_TO_OPEN = 1 << 20
"""Free bytes below which an I/O error opening the database is read as a full disk: WAL mode needs 32 KiB for
its -shm file (SQLite writes each of its pages: SQLITE_IOERR_SHMSIZE, "disk I/O error", on a full tmpfs) and
room for the WAL's first frames."""
FULL_DISK_CODES = frozenset({sqlite3.SQLITE_FULL})


def _full_disk(db: sqlite3.Connection, exc: sqlite3.OperationalError) -> str | None:
    """Why the database could not be opened when it is for want of space (SQLITE_FULL, or an I/O error with
    less than ROOM_TO_OPEN free in its folder), naming the folder and what to free; else None."""
    # (the file's name needs no I/O: SQLite's pager has it)
    folder = Path(db.execute("PRAGMA database_list").fetchone()[2]).parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    code = getattr(exc, "sqlite_errorcode", None) or 0
    # (extended codes: the primary one in the low byte, e.g. SQLITE_IOERR_SHMSIZE)
    io_error_without_room = code & 0xFF == sqlite3.SQLITE_IOERR and free < ROOM_TO_OPEN
    if code & 0xFF not in FULL_DISK_CODES and not io_error_without_room:
        return None
    return (
        f"the disk of the storage folder {folder} is full ({free} bytes free; SQLite: {exc}): free at least "
        f"{ROOM_TO_OPEN >> 20} MiB on it and start again, e.g. by removing old videos from {folder / 'videos'} "
        "(their jobs are deleted as the server starts)"
    )


def spec_record(spec: JobSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in JobSpec.__slots__}


def job_from_row(row: sqlite3.Row) -> Job:
    return Job(
        id=row["id"],
        status=JobStatus(row["status"]),
        progress=row["progress"],
        created_at=row["created_at"],
        spec=JobSpec(**{k: v for k, v in json.loads(row["spec"]).items() if k in JobSpec.__slots__}),
        started_at=row["started_at"],
        completed_at=row["completed_at"],
        expires_at=row["expires_at"],
        error_code=row["error_code"],
        error_message=row["error_message"],
        error_param=row["error_param"],
        file_name=row["file_name"],
        inference_time_s=row["inference_time_s"],
        stage_durations=json.loads(row["stage_durations"]) if row["stage_durations"] else {},
        peak_memory_mb=row["peak_memory_mb"],
    )

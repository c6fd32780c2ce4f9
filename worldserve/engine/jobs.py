"""Durable video jobs: one SQLite database (stdlib sqlite3, WAL) plus files under the storage folder.

Layout: `<root>/jobs.sqlite3`, `<root>/videos/<id>.mp4` (the output), `<root>/inputs/<id>.ref` (the uploaded
reference image, kept so that an interrupted job can be re-run). Files are written atomically (temp file,
fsync, rename, fsync of the folder); a row turns `completed` only after its file is in place, so a crash
never leaves a completed job without its video.

Lifecycle: `queued -> in_progress -> completed | failed`. DELETE removes the row and its files (as vLLM-Omni
does), so there is no `cancelled` status. After a crash or a shutdown, `recover()` turns every `in_progress`
row back into `queued` (progress 0): the server re-runs it from its persisted inputs, unless the process
has died MAX_INTERRUPTIONS times while running it (a job that crashes the server, e.g. out of host memory,
would otherwise take it down on every start): then it fails with a message saying so. One process per
storage folder (an exclusive lock on `<root>/.lock`). Updates are guarded by
the current status, so a job deleted while its video was being encoded is never resurrected.
Thread-safe: one connection behind a lock, shared by the event loop, the engine thread and the encoders.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import re
import sqlite3
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worldserve.engine.job_files import StorageError, lock_storage, write_atomic

JOB_ID_PATTERN = re.compile(r"^video_gen_[0-9a-f]{32}$")
log = logging.getLogger(__name__)
SCHEMA_VERSION = 2  # v2: `interrupted` (v1 databases gain it when opened)
MAX_INTERRUPTIONS = 3
"""Starts that found a job in_progress (the process died running it) before recover() fails it instead."""
GONE_CURSORS = 10_000
"""Deleted jobs whose place in the list order is remembered, so that a client paging with one as `after`
(deleted, or expired, between two pages) goes on where it was instead of getting an empty last page."""


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.COMPLETED, JobStatus.FAILED)


def new_job_id() -> str:
    return f"video_gen_{uuid.uuid4().hex}"


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
    file_name: str | None = None
    inference_time_s: float | None = None
    stage_durations: dict[str, float] = field(default_factory=dict)
    peak_memory_mb: float | None = None


_SCHEMA = """
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
    error_code INTEGER, error_message TEXT,
    file_name TEXT, inference_time_s REAL, stage_durations TEXT, peak_memory_mb REAL,
    interrupted INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_by_time ON jobs (created_at, seq);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status);
"""
_UNFINISHED = ("queued", "in_progress")


class JobStore:
    """SQLite rows + files; every method is one short transaction under `_lock`."""

    def __init__(self, root: str | Path):
        """Open (or create) the store in `root`; StorageError, naming the folder or file, when it cannot be
        used (not a folder, not writable, a database that is not one, another server holding it)."""
        self.root = Path(root)
        self.videos_dir = self.root / "videos"
        self.inputs_dir = self.root / "inputs"
        try:
            for d in (self.root, self.videos_dir, self.inputs_dir):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot use {self.root} as the storage directory: {exc}") from None
        self._owner = lock_storage(self.root)  # held until close(): one server per storage directory
        self._lock = threading.Lock()
        self._gone: OrderedDict[str, tuple[float, int]] = OrderedDict()
        """(created_at, seq) of the jobs deleted lately: a list cursor (`after`) naming one still pages on."""
        try:
            self._db = self._open_database(self.root / "jobs.sqlite3")
        except (sqlite3.Error, StorageError) as exc:
            self._owner.close()
            raise StorageError(f"cannot use the job database {self.root / 'jobs.sqlite3'}: {exc}") from None

    def _open_database(self, path: Path) -> sqlite3.Connection:
        """The job table at `path`, created or migrated to SCHEMA_VERSION (closed again on any failure)."""
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            return self._prepared(db)
        except BaseException:
            db.close()
            raise

    @staticmethod
    def _prepared(db: sqlite3.Connection) -> sqlite3.Connection:
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is on disk before it returns, so an acknowledged create survives a power loss too
        # (NORMAL in WAL mode may lose the last commits then); one fsync per write, against ~5 s a step.
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=5000")
        db.executescript(_SCHEMA)
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, 1, SCHEMA_VERSION):
            raise StorageError(f"schema v{version}; this worldserve reads v1 and v{SCHEMA_VERSION}")
        db.execute("BEGIN")  # the column and the version together (DDL is transactional in SQLite)
        columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
        if "interrupted" not in columns:  # a v1 database
            db.execute("ALTER TABLE jobs ADD COLUMN interrupted INTEGER NOT NULL DEFAULT 0")
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.execute("COMMIT")
        return db

    @contextlib.contextmanager
    def _transaction(self):
        """BEGIN ... COMMIT, rolled back on any error (an open transaction would swallow later writes)."""
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._owner.close()  # releases the directory's lock

    # -- paths ----------------------------------------------------------------------------------------
    def video_path(self, job_id: str) -> Path:
        assert JOB_ID_PATTERN.match(job_id), job_id  # ids never reach the disk unchecked
        return self.videos_dir / f"{job_id}.mp4"

    def reference_path(self, job_id: str) -> Path:
        assert JOB_ID_PATTERN.match(job_id), job_id
        return self.inputs_dir / f"{job_id}.ref"

    # -- writes ---------------------------------------------------------------------------------------
    def create(self, job: Job, inputs: dict[str, Any], reference: bytes | None) -> None:
        """Persist a new queued job: its reference file first, then the row (the row is the commit)."""
        if reference is not None:
            write_atomic(self.reference_path(job.id), reference)
        spec = json.dumps(_spec_record(job.spec))
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (id, status, progress, created_at, spec, inputs, has_reference)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (job.id, job.status.value, job.progress, job.created_at, spec, json.dumps(inputs),
                 int(reference is not None)),
            )  # fmt: skip

    def set_upsampled(self, job_id: str, spec: JobSpec, inputs: dict[str, Any]) -> bool:
        """Record a queued job's upsampled prompt: the spec that shows it and the inputs that now run with it
        (a restart does not upsample again). False when the job is gone or no longer queued."""
        return self._update(
            "UPDATE jobs SET spec=?, inputs=? WHERE id=? AND status='queued'",
            (json.dumps(_spec_record(spec)), json.dumps(inputs), job_id),
        )

    def mark_in_progress(self, job_id: str, started_at: float) -> bool:
        return self._update(
            "UPDATE jobs SET status='in_progress', started_at=?, progress=0 WHERE id=? AND status='queued'",
            (started_at, job_id),
        )

    def set_progress(self, updates: Sequence[tuple[str, int]]) -> None:
        with self._lock, self._transaction():
            self._db.executemany(
                "UPDATE jobs SET progress=? WHERE id=? AND status='in_progress'", [(p, i) for i, p in updates]
            )

    def complete(
        self,
        job_id: str,
        video: bytes,
        *,
        completed_at: float,
        ttl_s: float | None,
        inference_time_s: float,
        stage_durations: dict[str, float],
        peak_memory_mb: float,
    ) -> bool:
        """Save the video, then flip the row; False (and no file) if the job was deleted meanwhile."""
        path = self.video_path(job_id)
        write_atomic(path, video)
        expires = completed_at + ttl_s if ttl_s else None
        done = self._update(
            "UPDATE jobs SET status='completed', progress=100, completed_at=?, expires_at=?, file_name=?,"
            " inference_time_s=?, stage_durations=?, peak_memory_mb=? WHERE id=? AND status='in_progress'",
            (completed_at, expires, path.name, inference_time_s, json.dumps(stage_durations), peak_memory_mb,
             job_id),
        )  # fmt: skip
        if not done:
            if self.get(job_id) is None:  # deleted meanwhile; a row in another state keeps its file
                path.unlink(missing_ok=True)
        else:
            self.reference_path(job_id).unlink(missing_ok=True)
        return done

    def fail(self, job_id: str, code: int, message: str, *, completed_at: float, ttl_s: float | None) -> bool:
        expires = completed_at + ttl_s if ttl_s else None
        done = self._update(
            "UPDATE jobs SET status='failed', error_code=?, error_message=?, completed_at=?, expires_at=?"
            " WHERE id=? AND status IN ('queued', 'in_progress')",
            (code, message, completed_at, expires, job_id),
        )
        if done:
            self.reference_path(job_id).unlink(missing_ok=True)
        return done

    def delete(self, job_id: str) -> Job | None:
        """Remove the row and every file of the job; None if there was no such job."""
        if not JOB_ID_PATTERN.match(job_id):
            return None
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                return None
            self._db.execute("DELETE FROM jobs WHERE id=?", (job_id,))
            self._gone[job_id] = (row["created_at"], row["seq"])
            if len(self._gone) > GONE_CURSORS:
                self._gone.popitem(last=False)
        self.video_path(job_id).unlink(missing_ok=True)
        self.reference_path(job_id).unlink(missing_ok=True)
        return _job_from_row(row)

    def recover(self, *, now: float | None = None, ttl_s: float | None = None) -> list[str]:
        """After a restart: in_progress -> queued (progress 0), or failed once the process has died running
        the job MAX_INTERRUPTIONS times; finished jobs without an expiry get one from `ttl_s`; stray
        temp/orphan files removed.

        Returns the ids of every unfinished job, oldest first: the caller re-submits them.
        """
        now = time.time() if now is None else now
        message = (
            f"The server stopped {MAX_INTERRUPTIONS} times while running this job (it may be what crashes it, "
            "e.g. out of host memory); it is not run again."
        )
        with self._lock, self._transaction():
            if ttl_s:  # jobs finished with no TTL: this one counts from their completion (set ones stay)
                self._db.execute(
                    "UPDATE jobs SET expires_at = completed_at + ? WHERE expires_at IS NULL AND completed_at IS"
                    " NOT NULL AND status IN ('completed', 'failed')",
                    (ttl_s,),
                )
            self._db.execute("UPDATE jobs SET interrupted = interrupted + 1 WHERE status='in_progress'")
            self._db.execute(
                "UPDATE jobs SET status='failed', error_code=500, error_message=?, completed_at=?, expires_at=?"
                " WHERE status='in_progress' AND interrupted >= ?",
                (message, now, now + ttl_s if ttl_s else None, MAX_INTERRUPTIONS),
            )
            self._db.execute(
                "UPDATE jobs SET status='queued', progress=0, started_at=NULL WHERE status='in_progress'"
            )
            rows = self._db.execute("SELECT id, status FROM jobs").fetchall()
            unfinished = self._db.execute(
                "SELECT id FROM jobs WHERE status='queued' ORDER BY created_at, seq"
            ).fetchall()
        completed = {r["id"] for r in rows if r["status"] == "completed"}
        queued = {
            r["id"] for r in rows if r["status"] == "queued"
        }  # the only ones whose inputs are read again
        for folder, keep in ((self.videos_dir, completed), (self.inputs_dir, queued)):
            for path in folder.iterdir():
                if path.name.startswith(".") or path.name.split(".")[0] not in keep:
                    path.unlink(missing_ok=True)
        return [r["id"] for r in unfinished]

    def requeue(self, job_ids: Sequence[str]) -> None:
        """Give in_progress jobs back to the queue (progress 0), e.g. when the engine stops mid-run."""
        with self._lock:
            self._db.executemany(
                "UPDATE jobs SET status='queued', progress=0, started_at=NULL WHERE id=? AND status='in_progress'",
                [(i,) for i in job_ids],
            )

    def expired(self, now: float) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
            )
            return [r["id"] for r in rows.fetchall()]

    # -- reads ----------------------------------------------------------------------------------------
    def get(self, job_id: str) -> Job | None:
        if not JOB_ID_PATTERN.match(job_id):
            return None
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return _job_from_row(row) if row is not None else None

    def load_inputs(self, job_id: str) -> tuple[dict[str, Any], bytes | None]:
        """The persisted request inputs; raises FileNotFoundError if the reference file is gone."""
        with self._lock:
            row = self._db.execute("SELECT inputs, has_reference FROM jobs WHERE id=?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(job_id)
        reference = self.reference_path(job_id).read_bytes() if row["has_reference"] else None
        return json.loads(row["inputs"]), reference

    def list(
        self, *, after: str | None = None, limit: int | None = None, order: str = "desc"
    ) -> tuple[list[Job], bool]:
        """One page in `created_at` order, starting after the job `after` (also one deleted since the previous
        page was read, while this process remembers it); returns (jobs, has_more)."""
        assert order in ("asc", "desc")
        where, args = "", []
        with self._lock:
            if after is not None:
                row = self._db.execute("SELECT created_at, seq FROM jobs WHERE id=?", (after,)).fetchone()
                anchor = (row["created_at"], row["seq"]) if row is not None else self._gone.get(after)
                if anchor is None:
                    return [], False
                where = f"WHERE (created_at, seq) {'>' if order == 'asc' else '<'} (?, ?)"
                args = list(anchor)
            sql = f"SELECT * FROM jobs {where} ORDER BY created_at {order}, seq {order}"
            if limit is not None:
                sql += " LIMIT ?"
                args.append(limit + 1)
            rows = self._db.execute(sql, args).fetchall()
        jobs = [_job_from_row(r) for r in rows]
        if limit is None:
            return jobs, False
        return jobs[:limit], len(jobs) > limit

    def count(self, status: JobStatus) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM jobs WHERE status=?", (status.value,)).fetchone()[0]

    def _update(self, sql: str, args: tuple) -> bool:
        with self._lock:
            return self._db.execute(sql, args).rowcount > 0


def _spec_record(spec: JobSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in JobSpec.__slots__}


def _job_from_row(row: sqlite3.Row) -> Job:
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
        file_name=row["file_name"],
        inference_time_s=row["inference_time_s"],
        stage_durations=json.loads(row["stage_durations"]) if row["stage_durations"] else {},
        peak_memory_mb=row["peak_memory_mb"],
    )

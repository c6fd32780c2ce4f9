"""Durable video jobs: JobStore, their rows in one SQLite database plus their files under the storage folder
(the folder, its lock, the connections and the write discipline: job_database.py).

Files are written atomically (temp file, fsync, rename, fsync of the folder); a row turns `completed` only
after its file is in place, so a crash never leaves a completed job without its video.

Lifecycle: `queued -> in_progress -> completed | failed`. DELETE removes the row and its files (as vLLM-Omni
does), so there is no `cancelled` status (job_deletion.py: in which order, and a deletion a full disk
refuses). After a crash or a shutdown, `recover()` turns every `in_progress` row back into `queued` (progress
0): the server re-runs it from its persisted inputs, unless the server has stopped MAX_INTERRUPTIONS times while
running it (a job that crashes the server, e.g. out of host memory, would otherwise take it down on every
start): then it fails with a message saying so. A stop counts when the process died running the job (found by
`recover()` at the next start) or when the engine loop crashed running it (`requeue(crashed=True)`: the
loop's crash, not the process's, would otherwise crash it again at every restart); a clean shutdown that
parks it does not count. Updates are guarded by
the current status, so a job deleted while its video was being encoded is never resurrected. A disk that
refuses a write while serving (full, an I/O error) raises StorageError naming what was not saved
(job_faults.py), never a half-written file; progress is then skipped and a failure kept until it can be written,
and a file it cannot remove any more (a read-only disk) is left for the start-up sweep.
A deleted job's place in the list order is kept (job_anchors.py): a listing paged with it as `after` goes on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from worldserve.engine.job_deletion import JobRemoval
from worldserve.engine.job_faults import StorageFull, remove_or_leave, storage_failure
from worldserve.engine.job_files import (
    StorageError,
    folder_unwritable,
    remove_strays,
    write_atomic,
)
from worldserve.engine.job_schema import (
    JOB_ID_PATTERN,
    SCHEMA_VERSION,
    Job,
    JobSpec,
    JobStatus,
    expired,
    job_from_row,
    spec_record,
)

__all__ = ["SCHEMA_VERSION", "Job", "JobSpec", "JobStatus", "JobStore", "StorageError"]

log = logging.getLogger(__name__)
MAX_INTERRUPTIONS = 3
"""Times the server may stop while running a job (the process died, or the engine loop crashed) before the job
is failed (GIVEN_UP_MESSAGE) instead of run again."""
GIVEN_UP_MESSAGE = (
    f"The server stopped {MAX_INTERRUPTIONS} times while running this job (it may be what crashes it, "
    "e.g. out of host memory); it is not run again."
)
"""The error of a job failed after MAX_INTERRUPTIONS stops (code 500)."""
_UNFINISHED = ("queued", "in_progress")
LISTED_COLUMNS = (
    "id, status, progress, created_at, spec, started_at, completed_at, expires_at, error_code, error_message, "
    "error_param, file_name, inference_time_s, stage_durations, peak_memory_mb"
)
"""What `job_from_row` reads (a listing's rows)."""
LIST_BATCH_ROWS = 1000
"""Rows a listing reads under the read lock at a time (100k jobs held it for ~2 s in one fetch)."""


class JobStore(JobRemoval):
    """The jobs' rows and files through their lifecycle: created, run, finished, deleted, recovered after a
    restart, expired; read one at a time or a page at a time (job_database.py: the connections and locks)."""

    def __init__(self, root: str | Path):
        """Open (or create) the store in `root` (JobDatabase: StorageError when it cannot be used)."""
        super().__init__(root)
        self._progress_refused = False  # logged once until a progress write goes through again

    # -- writes ---------------------------------------------------------------------------------------
    def create(self, job: Job, inputs: dict[str, Any], reference: bytes | None) -> Job:
        """Persist a new queued job: its reference file first, then the row (the row is the commit); the job as
        stored. Its created_at is raised, if needed, to the latest one stored: the list pages by (created_at,
        seq), and a create stamped on the event loop whose write (a large reference's fsync) took longer than a
        later one's would otherwise land behind a cursor a client paging `order=asc` has already passed.
        StorageError when the store's database is gone (`problem`: the job would be lost at the restart)."""
        if (problem := self.problem()) is not None:
            raise StorageError(f"the server's storage cannot keep new jobs: {problem}")
        spec = json.dumps(spec_record(job.spec))
        try:
            if reference is not None:
                try:
                    write_atomic(self.reference_path(job.id), reference)
                except OSError as exc:
                    raise storage_failure(exc, "the job's reference file") from exc
            with self._writing("the job"):
                job = dataclasses.replace(job, created_at=max(job.created_at, self._newest_created))
                self._db.execute(
                    "INSERT INTO jobs (id, status, progress, created_at, spec, inputs, has_reference)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (job.id, job.status.value, job.progress, job.created_at, spec, json.dumps(inputs),
                     int(reference is not None)),
                )  # fmt: skip
                self._newest_created = job.created_at
        except StorageError:
            remove_or_leave(self.reference_path(job.id), job.id, "reference file")
            raise
        return job

    def set_upsampled(self, job_id: str, spec: JobSpec, inputs: dict[str, Any]) -> bool:
        """Record a queued job's upsampled prompt: the spec that shows it and the inputs that now run with it
        (a restart does not upsample again). False when the job is gone or no longer queued."""
        return self._update(
            "UPDATE jobs SET spec=?, inputs=? WHERE id=? AND status='queued'",
            (json.dumps(spec_record(spec)), json.dumps(inputs), job_id),
        )

    def mark_in_progress(self, job_id: str, started_at: float) -> bool:
        """False when the job is gone or no longer queued; StorageError when the disk refuses the write or the
        job's video could not be saved (`folder_unwritable`: found before the job runs, not at its end) (the
        engine then fails the job as any other failure of its admission)."""
        if (unwritable := folder_unwritable(self.videos_dir)) is not None:
            if (job := self.get(job_id)) is None or job.status is not JobStatus.QUEUED:
                return False  # (deleted while it waited: the engine ends it as cancelled, not failed)
            raise StorageError(f"the server's storage cannot keep the job's video: {unwritable}")
        return self._update(
            "UPDATE jobs SET status='in_progress', started_at=?, progress=0 WHERE id=? AND status='queued'",
            (started_at, job_id),
        )

    def set_progress(self, updates: Sequence[tuple[str, int]]) -> None:
        """Best effort: a write the disk refuses is skipped (the next step's overwrites it), logged once."""
        try:
            with self._writing("the progress"), self._transaction():
                self._db.executemany(
                    "UPDATE jobs SET progress=? WHERE id=? AND status='in_progress'",
                    [(p, i) for i, p in updates],
                )
        except StorageError as exc:
            if not self._progress_refused:
                log.warning("%s (skipped until the disk takes writes again)", exc)
            self._progress_refused = True
            return
        if self._progress_refused:
            log.info("job progress is saved again")
            self._progress_refused = False

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
        try:
            write_atomic(path, video)  # (its temp file is removed when it fails)
        except OSError as exc:
            raise storage_failure(exc, "the video") from exc
        expires = completed_at + ttl_s if ttl_s else None
        try:
            done = self._update(
                "UPDATE jobs SET status='completed', progress=100, completed_at=?, expires_at=?, file_name=?,"
                " inference_time_s=?, stage_durations=?, peak_memory_mb=? WHERE id=? AND status='in_progress'",
                (completed_at, expires, path.name, inference_time_s, json.dumps(stage_durations), peak_memory_mb,
                 job_id),
            )  # fmt: skip
        except StorageError:  # the row stays unfinished: no file that no completed row names
            remove_or_leave(path, job_id, "video")
            raise
        if not done:
            if self.get(job_id) is None:  # deleted meanwhile; a row in another state keeps its file
                remove_or_leave(path, job_id, "video")
        else:
            remove_or_leave(self.reference_path(job_id), job_id, "reference file")
        return done

    def fail(
        self, job_id: str, code: int, message: str, *, completed_at: float, ttl_s: float | None,
        param: str | None = None,
    ) -> bool:  # fmt: skip
        """Fail the job if it is unfinished (False when it is gone or ended). A failure the database refuses
        is kept in memory (job_faults.py) and so is the job's reference: a restart before it is written runs
        the job again. A disk refusing writes (full, read-only) raises nothing: the engine ends the job all the
        same."""
        expires = completed_at + ttl_s if ttl_s else None
        written = True
        try:
            done = self._update(
                "UPDATE jobs SET status='failed', error_code=?, error_message=?, error_param=?, completed_at=?,"
                " expires_at=? WHERE id=? AND status IN ('queued', 'in_progress')",
                (code, message, param, completed_at, expires, job_id),
            )
        except StorageError as exc:  # shown failed now, written once the disk takes it (job_faults.py)
            log.warning("job %s: %s; its failure is kept in memory until it can be written", job_id, exc)
            written = False
            with self._lock:  # (the check and the add as one: a concurrent write may be writing them)
                row = self._db.execute("SELECT status FROM jobs WHERE id=?", (job_id,)).fetchone()
                done = row is not None and row["status"] in _UNFINISHED and job_id not in self._unsaved
                if done:
                    self._unsaved.add(job_id, (code, message, param, completed_at, expires))
        if done and written:
            remove_or_leave(self.reference_path(job_id), job_id, "reference file")
        return done

    def recover(
        self,
        *,
        now: float | None = None,
        ttl_s: float | None = None,
        on_failed: Callable[[int], None] | None = None,
    ) -> list[str]:
        """After a restart: in_progress -> queued (progress 0), or failed once the server has stopped running
        the job MAX_INTERRUPTIONS times, this death of the process included (`on_failed(500)` for each: the
        metrics count it); finished jobs
        without an expiry get one from `ttl_s` (without a TTL none keeps one: nothing expires); completed
        jobs whose video is missing deleted (`delete_videoless`: a DELETE whose row a full disk refused, or a
        video removed by hand); the store's stray temp files and orphans removed (only files it writes:
        another file in its folders is left be). On a full disk the server starts all the same (reads and
        DELETEs), its unfinished jobs left as they are until a start with space.

        Returns the ids of every unfinished job, oldest first: the caller re-submits them.
        """
        now = time.time() if now is None else now
        try:
            with self._lock, self._transaction():
                if ttl_s:  # jobs finished with no TTL: this one counts from their completion (set ones stay)
                    self._db.execute(
                        "UPDATE jobs SET expires_at = completed_at + ? WHERE expires_at IS NULL AND completed_at"
                        " IS NOT NULL AND status IN ('completed', 'failed')",
                        (ttl_s,),
                    )
                else:  # a server without a TTL expires nothing: no job says it will (nor keeps a past date)
                    self._db.execute("UPDATE jobs SET expires_at = NULL WHERE expires_at IS NOT NULL")
                self._db.execute("UPDATE jobs SET interrupted = interrupted + 1 WHERE status='in_progress'")
                given_up = self._db.execute(
                    "UPDATE jobs SET status='failed', error_code=500, error_message=?, completed_at=?, expires_at=?"
                    " WHERE status='in_progress' AND interrupted >= ?",
                    (GIVEN_UP_MESSAGE, now, now + ttl_s if ttl_s else None, MAX_INTERRUPTIONS),
                ).rowcount
                self._db.execute(
                    "UPDATE jobs SET status='queued', progress=0, started_at=NULL WHERE status='in_progress'"
                )
                unfinished = self._db.execute(
                    "SELECT id FROM jobs WHERE status='queued' ORDER BY created_at, seq"
                ).fetchall()
        except sqlite3.OperationalError as exc:
            if not isinstance(storage_failure(exc, "the restart"), StorageFull):
                raise
            # a disk full (of videos): start anyway, to serve what is stored and take DELETEs that free it;
            # the unfinished jobs stay as they were (running them would need the disk) until a restart
            log.warning("the job store cannot record this restart (%s): its unfinished jobs stay as they are "
                        "until the server restarts with free space; DELETE old videos to free it", exc)  # fmt: skip
            given_up, unfinished = 0, []
        self.delete_videoless(now)
        with self._lock:
            rows = self._db.execute("SELECT id, status FROM jobs").fetchall()
        remove_strays(self.videos_dir, keep={r["id"] for r in rows if r["status"] == "completed"})
        remove_strays(self.inputs_dir, keep={r["id"] for r in rows if r["status"] in _UNFINISHED})
        if on_failed is not None:
            for _ in range(given_up):
                on_failed(500)
        return [r["id"] for r in unfinished]

    def requeue(
        self, job_ids: Sequence[str], *, crashed: bool = False, ttl_s: float | None = None
    ) -> list[str]:
        """Give in_progress jobs back to the queue (progress 0), e.g. when the engine stops mid-run. `crashed`:
        the engine loop crashed running them, which counts as a stop (MAX_INTERRUPTIONS) as a death of the
        process does: those stopped that many times are failed instead (GIVEN_UP_MESSAGE, expiring after
        `ttl_s`, their references removed); their ids are returned (the caller counts and reports them)."""
        ids = [(i,) for i in job_ids]
        given_up: list[str] = []
        try:
            with self._writing("the requeued jobs"), self._transaction():
                if crashed:
                    self._db.executemany(
                        "UPDATE jobs SET interrupted = interrupted + 1 WHERE id=? AND status='in_progress'",
                        ids,
                    )
                    now = time.time()
                    failure = (GIVEN_UP_MESSAGE, now, now + ttl_s if ttl_s else None, MAX_INTERRUPTIONS)
                    for (job_id,) in ids:
                        cursor = self._db.execute(
                            "UPDATE jobs SET status='failed', error_code=500, error_message=?, completed_at=?,"
                            " expires_at=? WHERE status='in_progress' AND interrupted >= ? AND id=?",
                            (*failure, job_id),
                        )
                        if cursor.rowcount:
                            given_up.append(job_id)
                self._db.executemany(
                    "UPDATE jobs SET status='queued', progress=0, started_at=NULL WHERE id=? AND status='in_progress'",
                    ids,
                )
        except StorageError as exc:  # they stay in_progress in the database: recover() counts and queues them
            log.warning("%s", exc)
            return []
        for job_id in given_up:
            remove_or_leave(self.reference_path(job_id), job_id, "reference file")
        return given_up

    # -- reads ----------------------------------------------------------------------------------------
    def get(self, job_id: str) -> Job | None:
        if not JOB_ID_PATTERN.match(job_id):
            return None
        with self._read_lock:
            row = self._reader.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        # (a deletion kept in memory, job_deletion.py: gone, as its DELETE was answered)
        if row is None or job_id in self._unsaved_deletions:
            return None
        job = self._unsaved.shown(job_from_row(row))
        # (an expired job not yet swept is gone already: its expires_at said so)
        return None if expired(job, time.time()) else job

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
        page was read, across a restart too: job_anchors.py); returns (jobs, has_more)."""
        assert order in ("asc", "desc")
        now = time.time()  # (expired jobs not yet swept are left out, as get leaves them)
        where, args = "WHERE (expires_at IS NULL OR expires_at > ?)", [now]
        with self._read_lock:
            if after is not None:
                row = self._reader.execute("SELECT created_at, seq FROM jobs WHERE id=?", (after,)).fetchone()
                anchor: tuple[float, int] | None
                if row is not None:
                    anchor = (row["created_at"], row["seq"])
                else:
                    # deleted (or expired) since the client's previous page
                    anchor = self._anchors.lookup(self._reader, after)
                if anchor is None:
                    return [], False
                where += f" AND (created_at, seq) {'>' if order == 'asc' else '<'} (?, ?)"
                args += list(anchor)
            # (not `inputs`: a listing shows none of it, and it is the rows' largest column). No SQL LIMIT:
            # a row the reads hide (a failure kept in memory whose expiry has passed) would leave the page
            # short; the index order streams the rows and the loop below stops once the page is full.
            sql = f"SELECT {LISTED_COLUMNS} FROM jobs {where} ORDER BY created_at {order}, seq {order}"
            cursor = self._reader.execute(sql, args)
        # one row more than the page says whether it has more
        wanted = None if limit is None else limit + 1
        jobs: list[Job] = []
        try:
            while wanted is None or len(jobs) < wanted:
                # a batch at a time: single-job reads (a GET, a sync request's wake-up) go between them
                batch = LIST_BATCH_ROWS if wanted is None else min(LIST_BATCH_ROWS, wanted - len(jobs))
                with self._read_lock:
                    rows = cursor.fetchmany(batch)
                if not rows:
                    break
                jobs += [
                    job
                    for r in rows
                    if r["id"] not in self._unsaved_deletions
                    and not expired(job := self._unsaved.shown(job_from_row(r)), now)
                ]
        finally:
            # a listing stopped before its last row ends its statement here (and its read snapshot)
            with self._read_lock:
                cursor.close()
        if limit is None:
            return jobs, False
        return jobs[:limit], len(jobs) > limit

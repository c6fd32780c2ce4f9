"""How jobs leave the store: DELETE (`delete`), the TTL sweep (`delete_expired`), the completed jobs a restart
finds without their video (`delete_videoless`), and the deletions a full disk refused (`UnsavedDeletions`).
JobStore (jobs.py) is this on top of JobDatabase (job_database.py).

A DELETE is answered as the store then reads, across a restart too:
- A completed job: its video first, then its row. On a disk full of videos the row's deletion needs the space
  the video frees. If the database still refuses it (full, an I/O error), the video is gone all the same, so
  the deletion is kept in memory (`UnsavedDeletions`): reads say the job is gone (GET 404, not listed, a
  second DELETE 404), the answer is the deleted job, and the row goes at the next write that succeeds, at
  close, or at the next start, where a completed job without its video is deleted (`delete_videoless`: the
  file's absence is the record a full disk cannot refuse). A video that cannot be removed (a StorageError)
  leaves the job as it was.
- Any other job (queued, in progress, failed): its row first, then its files. Nothing of it is removed
  unless its row goes (a refused row is a StorageError, 507 on a full disk, the job as it was): a missing
  reference would not read as a deletion after a restart (the job would fail, "its reference is missing").
  A file that cannot be removed after its row went is a stray, removed at the next start.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path

from worldserve.engine.job_anchors import ListAnchors
from worldserve.engine.job_database import JobDatabase
from worldserve.engine.job_schema import JOB_ID_PATTERN, Job, JobStatus, expired, job_from_row

# (the store's logger: its operators and tests follow one name)
log = logging.getLogger("worldserve.engine.jobs")
EXPIRY_BATCH = 500
"""Expired jobs deleted per transaction by the TTL sweep."""
SHOWN_IDS = 10
"""Job ids a log line names (the rest counted)."""


class UnsavedDeletions:
    """job id -> (its row: id, created_at, seq; the time of its DELETE) of completed jobs whose video is gone
    but whose row the database refused to delete; the reads leave them out."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[sqlite3.Row, float]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._pending

    def add(self, row: sqlite3.Row, deleted_at: float) -> None:
        self._pending[row["id"]] = (row, deleted_at)

    def discard(self, job_id: str) -> None:
        self._pending.pop(job_id, None)

    def rows(self) -> tuple[list[sqlite3.Row], float]:
        """Their rows and the time of the latest DELETE (their anchors are stored with it)."""
        pending = list(self._pending.values())
        return [row for row, _ in pending], max((at for _, at in pending), default=0.0)


class JobRemoval(JobDatabase):
    """The store's deletions (module docstring); its list anchors (job_anchors.py) are stored as jobs go."""

    def __init__(self, root: str | Path) -> None:
        super().__init__(root)
        self._anchors = ListAnchors()
        """(created_at, seq) of the jobs deleted lately: a list cursor (`after`) naming one still pages on."""
        self._unsaved_deletions = UnsavedDeletions()

    def delete(self, job_id: str) -> Job | None:
        """Delete the job, its row and its files (the order and a full disk: module docstring); the job as it
        was, None if there was no such job (or it expired, or was deleted already)."""
        if not JOB_ID_PATTERN.match(job_id) or job_id in self._unsaved_deletions:
            return None
        with self._writing("the deletion"):
            row = self._db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                return None
            now = time.time()
            job = self._unsaved.shown(job_from_row(row))
            if job.status is JobStatus.COMPLETED:
                self._remove_files(job_id)
                try:
                    self._delete_rows([row], now)
                except sqlite3.OperationalError as exc:
                    self._unsaved_deletions.add(row, now)
                    log.warning("job %s: its video is deleted, its row's deletion is kept in memory until "
                                "the database takes it (%s)", job_id, exc)  # fmt: skip
            else:
                self._delete_rows([row], now)
                try:
                    self._remove_files(job_id)
                except OSError as exc:
                    log.warning("job %s deleted, a file of it left until the next start: %s", job_id, exc)
        # (an expired job not yet swept is gone already, as get() and the list say: its files go now, and the
        # answer is "no such job")
        return None if expired(job, now) else job

    def delete_expired(self, now: float, batch: int = EXPIRY_BATCH) -> list[str]:
        """Delete the jobs expired at `now` (rows and files), `batch` rows a transaction with the lock free
        between them (the event loop's reads wait for one batch, not for the whole sweep); their ids. Files
        first, as `delete` does for a completed job: a refused row stays (hidden: it is expired) for the next
        sweep (a StorageError), and a job whose file stays keeps its row."""
        deleted: list[str] = []
        while True:
            with self._writing("the expired jobs' deletion"):
                rows = self._db.execute(
                    "SELECT id, created_at, seq FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ?"
                    " LIMIT ?",
                    (now, batch),
                ).fetchall()
                gone, kept = [], None
                for r in rows:
                    try:
                        self._remove_files(r["id"])
                        gone.append(r)
                    except OSError as exc:
                        kept = kept or (r["id"], exc)
                self._delete_rows(gone, now)
            deleted += [r["id"] for r in gone]
            if kept is not None:  # (the next batch would meet it again: the sweep ends here)
                log.warning("expired job %s kept: its files could not be removed (%s)", *kept)
                return deleted
            if len(rows) < batch:
                return deleted

    def delete_videoless(self, now: float) -> set[str]:
        """At a start: the completed jobs whose video is not in the videos folder deleted (a DELETE whose row
        the full disk refused, or a video removed by hand to free it), each as a DELETE would (its list
        anchor kept); their ids. None when no completed job has its video there (a videos folder on a mount
        that failed would have deleted every job): they stay, said in the log. A deletion the database refuses
        is kept in memory as `delete` keeps one."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, created_at, seq FROM jobs WHERE status='completed'"
            ).fetchall()
            present = {path.name for path in self.videos_dir.iterdir()}
            videoless = [r for r in rows if self.video_path(r["id"]).name not in present]
            if not videoless:
                return set()
            if len(videoless) == len(rows):  # none there: a folder not mounted (or emptied) is no DELETE
                log.warning("none of the %d completed job(s) has its video in %s (a folder not mounted?): they "
                            "are left as they are (their content answers 404)", len(rows), self.videos_dir)  # fmt: skip
                return set()
            try:
                self._delete_rows(videoless, now)
            except sqlite3.OperationalError as exc:
                log.warning("the deletion of %d job(s) without their video is kept in memory until the "
                            "database takes it (%s)", len(videoless), exc)  # fmt: skip
                for r in videoless:
                    self._unsaved_deletions.add(r, now)
        named = ", ".join(r["id"] for r in videoless[:SHOWN_IDS]) + (
            ", ..." if len(videoless) > SHOWN_IDS else ""
        )
        log.warning("%d completed job(s) had no video in %s (deleted while the disk was full, or removed by "
                    "hand): deleted (%s)", len(videoless), self.videos_dir, named)  # fmt: skip
        return {r["id"] for r in videoless}

    def _write_unsaved(self) -> None:
        """Under `_lock`: the failures (JobDatabase) and the deletions still unsaved, written if the disk
        takes them now (else kept)."""
        super()._write_unsaved()
        if self._unsaved_deletions:
            rows, deleted_at = self._unsaved_deletions.rows()
            with contextlib.suppress(sqlite3.OperationalError):
                self._delete_rows(rows, deleted_at)

    def _delete_rows(self, rows: Sequence[sqlite3.Row], now: float) -> None:
        """Under `_lock`, their files gone: the jobs' rows deleted and their list anchors stored, in one
        transaction. When the disk refuses it (full), the rows alone, as before the anchors were stored (their
        anchors then in memory only: a restart forgets them); a refusal of that raises, as it did."""
        ids = [(r["id"],) for r in rows]
        try:
            with self._transaction():
                self._db.executemany("DELETE FROM jobs WHERE id=?", ids)
                self._anchors.write(self._db, rows, now)
        except sqlite3.OperationalError as exc:
            with self._transaction():
                self._db.executemany("DELETE FROM jobs WHERE id=?", ids)
            if rows:
                log.warning("list anchors not saved, kept in memory only: %d job(s) (%s)", len(rows), exc)
        # (a failure or a deletion still kept for a deleted job is moot)
        for r in rows:
            self._unsaved.discard(r["id"])
            self._unsaved_deletions.discard(r["id"])
            self._anchors.remember(r["id"], r["created_at"], r["seq"])

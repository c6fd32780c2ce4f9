"""A storage folder whose disk refuses writes while the server runs (full): the jobs that meet it fail with
a reason naming storage (507), creates are refused (507), the engine and /health go on, nothing half-written
is left or served, and once space is back the server works again and writes the failures it kept.

The fault is injected where the disk answers: SQLite's writes raise what SQLite raises on a full disk
(OperationalError SQLITE_FULL, also at COMMIT, where it may leave the transaction open) and file writes fail
at their fsync with ENOSPC (measured on a full tmpfs: the same errors, the same places)."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import time

import pytest
from serving_helpers import SMALL_FORM, asgi_server, job_params, job_spec, poll_job, stored_job, wait_until

from worldserve.engine import job_database, job_files
from worldserve.engine.client import Job, JobStatus, StorageError
from worldserve.engine.fake_backend import FakeBackend
from worldserve.engine.job_schema import new_job_id
from worldserve.engine.jobs import JobStore

pytestmark = pytest.mark.anyio


class FullDisk:
    """Stands between the store and its disk: while `db_full`, SQLite writes fail as on a full disk; while
    `files_full`, file writes fail at their fsync (ENOSPC). `at_open`: full before the store opens."""

    WRITES = ("INSERT", "UPDATE", "DELETE", "COMMIT")

    def __init__(self, store: JobStore | None, monkeypatch):
        self.db_full = self.files_full = False
        if store is not None:
            self._db, store._db = store._db, self
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if self.files_full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real_fsync(fd)

        monkeypatch.setattr(job_files.os, "fsync", fsync)

    @classmethod
    def at_open(cls, monkeypatch) -> FullDisk:
        """A database disk full before the next store opens: the connection it prepares (its pragmas, its
        schema) is this stub's, the store's from then on."""
        disk = cls(None, monkeypatch)
        disk.db_full = True
        real_prepared = job_database.prepared

        def prepared(db: sqlite3.Connection):
            disk._db = db
            return real_prepared(disk)

        monkeypatch.setattr(job_database, "prepared", prepared)
        return disk

    def __setattr__(self, name, value) -> None:
        if name == "row_factory":  # (set by prepared(): the connection's)
            setattr(self._db, name, value)
        else:
            object.__setattr__(self, name, value)

    @property
    def full(self) -> bool:
        return self.db_full and self.files_full

    @full.setter
    def full(self, value: bool) -> None:
        self.db_full = self.files_full = value

    def _check(self, sql: str) -> None:
        if self.db_full and self._refused(sql.split()[0].upper()):
            exc = sqlite3.OperationalError("database or disk is full")
            exc.sqlite_errorcode, exc.sqlite_errorname = sqlite3.SQLITE_FULL, "SQLITE_FULL"
            raise exc

    def _refused(self, verb: str) -> bool:
        return verb in self.WRITES

    def execute(self, sql, *args):
        self._check(sql)
        return self._db.execute(sql, *args)

    def executemany(self, sql, *args):
        self._check(sql)
        return self._db.executemany(sql, *args)

    def __getattr__(self, name):
        return getattr(self._db, name)


class FullAtCommit(FullDisk):
    """As SQLite meets a full disk when its page cache holds a transaction's changes: a statement in a
    transaction goes through, its COMMIT fails (a statement outside one fails, being its own commit)."""

    def _refused(self, verb: str) -> bool:
        return verb == "COMMIT" or (verb in self.WRITES and not self._db.in_transaction)


def test_a_kept_failure_outlives_a_refused_commit(tmp_path, monkeypatch):
    """A write whose COMMIT the full disk refuses rolls the kept failures back with it: they stay kept (the
    job stays failed, not back to in_progress for good) and are written once space is back."""
    store = JobStore(tmp_path)
    disk = FullAtCommit(store, monkeypatch)
    job = stored_job(store)
    disk.db_full = True
    assert store.fail(job.id, 507, "Video generation failed: disk full", completed_at=time.time(), ttl_s=None)
    store.set_progress([(job.id, 5)])  # refused at its COMMIT, with the kept failure in its transaction
    assert store.get(job.id).status is JobStatus.FAILED
    disk.db_full = False
    store.set_progress([(job.id, 6)])
    assert store._db.execute("SELECT status FROM jobs WHERE id=?", (job.id,)).fetchone()[0] == "failed"
    store.close()


def test_a_kept_failure_is_written_at_close(tmp_path, monkeypatch):
    """Space back but no write since: close() writes the kept failures, so the restart does not run again a
    job whose client was told it failed."""
    store = JobStore(tmp_path)
    disk = FullDisk(store, monkeypatch)
    job = stored_job(store)
    disk.db_full = True
    assert store.fail(job.id, 400, "too long", completed_at=time.time(), ttl_s=None, param="prompt")
    assert store.get(job.id).error_param == "prompt"  # shown from memory
    disk.db_full = False
    store.close()
    store = JobStore(tmp_path)
    assert store.recover() == []
    got = store.get(job.id)
    assert got.status is JobStatus.FAILED and (got.error_code, got.error_param) == (400, "prompt")
    store.close()


def test_refused_progress_writes_are_logged_once(tmp_path, monkeypatch, caplog):
    """Progress is written every step: a full disk logs it once (and once more when writes go through)."""
    store = JobStore(tmp_path)
    disk = FullDisk(store, monkeypatch)
    job = stored_job(store)
    disk.db_full = True
    with caplog.at_level(logging.INFO, logger="worldserve.engine.jobs"):
        for step in range(5):
            store.set_progress([(job.id, step)])
        disk.db_full = False
        store.set_progress([(job.id, 6)])
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert store.get(job.id).progress == 6
    store.close()


def test_a_refused_create_leaves_no_reference_file(tmp_path, monkeypatch):
    store = JobStore(tmp_path)
    disk = FullDisk(store, monkeypatch)
    p = job_params()
    job = Job(id=new_job_id(), status=JobStatus.QUEUED, progress=0, created_at=time.time(), spec=job_spec(p))
    disk.db_full = True  # the reference file is written, the row is refused
    with pytest.raises(StorageError, match="could not save the job: database or disk is full") as info:
        store.create(job, {"params": {}}, b"reference bytes")
    assert info.value.status_code == 507
    assert not list(store.inputs_dir.iterdir()), "no reference file without its row"
    disk.full = False
    store.create(job, {"params": {}}, b"reference bytes")  # the transaction was not left open
    assert store.get(job.id).status is JobStatus.QUEUED and store.reference_path(job.id).exists()
    store.close()


async def test_a_full_disk_fails_the_jobs_and_the_server_goes_on(tmp_path, monkeypatch):
    """A job running when the disk fills and one queued behind it fail with a reason (their failures kept
    in memory: SQLite cannot record them), the engine stays alive, creates get a 507; with space back a
    job completes and the kept failures are in the database."""
    async with asgi_server(tmp_path, backend=FakeBackend(step_delay=0.02)) as http:
        store = http.engine_client.store
        disk = FullDisk(store, monkeypatch)
        form = {"prompt": "x", **SMALL_FORM, "num_inference_steps": "20"}
        running = (await http.post("/v1/videos", data=form)).json()["id"]
        queued = (await http.post("/v1/videos", data=form)).json()["id"]
        wait_until(lambda: store.get(running).progress > 0)
        disk.full = True
        for job_id in (running, queued):
            done = await poll_job(http, job_id)
            assert done["status"] == "failed" and done["error"]["code"] == 507, done
            assert "storage could not save" in done["error"]["message"], done
        assert not list(store.videos_dir.iterdir()), "nothing half-written"
        assert (await http.get("/health")).status_code == 200
        metrics = (await http.get("/metrics")).text  # both counted, the one failed at its admission too
        assert 'worldserve:request_failure_total{model_name="test-model",status="507"} 2.0' in metrics
        r = await http.post("/v1/videos", data=form)
        assert r.status_code == 507, r.text
        metrics = (await http.get("/metrics")).text  # the refused create counted, as a full queue's is
        assert 'worldserve:request_rejected_total{model_name="test-model",reason="storage"} 1.0' in metrics
        assert (
            r.json()["error"]["message"]
            == "The server's storage could not save the job: database or disk is full."
        )
        disk.full = False
        r = await http.post("/v1/videos/sync", data={"prompt": "x", **SMALL_FORM})
        assert r.status_code == 200, r.text
        raw = sqlite3.connect(tmp_path / "jobs.sqlite3")
        rows = dict(
            raw.execute("SELECT id, status FROM jobs WHERE id IN (?, ?)", (running, queued)).fetchall()
        )
        raw.close()
        assert rows == {running: "failed", queued: "failed"}, "the kept failures were written"


async def test_a_storage_folder_removed_under_the_server_takes_no_more_jobs(tmp_path):
    """`rm -rf` of the storage folder while serving: SQLite would go on writing to the removed database, and
    every job accepted then would be gone at the restart. Creates are refused (503 naming the storage) and
    /health says why; a removed videos/ folder alone is made again (the job completes)."""
    import shutil

    root = tmp_path / "store"
    async with asgi_server(root, backend=FakeBackend()) as http:
        shutil.rmtree(root / "videos")
        r = await http.post("/v1/videos/sync", data={"prompt": "x", **SMALL_FORM})
        assert r.status_code == 200 and r.content, r.text
        assert (await http.get("/health")).status_code == 200
        shutil.rmtree(root)
        r = await http.post("/v1/videos", data={"prompt": "x", **SMALL_FORM})
        assert r.status_code == 503, r.text
        assert "cannot keep new jobs" in r.json()["error"]["message"] and "job database" in r.text
        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["reason"].startswith("storage: its job database")
        # (/health is open to every client: the reason names the file, not where the server keeps it)
        assert str(tmp_path) not in r.text and str(tmp_path) not in health.text
        assert (await http.get("/v1/videos")).json()["data"], (
            "what it holds is still listed until the restart"
        )


def test_a_damaged_database_is_refused_when_the_store_opens(tmp_path):
    """A page of the job table overwritten (a torn disk write): one StorageError as the store opens, before a
    server loads its model (it had been a traceback from the restart's recovery, after the load)."""
    store = JobStore(tmp_path)
    for _ in range(40):  # the table over several pages
        p = job_params()
        store.create(Job(id=new_job_id(), status=JobStatus.QUEUED, progress=0, created_at=time.time(),
                         spec=job_spec(p)), {"params": {"prompt": "x" * 500}}, None)  # fmt: skip
    store.close()
    path = tmp_path / "jobs.sqlite3"
    data = bytearray(path.read_bytes())
    page = 4096
    data[2 * page + 8 : 3 * page] = bytes(range(256)) * ((page - 8) // 256) + bytes((page - 8) % 256)
    path.write_bytes(bytes(data))
    with pytest.raises(StorageError, match="damaged"):
        JobStore(tmp_path)


class FullOfVideos(FullDisk):
    """A disk filled by the store's own videos: SQLite's writes are refused until one of them is removed."""

    def fill(self, videos_dir) -> None:
        self.videos_dir, self.db_full, self.videos = videos_dir, True, len(list(videos_dir.iterdir()))

    def _refused(self, verb: str) -> bool:
        return verb in self.WRITES and len(list(self.videos_dir.iterdir())) >= self.videos


def _completed_job(store: JobStore, ttl_s: float | None = None) -> Job:
    job = stored_job(store)
    assert store.complete(job.id, b"mp4", completed_at=time.time(), ttl_s=ttl_s, inference_time_s=1.0,
                          stage_durations={}, peak_memory_mb=1.0)  # fmt: skip
    return job


def test_a_disk_full_of_videos_is_freed_by_delete_and_by_the_sweep(tmp_path, monkeypatch):
    """The row's deletion needs disk space that only the job's files can free: they go first (the row went
    first, its write was refused, and a full disk could not be emptied through the API)."""
    store = JobStore(tmp_path)
    jobs = [_completed_job(store), _completed_job(store, ttl_s=0.01), _completed_job(store, ttl_s=0.01)]
    FullOfVideos(store, monkeypatch).fill(store.videos_dir)
    with pytest.raises(StorageError):  # (the disk is full: a create is refused)
        stored_job(store)
    assert store.delete(jobs[0].id).id == jobs[0].id  # its file freed the space its row's deletion needed
    assert store.get(jobs[0].id) is None
    assert sorted(store.delete_expired(time.time() + 1)) == sorted(j.id for j in jobs[1:])
    assert not list(store.videos_dir.iterdir()) and store.list()[0] == []
    store.close()


def test_a_file_that_cannot_be_removed_keeps_its_job(tmp_path, monkeypatch, caplog):
    """A videos folder made read-only: DELETE is a StorageError and the job stays as it was (the row went,
    the file stayed, and the answer was a 500); the sweep keeps that job and deletes the others; a restart
    leaves a stray file it cannot remove (it died on it)."""
    store = JobStore(tmp_path)
    # (a TTL the test outlives: a job past its expiry is hidden from get before the sweep; the sweep is told
    # a time past it)
    stuck, other = _completed_job(store, ttl_s=60), _completed_job(store, ttl_s=60)
    real_unlink = type(store.video_path(stuck.id)).unlink

    def unlink(path, missing_ok=False):
        if path.name == f"{stuck.id}.mp4":
            raise PermissionError(13, "Permission denied")
        return real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(type(store.video_path(stuck.id)), "unlink", unlink)
    with pytest.raises(StorageError, match="Permission denied"):
        store.delete(stuck.id)
    assert store.get(stuck.id).status is JobStatus.COMPLETED and store.video_path(stuck.id).exists()
    with caplog.at_level(logging.WARNING, logger="worldserve.engine.jobs"):
        assert store.delete_expired(time.time() + 61) == [other.id]
    assert f"expired job {stuck.id} kept" in caplog.text
    assert store.get(stuck.id) is not None and not store.video_path(other.id).exists()
    store._db.execute("DELETE FROM jobs WHERE id=?", (stuck.id,))  # its file now a stray of no job
    store.close()
    store = JobStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="worldserve.engine.job_files"):
        assert store.recover() == []
    assert "could not remove the stray file" in caplog.text and store.video_path(stuck.id).exists()
    store.close()


def test_a_restart_on_a_full_disk_starts_with_its_jobs_as_they_were(tmp_path, monkeypatch, caplog):
    """recover() writes (unfinished jobs queued again): on a full disk the server died at start on SQLite's
    error; it now starts, serves what is stored, and queues them at a restart with space. The disk is full
    as the store opens: opening a database at the current schema writes nothing (it wrote its version at
    every open, a COMMIT the full disk refused before recover() ran)."""
    store = JobStore(tmp_path)
    done, running = _completed_job(store), stored_job(store)
    store.close()
    disk = FullDisk.at_open(monkeypatch)
    store = JobStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="worldserve.engine.jobs"):
        assert store.recover() == []
    assert "cannot record this restart" in caplog.text
    assert store.get(running.id).status is JobStatus.IN_PROGRESS and store.video_path(done.id).exists()
    disk.db_full = False
    assert store.recover() == [running.id] and store.get(running.id).status is JobStatus.QUEUED
    store.close()


def _unwritable(folder, monkeypatch) -> None:
    """`folder` made read-only (0500), as an operator's chmod; as root (who may write there all the same) the
    access checks are answered as they are for any other user."""
    folder.chmod(0o500)
    if os.geteuid() == 0:
        real_access = os.access

        def access(path, mode, **kw):
            if os.path.samefile(path, folder) and mode & os.W_OK:
                return bool(os.stat(path).st_mode & 0o200)
            return real_access(path, mode, **kw)

        monkeypatch.setattr(job_files.os, "access", access)


async def test_a_videos_folder_made_unwritable_fails_queued_jobs_before_they_run(tmp_path, monkeypatch):
    """videos/ chmod'ed read-only under a running server: every job would run to its end and fail saving its
    video. A queued job fails at its admission (503, naming the folder, no step run), creates are refused
    (the sync route's too: its video is saved as a job's) and /health says why (its reason names no path);
    with the folder writable again a job completes."""
    import threading

    gate = threading.Event()
    backend = FakeBackend(step_gate=gate)
    root = tmp_path / "store"
    async with asgi_server(root, backend=backend) as http:
        form = {"prompt": "x", **SMALL_FORM, "num_inference_steps": "2"}
        running = (await http.post("/v1/videos", data=form)).json()["id"]
        queued = (await http.post("/v1/videos", data=form)).json()["id"]
        wait_until(lambda: http.engine_client.store.get(running).status == JobStatus.IN_PROGRESS)
        _unwritable(root / "videos", monkeypatch)
        try:
            gate.set()
            done = await poll_job(http, queued)
            assert done["status"] == "failed" and done["error"]["code"] == 503, done
            assert done["error"]["message"].endswith(
                "cannot keep the job's video: its videos folder is not writable by the server"
            ), done
            assert backend.steps_done <= 2, "the queued job ran no step"
            r = await http.post("/v1/videos", data=form)
            assert r.status_code == 503 and "videos folder is not writable" in r.json()["error"]["message"]
            health = await http.get("/health")
            assert health.status_code == 503, health.text
            assert health.json()["reason"] == "storage: its videos folder is not writable by the server"
            assert str(tmp_path) not in health.text and str(tmp_path) not in r.text
            r = await http.post("/v1/videos/sync", data=form)  # (its video is a stored job's too)
            assert r.status_code == 503 and "videos folder is not writable" in r.text, r.text
        finally:
            (root / "videos").chmod(0o700)
        assert (await http.get("/health")).status_code == 200
        job = (await http.post("/v1/videos", data=form)).json()["id"]
        assert (await poll_job(http, job))["status"] == "completed"


def test_a_store_whose_videos_folder_is_not_writable_is_refused_when_it_opens(tmp_path, monkeypatch):
    """Kept from an earlier run and chmod'ed since: one StorageError naming the folder as the store opens (a
    server found it when its first job's video failed to save)."""
    JobStore(tmp_path).close()
    _unwritable(tmp_path / "videos", monkeypatch)
    try:
        with pytest.raises(
            StorageError, match=r"cannot use .* as the storage directory: .*videos is not writable"
        ):
            JobStore(tmp_path)
    finally:
        (tmp_path / "videos").chmod(0o700)


def test_a_videos_folder_without_read_permission_is_found_unwritable(tmp_path, monkeypatch):
    """write_atomic opens the folder (O_RDONLY) to fsync it after the rename: a folder with write and search
    but no read permission (0300) failed every video's save after its job had run, unnoticed by the check.
    (Owner bits answered as for a user who is not root.)"""
    videos = tmp_path / "videos"
    videos.mkdir()
    monkeypatch.setattr(
        job_files.os, "access", lambda path, mode, **kw: (os.stat(path).st_mode >> 6) & mode == mode
    )
    for mode, unwritable in ((0o700, False), (0o300, True), (0o500, True), (0o600, True)):
        videos.chmod(mode)
        assert (job_files.folder_unwritable(videos) is not None) is unwritable, oct(mode)
    videos.chmod(0o700)
    videos.rmdir()  # (made again by write_atomic: its parent's write and search permission is what counts)
    assert job_files.folder_unwritable(videos) is None


def test_a_job_deleted_while_queued_is_gone_not_failed_when_the_videos_folder_is_unwritable(
    tmp_path, monkeypatch
):
    """mark_in_progress keeps its False for a job no longer queued (the engine ends it as cancelled) with the
    videos folder unwritable; a queued one is refused (StorageError)."""
    store = JobStore(tmp_path)
    gone, queued = (
        Job(
            id=new_job_id(),
            status=JobStatus.QUEUED,
            progress=0,
            created_at=time.time(),
            spec=job_spec(job_params()),
        )
        for _ in range(2)
    )
    for job in (gone, queued):
        store.create(job, {"params": {}}, None)
    store.delete(gone.id)
    _unwritable(tmp_path / "videos", monkeypatch)
    try:
        assert store.mark_in_progress(gone.id, time.time()) is False
        with pytest.raises(StorageError, match="videos folder is not writable"):
            store.mark_in_progress(queued.id, time.time())
    finally:
        (tmp_path / "videos").chmod(0o700)
        store.close()


def test_a_kept_failure_is_written_by_the_delete_that_frees_the_disk(tmp_path, monkeypatch):
    """A job failed on a disk full of videos (its failure kept in memory), then DELETE of a finished job frees
    the space: that delete writes the kept failure too (it tried before its files were gone, while the disk
    was still full), so a crash right after does not run again a job whose client was told it failed."""
    store = JobStore(tmp_path)
    done, running = _completed_job(store), stored_job(store)
    FullOfVideos(store, monkeypatch).fill(store.videos_dir)
    assert store.fail(
        running.id, 507, "Video generation failed: disk full", completed_at=time.time(), ttl_s=None
    )
    assert store.delete(done.id) is not None  # the disk has space again
    row = store._db.execute("SELECT status FROM jobs WHERE id=?", (running.id,)).fetchone()
    assert row["status"] == "failed"  # on disk now, not only in memory
    store.close()

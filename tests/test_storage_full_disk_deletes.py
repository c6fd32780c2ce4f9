"""A storage disk that is full when the server starts or when a client deletes: the start's error says the disk
is full and what to free (not "disk I/O error"); a DELETE answers as the store then reads, across a restart
too (job_deletion.py): a completed job's deletion whose row the full disk refuses is kept in memory (the
video is gone: GET 404), written once the disk takes writes, and a restart deletes a completed job whose
video is missing; any other job is deleted row first, nothing of it removed when its row is refused.

The faults are test_storage_faults.py's `FullDisk` stubs (SQLite's errors where a full tmpfs raised them)."""

from __future__ import annotations

import shutil
import sqlite3
import time

import pytest
from serving_helpers import SMALL_FORM, asgi_server, job_params, job_spec, poll_job, stored_job
from test_storage_faults import FullDisk, _completed_job

from worldserve.engine.client import Job, JobStatus, StorageError
from worldserve.engine.fake_backend import FakeBackend
from worldserve.engine.job_schema import new_job_id
from worldserve.engine.jobs import JobStore

pytestmark = pytest.mark.anyio


class NoRoomForTheShm(FullDisk):
    """A disk with 0 bytes free as WAL mode opens: SQLite cannot size its -shm file (measured on a full tmpfs:
    SQLITE_IOERR_SHMSIZE, "disk I/O error", at the first `PRAGMA journal_mode=WAL`)."""

    def _check(self, sql: str) -> None:
        if self.db_full and sql.startswith("PRAGMA journal_mode"):
            exc = sqlite3.OperationalError("disk I/O error")
            exc.sqlite_errorcode, exc.sqlite_errorname = sqlite3.SQLITE_IOERR_SHMSIZE, "SQLITE_IOERR_SHMSIZE"
            raise exc
        super()._check(sql)


def _free_bytes(monkeypatch, free: int) -> None:
    real = shutil.disk_usage

    def disk_usage(path):
        usage = real(path)
        return type(usage)(usage.total, usage.total - free, free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_a_start_on_a_disk_without_room_for_the_database_says_the_disk_is_full(tmp_path, monkeypatch):
    """0 bytes free: the start's one line names the full disk, the storage folder and what to free (it was
    "cannot use the job database ...: disk I/O error"); an I/O error with room on the disk stays one."""
    JobStore(tmp_path).close()
    NoRoomForTheShm.at_open(monkeypatch)
    _free_bytes(monkeypatch, 0)
    with pytest.raises(StorageError) as info:
        JobStore(tmp_path)
    message = str(info.value)
    assert message.startswith(f"cannot use the job database {tmp_path / 'jobs.sqlite3'}: the disk of the "
                              f"storage folder {tmp_path} is full (0 bytes free; SQLite: disk I/O error)")  # fmt: skip
    assert (
        f"free at least 1 MiB on it and start again, e.g. by removing old videos from {tmp_path / 'videos'}"
        in message
    )
    _free_bytes(monkeypatch, 10 << 30)
    with pytest.raises(StorageError) as info:
        JobStore(tmp_path)
    assert str(info.value).endswith(": disk I/O error") and "full" not in str(info.value)
    monkeypatch.undo()
    JobStore(tmp_path).close()  # (the lock was released each time)


def test_a_migration_a_full_disk_refuses_says_the_disk_is_full(tmp_path, monkeypatch):
    """A v2 database (no `error_param`) opened on a full disk: its migration must write, and cannot; the error
    says so (SQLITE_FULL, whatever the free bytes say) and the database is left as it was."""
    JobStore(tmp_path).close()
    db = sqlite3.connect(tmp_path / "jobs.sqlite3")
    db.execute("ALTER TABLE jobs DROP COLUMN error_param")
    db.execute("PRAGMA user_version=2")
    db.commit()
    db.close()
    FullDisk.at_open(monkeypatch)
    with pytest.raises(
        StorageError, match=r"storage folder .* is full \(\d+ bytes free; SQLite: database or disk is full\)"
    ):
        JobStore(tmp_path)
    monkeypatch.undo()
    store = JobStore(tmp_path)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == 3
    store.close()


async def test_a_delete_on_a_full_disk_answers_as_the_store_then_reads(tmp_path, monkeypatch):
    """DELETE of a completed job on a disk whose database takes no write: 200 and the job is gone (GET, its
    content and a second DELETE 404, not listed); it answered 507 with the video removed, the job still
    `completed` and its content a 404. The row goes at the next write that succeeds (its list anchor too)."""
    async with asgi_server(tmp_path, backend=FakeBackend()) as http:
        store = http.engine_client.store
        job_id = (await http.post("/v1/videos", data={"prompt": "x", **SMALL_FORM})).json()["id"]
        assert (await poll_job(http, job_id))["status"] == "completed"
        other = (await http.post("/v1/videos", data={"prompt": "y", **SMALL_FORM})).json()["id"]
        assert (await poll_job(http, other))["status"] == "completed"
        disk = FullDisk(store, monkeypatch)
        disk.db_full = True
        r = await http.delete(f"/v1/videos/{job_id}")
        assert r.status_code == 200 and r.json()["deleted"] is True, r.text
        for path in (f"/v1/videos/{job_id}", f"/v1/videos/{job_id}/content"):
            assert (await http.get(path)).status_code == 404, path
        assert (await http.delete(f"/v1/videos/{job_id}")).status_code == 404
        assert [j["id"] for j in (await http.get("/v1/videos")).json()["data"]] == [other]
        assert not store.video_path(job_id).exists() and store.video_path(other).exists()
        disk.db_full = False
        r = await http.post("/v1/videos", data={"prompt": "z", **SMALL_FORM})
        assert r.status_code == 200, r.text
        raw = sqlite3.connect(tmp_path / "jobs.sqlite3")
        assert raw.execute("SELECT COUNT(*) FROM jobs WHERE id=?", (job_id,)).fetchone()[0] == 0
        assert raw.execute("SELECT COUNT(*) FROM list_anchors WHERE id=?", (job_id,)).fetchone()[0] == 1
        raw.close()


def test_a_deletion_still_unsaved_at_the_stop_is_done_at_the_restart(tmp_path, monkeypatch, caplog):
    """The disk still full when the server stops: the row is still there, the video gone. The restart deletes
    the job (it came back `completed` with its content a 404), its anchor kept for a listing paging after it;
    on a disk still full that deletion is kept in memory as the DELETE's was."""
    store = JobStore(tmp_path)
    deleted, kept = _completed_job(store), _completed_job(store)
    disk = FullDisk(store, monkeypatch)
    disk.db_full = True
    assert store.delete(deleted.id).id == deleted.id
    store.close()  # (the deletion refused once more)
    raw = sqlite3.connect(tmp_path / "jobs.sqlite3")
    assert raw.execute("SELECT status FROM jobs WHERE id=?", (deleted.id,)).fetchone() == ("completed",)
    raw.close()
    FullDisk.at_open(monkeypatch)
    store = JobStore(tmp_path)
    assert store.recover() == []
    assert store.get(deleted.id) is None and store.delete(deleted.id) is None
    assert [j.id for j in store.list()[0]] == [kept.id]
    store.close()
    monkeypatch.undo()
    store = JobStore(tmp_path)
    assert store.recover() == []
    assert store.get(deleted.id) is None and store.get(kept.id).status is JobStatus.COMPLETED
    assert store._db.execute("SELECT COUNT(*) FROM jobs WHERE id=?", (deleted.id,)).fetchone()[0] == 0
    assert [j.id for j in store.list(order="asc", after=deleted.id)[0]] == [kept.id]
    store.close()


def test_a_video_removed_by_hand_while_stopped_deletes_its_job_at_the_start(tmp_path, caplog):
    """An operator freeing a full disk by removing old videos (as the start's error tells): their jobs are
    deleted as the server starts, not served as `completed` without their file."""
    store = JobStore(tmp_path)
    removed, kept = _completed_job(store), _completed_job(store)
    store.close()
    (tmp_path / "videos" / f"{removed.id}.mp4").unlink()
    store = JobStore(tmp_path)
    with caplog.at_level("WARNING", logger="worldserve.engine.jobs"):
        store.recover()
    assert (
        f"1 completed job(s) had no video in {tmp_path / 'videos'}" in caplog.text
        and removed.id in caplog.text
    )
    assert store.get(removed.id) is None and [j.id for j in store.list()[0]] == [kept.id]
    store.close()
    # no completed job's video there at all (a videos folder on a mount that failed): nothing is deleted
    (tmp_path / "videos" / f"{kept.id}.mp4").unlink()
    store = JobStore(tmp_path)
    with caplog.at_level("WARNING", logger="worldserve.engine.jobs"):
        store.recover()
    assert "none of the 1 completed job(s) has its video" in caplog.text and store.get(kept.id) is not None
    store.close()


def test_an_unfinished_job_is_deleted_row_first_on_a_full_disk(tmp_path, monkeypatch):
    """A queued job with a reference: its row's deletion refused (507), the job and its reference stay as they
    were (its reference was removed first, and the restart failed the job "its reference is missing" while
    its client had been told of no deletion); with space back the deletion removes both."""
    store = JobStore(tmp_path)
    job = Job(id=new_job_id(), status=JobStatus.QUEUED, progress=0, created_at=time.time(),
              spec=job_spec(job_params()))  # fmt: skip
    store.create(job, {"params": {}}, b"reference bytes")
    running = stored_job(store)
    disk = FullDisk(store, monkeypatch)
    disk.db_full = True
    for job_id in (job.id, running.id):
        with pytest.raises(StorageError, match="could not save the deletion") as info:
            store.delete(job_id)
        assert info.value.status_code == 507 and store.get(job_id) is not None
    assert store.reference_path(job.id).read_bytes() == b"reference bytes"
    disk.db_full = False
    assert store.delete(job.id).id == job.id
    assert store.get(job.id) is None and not store.reference_path(job.id).exists()
    store.close()

"""A storage disk that turns read-only under the running server (a remount after I/O errors, an operator's
`mount -o remount,ro`): the jobs that meet it fail with 503 naming storage, never a path, each counted and
its waiter answered at once; the engine goes on and serves again once the disk is writable. A file the store
no longer needs but cannot remove (a reference, a video no row names) is logged and left for the start-up
sweep: the read-only disk refuses unlinks too (EROFS even for a missing file), which had raised out of
JobStore.fail into the engine loop (it crashed for good) and the encode pool (the sync waiter hung).

The fault is injected where the disk answers, as a tmpfs remounted read-only under a running server answers
(measured): creating a file (os.open with O_CREAT) and removing one (os.unlink) raise EROFS naming the path,
os.access says no write permission, and SQLite's writes through the database it holds open go on."""

from __future__ import annotations

import errno
import logging
import os
import time

import pytest
from serving_helpers import (
    SMALL_FORM,
    asgi_server,
    png_bytes,
    poll_job,
    stored_job,
    wait_until,
)  # fmt: skip
from test_storage_faults import FullDisk

from worldserve.engine.client import Job, JobStatus, StorageError
from worldserve.engine.fake_backend import FakeBackend
from worldserve.engine.job_schema import new_job_id
from worldserve.engine.jobs import JobStore

REFERENCE = b"reference bytes"


class ReadOnlyDisk:
    """While `on`, the files under `root` are on a read-only disk (module docstring)."""

    def __init__(self, root, monkeypatch):
        self.root = os.path.realpath(root)
        self.on = False
        real_open, real_unlink, real_access = os.open, os.unlink, os.access

        def refused(path) -> bool:
            return self.on and os.path.realpath(os.fspath(path)).startswith(self.root)

        def open_(path, flags, mode=0o777, *, dir_fd=None):
            if flags & os.O_CREAT and refused(path):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
            return real_open(path, flags, mode, dir_fd=dir_fd)

        def unlink(path, *, dir_fd=None):
            if refused(path):  # (before the name is looked up: a missing file too)
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
            return real_unlink(path, dir_fd=dir_fd)

        def access(path, mode, **kw):
            return False if mode & os.W_OK and refused(path) else real_access(path, mode, **kw)

        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "unlink", unlink)
        monkeypatch.setattr(os, "access", access)


def _complete(store: JobStore, job_id: str) -> bool:
    return store.complete(job_id, b"mp4", completed_at=time.time(), ttl_s=None, inference_time_s=1.0,
                          stage_durations={}, peak_memory_mb=1.0)  # fmt: skip


def test_the_store_ends_jobs_on_a_read_only_disk_and_leaves_their_files(tmp_path, monkeypatch, caplog):
    """complete raises the StorageError a client is told (503, no path); fail fails the job (it raised
    EROFS from removing the reference after writing the row, even for a job without one: the unlink of a
    missing file is refused too; such a job logs nothing) and leaves the reference, removed by the
    next start's sweep; a refused create raises its StorageError, not the EROFS of its clean-up."""
    store = JobStore(tmp_path)
    disk = ReadOnlyDisk(tmp_path, monkeypatch)
    job, bare = stored_job(store, REFERENCE), stored_job(store)
    disk.on = True
    with caplog.at_level(logging.WARNING, logger="worldserve.engine.jobs"):  # (no reference: nothing to say)
        assert store.fail(
            bare.id, 503, "Video generation failed: read-only", completed_at=time.time(), ttl_s=None
        )
    assert store.get(bare.id).status is JobStatus.FAILED and not caplog.records
    with pytest.raises(StorageError) as info:
        _complete(store, job.id)
    assert info.value.status_code == 503 and str(info.value).endswith(
        "could not save the video: Read-only file system"
    )
    with caplog.at_level(logging.WARNING, logger="worldserve.engine.jobs"):
        assert store.fail(
            job.id, 503, "Video generation failed: read-only", completed_at=time.time(), ttl_s=None
        )
    assert store.get(job.id).status is JobStatus.FAILED
    assert store.reference_path(job.id).exists() and "left for the next start's sweep" in caplog.text
    disk.on = False
    inputs = ReadOnlyDisk(store.inputs_dir, monkeypatch)  # (the videos folder writable: the create goes on)
    inputs.on = True
    queued = Job(id=new_job_id(), status=JobStatus.QUEUED, progress=0, created_at=time.time(), spec=job.spec)
    with pytest.raises(StorageError, match="could not save the job's reference file: Read-only file system"):
        store.create(queued, {"params": {}}, REFERENCE)
    inputs.on = False
    store.close()
    store = JobStore(tmp_path)
    assert store.recover() == [] and not list(store.inputs_dir.iterdir())
    store.close()


def test_a_video_whose_row_is_refused_and_that_cannot_be_removed_is_left(tmp_path, monkeypatch):
    """The video saved, its row refused (a full database), its removal refused too: complete raises the row's
    StorageError (507), not the EROFS of the removal; the file no completed row names goes at the next start."""
    store = JobStore(tmp_path)
    job = stored_job(store)
    full, read_only = FullDisk(store, monkeypatch), ReadOnlyDisk(tmp_path / "videos", monkeypatch)
    full.db_full = True

    def refuse_removals(*args, **kwargs):  # (the video is written first: only its removal is refused)
        read_only.on = True
        return real_fsync(*args, **kwargs)

    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", refuse_removals)
    with pytest.raises(StorageError) as info:
        _complete(store, job.id)
    assert info.value.status_code == 507 and store.video_path(job.id).exists()
    monkeypatch.setattr(os, "fsync", real_fsync)
    full.db_full = read_only.on = False
    store.close()
    store = JobStore(tmp_path)
    assert store.recover() == [job.id] and not store.video_path(job.id).exists()
    store.close()


def test_a_failure_kept_in_memory_keeps_the_reference_the_restart_runs_the_job_with(tmp_path, monkeypatch):
    """A failure the full database refused is kept in memory; if the process stops before writing it, the
    restart runs the job again, so its reference stays (it was removed: the re-run failed, "its uploaded
    reference is missing")."""
    store = JobStore(tmp_path)
    job = stored_job(store, REFERENCE)
    disk = FullDisk(store, monkeypatch)
    disk.db_full = True
    assert store.fail(job.id, 507, "Video generation failed: disk full", completed_at=time.time(), ttl_s=None)
    assert store.get(job.id).status is JobStatus.FAILED and store.reference_path(job.id).exists()
    store.close()  # (still full: the failure is lost with the process)
    disk.db_full = False
    store = JobStore(tmp_path)
    assert store.recover() == [job.id]
    assert store.load_inputs(job.id) == ({"params": {}}, REFERENCE)
    store.close()


@pytest.mark.anyio
async def test_a_read_only_disk_fails_the_jobs_and_the_server_goes_on(tmp_path, monkeypatch):
    """A sync request's job running when the disk turns read-only and a job queued behind it (with a
    reference) fail with 503 naming storage: the sync request is answered with it (it waited out the sync
    timeout: its failure had raised in the encode pool), both are counted, the engine stays alive (it
    crashed for good: /health 503 after the disk was back), no answer names a path; once the disk is writable
    /health is 200 and a job completes."""
    import asyncio
    import threading

    gate = threading.Event()
    root = tmp_path / "store"
    async with asgi_server(root, backend=FakeBackend(step_gate=gate), sync_timeout_s=30) as http:
        store = http.engine_client.store
        disk = ReadOnlyDisk(root, monkeypatch)
        form = {"prompt": "x", **SMALL_FORM}
        sync = asyncio.create_task(http.post("/v1/videos/sync", data=form))
        await asyncio.to_thread(wait_until, lambda: http.engine_client.num_running == 1)
        files = {"input_reference": ("ref.png", png_bytes(), "image/png")}
        queued = (await http.post("/v1/videos", data=form, files=files)).json()["id"]
        disk.on = True
        gate.set()
        answer = await sync
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["message"].endswith(
            "could not save the video: Read-only file system"
        ), answer.text
        done = await poll_job(http, queued)
        assert done["status"] == "failed" and done["error"]["code"] == 503, done
        assert "videos folder is not writable" in done["error"]["message"], done
        assert http.engine_client.engine.alive
        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["reason"].startswith("storage:"), health.text
        metrics = (await http.get("/metrics")).text
        assert 'worldserve:request_failure_total{model_name="test-model",status="503"} 2.0' in metrics
        for text in (answer.text, str(done), health.text):
            assert str(tmp_path) not in text, text
        assert store.reference_path(queued).exists(), "left for the next start's sweep"
        disk.on = False
        assert (await http.get("/health")).status_code == 200
        r = await http.post("/v1/videos/sync", data=form)
        assert r.status_code == 200, r.text
    store = JobStore(root)
    assert store.recover() == [] and not store.reference_path(queued).exists()
    store.close()


@pytest.mark.anyio
async def test_a_sync_request_whose_video_a_read_only_disk_refuses_is_answered_with_the_failure(
    tmp_path, monkeypatch
):
    """The encode pool's save of the video meets the read-only disk (nothing else does): the job fails, the
    sync request gets its 503 and the failure is counted (the failure's own EROFS had raised in the pool
    thread: no answer until the sync timeout, 504, and no count)."""
    import asyncio
    import threading

    gate = threading.Event()
    async with asgi_server(tmp_path, backend=FakeBackend(step_gate=gate), sync_timeout_s=30) as http:
        disk = ReadOnlyDisk(tmp_path, monkeypatch)
        sync = asyncio.create_task(http.post("/v1/videos/sync", data={"prompt": "x", **SMALL_FORM}))
        await asyncio.to_thread(wait_until, lambda: http.engine_client.num_running == 1)
        disk.on = True
        gate.set()
        answer = await sync
        assert answer.status_code == 503, answer.text
        assert "could not save the video: Read-only file system" in answer.json()["error"]["message"]
        metrics = (await http.get("/metrics")).text
        assert 'worldserve:request_failure_total{model_name="test-model",status="503"} 1.0' in metrics
        assert http.engine_client.engine.alive
        disk.on = False


@pytest.mark.anyio
async def test_a_store_fault_recording_a_failure_does_not_stop_the_engine(tmp_path):
    """Whatever the store raises recording a job's failure (a fault of its own) is logged: the job's end is
    still counted and the engine goes on (the loop crashed)."""
    import asyncio

    async with asgi_server(tmp_path) as http:
        store = http.engine_client.store

        def broken(*_args, **_kwargs):
            raise RuntimeError("a bug in the store")

        store.fail = broken
        await http.post("/v1/videos", data={"prompt": "__fail__:prepare", **SMALL_FORM})
        counted = 'worldserve:request_failure_total{model_name="test-model",status="500"} 1.0'
        while counted not in (await http.get("/metrics")).text:
            assert http.engine_client.engine.alive
            await asyncio.sleep(0.01)
        assert http.engine_client.engine.alive and (await http.get("/health")).status_code == 200
        del store.fail
        r = await http.post("/v1/videos/sync", data={"prompt": "x", **SMALL_FORM})
        assert r.status_code == 200, r.text


def test_a_crash_by_an_os_error_is_told_without_its_path():
    """/health and the sync 503s quote the crash: an OSError by its errno's words (its str() names the file,
    a storage path); a write that a read-only disk refuses keeps its own error, not the clean-up's."""
    from worldserve.engine.outputs import crash_reason

    reason = crash_reason(OSError(errno.EROFS, "Read-only file system", "/srv/storage/inputs/job.ref"))
    assert reason == "OSError: Read-only file system"
    assert crash_reason(RuntimeError("a bug")) == "a bug"
    # the chat worker's stop reason (/health, its 503s) alike
    from worldserve.engine.outputs import error_words

    assert error_words(PermissionError(errno.EACCES, "Permission denied", "/srv/x")) == (
        "PermissionError: Permission denied"
    )
    assert error_words(ValueError("zip() argument 2 is shorter")) == "ValueError: zip() argument 2 is shorter"


def test_an_atomic_write_refused_keeps_its_own_error(tmp_path, monkeypatch):
    from worldserve.media import atomic_write

    def refused(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system (the clean-up)")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic_write.os, "fsync", full)
    monkeypatch.setattr(atomic_write.Path, "unlink", refused)
    with pytest.raises(OSError, match="No space left"):
        atomic_write.write_atomically(tmp_path / "x.bin", b"data")

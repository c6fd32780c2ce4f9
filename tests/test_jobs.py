"""JobStore: SQLite rows + files, status guards, pagination, recovery after a crash, expiry."""

from __future__ import annotations

import math
import sqlite3
import time

import pytest

from worldserve.engine.job_schema import new_job_id
from worldserve.engine.jobs import Job, JobSpec, JobStatus, JobStore

SPEC = JobSpec(model="m", prompt="p", size="64x64", seconds="1", quality="default", fps=24.0, num_frames=9)


def _job(created_at: float | None = None) -> Job:
    return Job(
        id=new_job_id(), status=JobStatus.QUEUED, progress=0, created_at=created_at or time.time(), spec=SPEC
    )


def _complete(store: JobStore, job_id: str, data: bytes = b"mp4", ttl: float | None = None) -> bool:
    return store.complete(job_id, data, completed_at=time.time(), ttl_s=ttl, inference_time_s=1.5,
                          stage_durations={"diffuse": 1.0}, peak_memory_mb=12.5)  # fmt: skip


def test_create_progress_complete_roundtrip(tmp_path):
    store = JobStore(tmp_path)
    job = _job()
    store.create(job, {"params": {"prompt": "p"}}, reference=b"img")
    assert store.get(job.id).status is JobStatus.QUEUED
    assert store.reference_path(job.id).read_bytes() == b"img"
    store.set_progress([(job.id, 50)])
    assert store.get(job.id).progress == 0, "progress only moves while in_progress"
    assert store.mark_in_progress(job.id, time.time())
    store.set_progress([(job.id, 50)])
    assert store.get(job.id).progress == 50
    assert _complete(store, job.id, b"video-bytes")
    got = store.get(job.id)
    assert (got.status, got.progress, got.file_name) == (JobStatus.COMPLETED, 100, f"{job.id}.mp4")
    assert (
        got.stage_durations == {"diffuse": 1.0} and got.peak_memory_mb == 12.5 and got.inference_time_s == 1.5
    )
    assert store.video_path(job.id).read_bytes() == b"video-bytes"
    assert not store.reference_path(job.id).exists(), "inputs are dropped once the output exists"
    assert not [p for p in tmp_path.rglob(".*.tmp")], "no temp files left behind"
    store.close()
    reopened = JobStore(tmp_path)
    assert reopened.get(job.id) == got


def test_commits_are_durable_before_they_return(tmp_path):
    store = JobStore(tmp_path)
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL (NORMAL, 1, can lose commits)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_complete_after_delete_leaves_nothing(tmp_path):
    store = JobStore(tmp_path)
    job = _job()
    store.create(job, {}, None)
    store.mark_in_progress(job.id, time.time())
    assert store.delete(job.id).id == job.id
    assert not _complete(store, job.id)
    assert store.get(job.id) is None and not store.video_path(job.id).exists()
    assert store.delete(job.id) is None


def test_fail_records_code_and_message(tmp_path):
    store = JobStore(tmp_path)
    job = _job()
    store.create(job, {}, b"ref")
    assert store.fail(job.id, 400, "bad", completed_at=time.time(), ttl_s=None)
    got = store.get(job.id)
    assert (got.status, got.error_code, got.error_message) == (JobStatus.FAILED, 400, "bad")
    assert not store.fail(job.id, 500, "again", completed_at=time.time(), ttl_s=None), "terminal is final"
    assert not store.reference_path(job.id).exists()


def test_a_job_committed_late_is_not_stamped_behind_a_cursor_already_passed(tmp_path):
    """A create stamped on the event loop whose write (a large reference's fsync) ends after a later create's:
    stored with its own created_at, it sorted before the later job, behind the cursor of a client tailing the
    list in `asc` order, which never saw it (an audit measured 1-3 of 44 jobs missed so). The store raises its
    created_at to the latest stored, so the list's order is the commit order."""
    store = JobStore(tmp_path)
    early = _job(created_at=1_700_000_000.5)  # stamped first, committed second
    late = store.create(_job(created_at=1_700_000_001.0), {}, None)
    page, _ = store.list(order="asc")
    assert [j.id for j in page] == [late.id]
    stored = store.create(early, {}, None)
    assert stored.created_at == late.created_at == store.get(early.id).created_at
    page, more = store.list(order="asc", after=late.id)
    assert [j.id for j in page] == [early.id] and not more
    store.close()
    reopened = JobStore(tmp_path)
    assert reopened.create(_job(created_at=1.0), {}, None).created_at == late.created_at
    reopened.close()


def test_list_order_cursor_and_has_more(tmp_path):
    store = JobStore(tmp_path)
    t0 = 1_700_000_000.0
    ids = []
    for i in range(5):
        job = _job(created_at=t0 + (i // 2))  # equal timestamps: insertion order breaks the tie
        store.create(job, {}, None)
        ids.append(job.id)
    jobs, more = store.list(order="asc")
    assert [j.id for j in jobs] == ids and not more
    jobs, more = store.list()  # desc by default
    assert [j.id for j in jobs] == ids[::-1]
    page, more = store.list(order="asc", limit=2)
    assert [j.id for j in page] == ids[:2] and more
    page, more = store.list(order="asc", limit=2, after=page[-1].id)
    assert [j.id for j in page] == ids[2:4] and more
    page, more = store.list(order="asc", limit=2, after=page[-1].id)
    assert [j.id for j in page] == ids[4:] and not more
    page, more = store.list(order="desc", after=ids[2])
    assert [j.id for j in page] == [ids[1], ids[0]]
    assert store.list(limit=0) == ([], True)
    assert store.list(limit=0, after=ids[0], order="desc") == ([], False)
    # the cursor job deleted (or expired) between two pages: paging goes on where it was
    first, more = store.list(order="asc", limit=2)
    store.delete(first[-1].id)
    page, more = store.list(order="asc", limit=2, after=first[-1].id)
    assert [j.id for j in page] == ids[2:4] and more
    assert store.list(after="video_gen_" + "0" * 32) == ([], False)  # never a job here
    assert store.list(after="video_gen_" + "0" * 32) == ([], False)


def test_recover_requeues_and_cleans(tmp_path):
    store = JobStore(tmp_path)
    queued, running, done = _job(), _job(), _job()
    for job in (queued, running, done):
        store.create(job, {"params": {}}, b"ref")
    store.mark_in_progress(running.id, time.time())
    store.set_progress([(running.id, 40)])
    store.mark_in_progress(done.id, time.time())
    _complete(store, done.id)
    (tmp_path / "videos" / f"{running.id}.mp4").write_bytes(b"partial")  # crash between rename and UPDATE
    (tmp_path / "videos" / f".{done.id}.mp4.{'a' * 32}.tmp").write_bytes(b"tmp")  # write_atomic's, cut
    (tmp_path / "inputs" / f"{'video_gen_' + 'b' * 32}.ref").write_bytes(b"orphan")  # no job has it
    # files the store never writes are someone else's (a shared or misnamed folder): left be
    foreign = ["holiday.mp4", "notes.txt", ".keep", "video_gen_x.mp4", "subdir"]
    for name in foreign[:-1]:
        (tmp_path / "videos" / name).write_bytes(b"precious")
    (tmp_path / "videos" / "subdir").mkdir()
    store.close()

    store = JobStore(tmp_path)
    assert store.recover() == [queued.id, running.id]
    got = store.get(running.id)
    assert (got.status, got.progress) == (JobStatus.QUEUED, 0)
    assert sorted(p.name for p in (tmp_path / "videos").iterdir()) == sorted([f"{done.id}.mp4", *foreign])
    assert sorted(p.name for p in (tmp_path / "inputs").iterdir()) == sorted(
        f"{j.id}.ref" for j in (queued, running)
    )
    assert store.load_inputs(running.id) == ({"params": {}}, b"ref")


def test_expiry_and_bad_ids(tmp_path):
    store = JobStore(tmp_path)
    job = _job()
    store.create(job, {}, None)
    store.mark_in_progress(job.id, time.time())
    _complete(store, job.id, ttl=1000.0)
    at = store.get(job.id).expires_at
    assert at is not None and store.delete_expired(math.nextafter(at, 0)) == []  # not before its instant
    assert store.delete_expired(at) == [job.id]  # at it
    for bad in ("../../etc/passwd", "video_gen_XYZ", ""):
        assert store.get(bad) is None and store.delete(bad) is None
    with pytest.raises(AssertionError):
        store.video_path("../x")


def test_an_expired_job_is_gone_before_the_sweep_takes_it(tmp_path):
    """A job past its expires_at was still retrieved, listed and downloadable until the next sweep (up to a
    minute, or half the TTL, later): reads now leave it out; the sweep still deletes it."""
    store = JobStore(tmp_path)
    old, fresh = _job(created_at=time.time() - 1), _job()
    for job in (old, fresh):
        store.create(job, {}, None)
        store.mark_in_progress(job.id, time.time())
    assert store.complete(old.id, b"mp4", completed_at=time.time() - 10, ttl_s=5.0, inference_time_s=1.5,
                          stage_durations={}, peak_memory_mb=0.0)  # fmt: skip
    _complete(store, fresh.id, ttl=1000.0)
    assert store.get(old.id) is None and store.get(fresh.id) is not None
    assert [j.id for j in store.list(order="asc")[0]] == [fresh.id]
    assert store.list(limit=1, order="asc") == ([store.get(fresh.id)], False)
    assert [j.id for j in store.list(after=old.id, order="asc")[0]] == [
        fresh.id
    ]  # (a cursor on it still pages)
    assert store.delete_expired(time.time()) == [old.id]


def test_deleting_an_expired_job_not_yet_swept_is_no_such_job(tmp_path):
    """GET, the list and the content say an expired job is gone before the sweep takes it; DELETE said it deleted
    it (200): now None (the route's 404), its files and row removed all the same."""
    store = JobStore(tmp_path)
    job = _job()
    store.create(job, {}, None)
    store.mark_in_progress(job.id, time.time())
    assert store.complete(job.id, b"mp4", completed_at=time.time() - 10, ttl_s=5.0, inference_time_s=1.5,
                          stage_durations={}, peak_memory_mb=0.0)  # fmt: skip
    assert store.get(job.id) is None and store.delete(job.id) is None
    assert not store.video_path(job.id).exists() and store.delete_expired(time.time()) == []


def test_the_sweep_deletes_expired_jobs_in_batches(tmp_path):
    """delete_expired takes every expired job (rows and files), a few per transaction, and leaves the rest;
    a client paging with a swept job as `after` goes on."""
    store = JobStore(tmp_path)
    jobs = [_job() for _ in range(5)]
    for i, job in enumerate(jobs):
        store.create(job, {}, None)
        store.mark_in_progress(job.id, time.time())
        _complete(store, job.id, ttl=0.01 if i < 4 else 1000.0)
    assert store.delete_expired(time.time() + 1, batch=3) == [j.id for j in jobs[:4]]
    assert [p.name for p in store.videos_dir.iterdir()] == [f"{jobs[4].id}.mp4"]
    assert [j.id for j in store.list(after=jobs[0].id, order="asc")[0]] == [jobs[4].id]
    assert store.delete_expired(time.time() + 1) == []


def test_a_ttl_set_at_restart_reaches_jobs_finished_before(tmp_path):
    """--job-ttl at the next start counts from the completion of jobs finished without one (they were kept
    forever); a job that already has an expiry keeps it."""
    store = JobStore(tmp_path)
    old, dated = _job(), _job()
    for job, ttl in ((old, None), (dated, 1000.0)):
        store.create(job, {}, None)
        store.mark_in_progress(job.id, time.time())
        _complete(store, job.id, ttl=ttl)
    kept = store.get(dated.id).expires_at
    store.close()
    store = JobStore(tmp_path)
    store.recover(ttl_s=5.0)
    got = store.get(old.id)
    assert got.expires_at == pytest.approx(got.completed_at + 5.0) and store.get(dated.id).expires_at == kept
    assert store.delete_expired(time.time() + 6) == [old.id]


def test_a_restart_without_a_ttl_clears_the_expiries(tmp_path):
    """A server started without --job-ttl sweeps nothing, so a job finished under an earlier TTL must not
    keep saying it expires (a date in the past, the job still listed and downloadable): its expiry is None."""
    store = JobStore(tmp_path)
    job = _job()
    store.create(job, {}, None)
    store.mark_in_progress(job.id, time.time())
    _complete(store, job.id, ttl=1000.0)
    assert store.get(job.id).expires_at is not None
    store.close()
    store = JobStore(tmp_path)
    store.recover(ttl_s=None)
    assert store.get(job.id).expires_at is None and store.get(job.id).status == "completed"


def test_one_store_per_directory_and_the_lock_goes_with_close(tmp_path):
    """A second server on the same storage directory would re-run the first one's running jobs and delete
    their finished videos: the directory is locked while a store holds it."""
    from worldserve.engine.job_files import StorageInUseError

    store = JobStore(tmp_path)
    with pytest.raises(StorageInUseError, match="--storage-dir"):
        JobStore(tmp_path)
    JobStore(tmp_path / "other").close()  # another directory is fine
    store.close()
    JobStore(tmp_path).close()  # free again once closed


def test_a_finished_video_whose_row_was_requeued_keeps_its_file(tmp_path):
    """complete() deletes the file it wrote only when the job's row is gone (deleted), not when the row is
    in another state (parked for restart while its video was being encoded: the re-run overwrites it)."""
    store = JobStore(tmp_path)
    job = _job()
    store.create(job, {}, reference=None)
    assert store.mark_in_progress(job.id, time.time())
    store.requeue([job.id])
    assert not _complete(store, job.id, b"late")
    assert store.video_path(job.id).read_bytes() == b"late"
    assert store.get(job.id).status is JobStatus.QUEUED


def test_a_job_the_process_keeps_dying_on_is_failed_not_rerun_forever(tmp_path):
    from worldserve.engine.jobs import MAX_INTERRUPTIONS

    store = JobStore(tmp_path)
    job, parked = _job(), _job()
    store.create(job, {"params": {}}, b"ref")
    store.create(parked, {"params": {}}, None)
    for start in range(1, MAX_INTERRUPTIONS + 1):
        assert store.mark_in_progress(job.id, time.time())  # ... and the process dies running it
        if start == 1:  # a graceful stop parks a job: no crash counted
            assert store.mark_in_progress(parked.id, time.time())
            store.requeue([parked.id])
        store.close()
        store = JobStore(tmp_path)
        counted = []  # the failures the metrics count (they were not counted)
        resumed = store.recover(ttl_s=60.0, on_failed=counted.append)
        if start < MAX_INTERRUPTIONS:
            assert resumed == [job.id, parked.id] and counted == []
    got = store.get(job.id)
    assert counted == [500]
    assert resumed == [parked.id] and got.status is JobStatus.FAILED and got.error_code == 500
    assert f"stopped {MAX_INTERRUPTIONS} times" in got.error_message and got.expires_at is not None
    assert not store.reference_path(job.id).exists()


def test_a_v1_database_gains_the_interruption_count(tmp_path):
    import sqlite3

    store = JobStore(tmp_path)
    job = _job()
    store.create(job, {"params": {}}, None)
    store.close()
    db = sqlite3.connect(tmp_path / "jobs.sqlite3")  # as worldserve's v1 left it: no `interrupted` column
    db.execute("ALTER TABLE jobs DROP COLUMN interrupted")
    db.execute("ALTER TABLE jobs DROP COLUMN error_param")
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()
    store = JobStore(tmp_path)
    assert store.mark_in_progress(job.id, time.time())
    assert store.recover() == [job.id]
    assert store.get(job.id).status is JobStatus.QUEUED


def test_a_v2_database_gains_the_failures_field(tmp_path):
    """v2 had no `error_param`: its failed jobs read with none, and new failures record theirs."""
    import sqlite3

    store = JobStore(tmp_path)
    old, new = _job(), _job()
    for job in (old, new):
        store.create(job, {"params": {}}, None)
    assert store.fail(old.id, 400, "bad", completed_at=time.time(), ttl_s=None)
    store.close()
    db = sqlite3.connect(tmp_path / "jobs.sqlite3")
    db.execute("ALTER TABLE jobs DROP COLUMN error_param")
    db.execute("PRAGMA user_version=2")
    db.commit()
    db.close()
    store = JobStore(tmp_path)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == 3
    got = store.get(old.id)
    assert (got.error_code, got.error_message, got.error_param) == (400, "bad", None)
    assert store.fail(
        new.id, 400, "too long", completed_at=time.time(), ttl_s=None, param="max_sequence_length"
    )
    assert store.get(new.id).error_param == "max_sequence_length"


def test_a_failed_write_rolls_back_and_later_writes_still_land(tmp_path):
    """A statement failing inside set_progress's transaction (disk full, I/O error: a trigger here) must not
    leave the connection inside it, which would make every later write fail or vanish."""
    import sqlite3

    store = JobStore(tmp_path)
    job = _job()
    store.create(job, {}, reference=None)
    assert store.mark_in_progress(job.id, time.time())
    store._db.execute(
        "CREATE TRIGGER boom BEFORE UPDATE OF progress ON jobs WHEN NEW.progress = 13 BEGIN SELECT RAISE(ABORT, 'io'); END"
    )
    with pytest.raises(sqlite3.DatabaseError):
        store.set_progress([(job.id, 13)])
    assert not store._db.in_transaction
    store.set_progress([(job.id, 40)])
    store.close()
    assert JobStore(tmp_path).get(job.id).progress == 40


def test_a_migration_cut_between_its_two_statements_opens_again(tmp_path):
    """The `interrupted` column present but user_version still 1 (the process died mid-migration before it
    was one transaction): the store opens and finishes the migration."""
    import sqlite3

    JobStore(tmp_path).close()
    db = sqlite3.connect(tmp_path / "jobs.sqlite3")
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()
    store = JobStore(tmp_path)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == 3


def test_a_non_finite_expiry_an_old_store_holds_reads_as_none(tmp_path):
    """--job-ttl inf was once accepted and stored expires_at = inf; listing such a job was a 500."""
    from worldserve.api.protocol import VideoObject

    store = JobStore(tmp_path)
    job = _job()
    store.create(job, {}, None)
    store.mark_in_progress(job.id, time.time())
    _complete(store, job.id, ttl=float("inf"))
    assert VideoObject.from_job(store.get(job.id)).expires_at is None


def test_what_the_store_creates_is_the_server_users_alone(tmp_path):
    """Prompts (the database), references and videos were world-readable under a 022 umask: the folders it
    creates are 0700, its files 0600 (SQLite's WAL and shared memory follow the database's)."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        store = JobStore(tmp_path / "store")
        job = _job()
        store.create(job, {"params": {}}, reference=b"img")
        store.mark_in_progress(job.id, time.time())
        _complete(store, job.id)
        mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
        assert [mode(d) for d in (store.root, store.videos_dir, store.inputs_dir)] == [0o700] * 3
        files = [store.db_path, store.video_path(job.id), *store.root.glob("jobs.sqlite3-*")]
        assert len(files) >= 3 and all(mode(f) == 0o600 for f in files), {f.name: oct(mode(f)) for f in files}
        store.close()
    finally:
        os.umask(old)


def test_a_listing_reads_its_rows_in_batches(tmp_path, monkeypatch):
    """A listing of many jobs reads LIST_BATCH_ROWS rows under the read lock at a time (100k jobs had held it
    for ~2 s, stalling every GET on the event loop); the pages are the same."""
    from worldserve.engine import jobs as jobs_module

    store = JobStore(tmp_path)
    ids = [store.create(_job(created_at=1_700_000_000.0 + i), {}, None).id for i in range(7)]
    monkeypatch.setattr(jobs_module, "LIST_BATCH_ROWS", 2)
    fetched = []
    real_execute = store._reader.execute

    class Cursor:  # the reader's cursor, recording each batch
        def __init__(self, cursor):
            self.cursor = cursor

        def fetchmany(self, n):
            rows = self.cursor.fetchmany(n)
            fetched.append(len(rows))
            assert store._read_lock.locked()
            return rows

        def close(self):
            assert store._read_lock.locked()
            self.cursor.close()

    def execute(sql, args=()):
        cursor = real_execute(sql, args)
        return Cursor(cursor) if sql.startswith("SELECT id, status") else cursor

    monkeypatch.setattr(store, "_reader", type("R", (), {"execute": staticmethod(execute)})())
    jobs, more = store.list(order="asc")
    assert [j.id for j in jobs] == ids and not more and fetched == [2, 2, 2, 1, 0]
    fetched.clear()
    page, more = store.list(order="desc", limit=3)
    # (the page and the one row saying there is more: 4 rows read, not the whole table)
    assert [j.id for j in page] == ids[::-1][:3] and more and fetched == [2, 2]
    monkeypatch.undo()
    store.close()


class RefusedWrites:
    """The store's writing connection on a full disk: every write fails as SQLite fails it (SQLITE_FULL),
    reads go through (as tests/test_storage_faults.py's FullDisk, without its file side)."""

    def __init__(self, db):
        self._db = db

    def execute(self, sql, *args):
        if sql.split()[0].upper() in ("INSERT", "UPDATE", "DELETE", "COMMIT"):
            exc = sqlite3.OperationalError("database or disk is full")
            exc.sqlite_errorcode, exc.sqlite_errorname = sqlite3.SQLITE_FULL, "SQLITE_FULL"
            raise exc
        return self._db.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._db, name)


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_a_page_is_full_when_a_kept_failure_has_expired(tmp_path, order):
    """A failure kept in memory (the disk refused it) carries an expiry the database does not hold: once it
    has passed, the listing hides the row after SQL picked it. The page read `limit + 1` rows and came back
    one short, with has_more false, although more jobs followed; it now reads on until it is full."""
    store = JobStore(tmp_path)
    ids = [store.create(_job(created_at=1_700_000_000.0 + i), {}, None).id for i in range(6)]
    ordered = ids if order == "asc" else ids[::-1]
    hidden = ordered[1]
    store.mark_in_progress(hidden, time.time())
    writer, store._db = store._db, RefusedWrites(store._db)
    assert store.fail(hidden, 507, "disk full", completed_at=time.time() - 10, ttl_s=5.0)
    store._db = writer
    shown = [i for i in ordered if i != hidden]
    assert store.get(hidden) is None and [j.id for j in store.list(order=order)[0]] == shown
    page, more = store.list(order=order, limit=2)
    assert [j.id for j in page] == shown[:2] and more
    page, more = store.list(order=order, limit=2, after=page[-1].id)
    assert [j.id for j in page] == shown[2:4] and more
    page, more = store.list(order=order, limit=1, after=page[-1].id)
    assert [j.id for j in page] == shown[4:] and not more
    assert store.list(order=order, limit=4, after=ordered[0]) == ([store.get(i) for i in shown[1:]], False)
    store.close()

"""Deleted jobs' list anchors (job_anchors.py): a listing paged with a job deleted (or expired) since the
previous page as `after` goes on after it across a restart too; anchors older than a day are pruned; a full
disk deletes as it did (an anchor it refuses is kept in memory only); a database from before the table opens.
"""

from __future__ import annotations

import logging
import sqlite3
import time

import pytest
from test_storage_faults import FullAtCommit, FullDisk

from worldserve.engine.job_anchors import ANCHOR_KEEP_S
from worldserve.engine.job_files import StorageError
from worldserve.engine.job_schema import new_job_id
from worldserve.engine.jobs import Job, JobSpec, JobStatus, JobStore

SPEC = JobSpec(model="m", prompt="p", size="64x64", seconds="1", quality="default", fps=24.0, num_frames=9)
T0 = 1_700_000_000.0


def _jobs(store: JobStore, n: int) -> list[str]:
    """`n` queued jobs, oldest first (one second apart)."""
    jobs = [
        Job(id=new_job_id(), status=JobStatus.QUEUED, progress=0, created_at=T0 + i, spec=SPEC)
        for i in range(n)
    ]
    return [store.create(job, {}, None).id for job in jobs]


def _anchored(store: JobStore) -> set[str]:
    """The ids whose anchor is in the table."""
    return {r[0] for r in store._db.execute("SELECT id FROM list_anchors")}


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_a_restart_between_two_pages_after_a_delete_continues_the_listing(tmp_path, order):
    """The cursor job deleted between two pages and the server restarted: the next page was empty with
    has_more false (the anchor lived in memory only), silently cutting the client's listing short."""
    store = JobStore(tmp_path)
    ids = _jobs(store, 5)
    ordered = ids if order == "asc" else ids[::-1]
    page, more = store.list(order=order, limit=2)
    assert [j.id for j in page] == ordered[:2] and more
    assert store.delete(page[-1].id) is not None
    store.close()
    store = JobStore(tmp_path)
    page, more = store.list(order=order, limit=2, after=ordered[1])
    assert [j.id for j in page] == ordered[2:4] and more
    # (an id never deleted here: none)
    assert store.list(after="video_gen_" + "0" * 32) == ([], False)
    store.close()


def test_a_job_swept_between_two_pages_still_anchors_after_a_restart(tmp_path):
    store = JobStore(tmp_path)
    ids = _jobs(store, 3)
    assert store.mark_in_progress(ids[0], time.time())
    assert store.complete(ids[0], b"mp4", completed_at=time.time(), ttl_s=0.01, inference_time_s=1.0,
                          stage_durations={}, peak_memory_mb=1.0)  # fmt: skip
    assert store.delete_expired(time.time() + 1) == [ids[0]]
    store.close()
    store = JobStore(tmp_path)
    assert [j.id for j in store.list(order="asc", after=ids[0])[0]] == ids[1:]
    store.close()


def test_anchors_older_than_a_day_are_pruned(tmp_path):
    """Each deletion (a DELETE, a sweep, one with nothing expired too) prunes the anchors deleted more than
    ANCHOR_KEEP_S before it: the table holds a day of deletions, not every job ever deleted."""
    store = JobStore(tmp_path)
    old, kept, swept, _ = _jobs(store, 4)
    store.delete(old)
    store.delete(kept)
    assert _anchored(store) == {old, kept}
    store._db.execute(
        "UPDATE list_anchors SET deleted_at = deleted_at - ? WHERE id=?", (ANCHOR_KEEP_S + 60, old)
    )
    # (a sweep with nothing expired prunes too)
    assert store.delete_expired(time.time()) == []
    assert _anchored(store) == {kept}
    assert store.mark_in_progress(swept, time.time())
    assert store.complete(swept, b"mp4", completed_at=time.time(), ttl_s=0.01, inference_time_s=1.0,
                          stage_durations={}, peak_memory_mb=1.0)  # fmt: skip
    assert store.delete_expired(time.time() + ANCHOR_KEEP_S + 60) == [swept]
    # (`kept` is a day old at that sweep's time)
    assert _anchored(store) == {swept}
    store.close()
    store = JobStore(tmp_path)
    # pruned: as any unknown cursor
    assert store.list(after=old) == ([], False)
    store.close()


class AnchorsRefused(FullDisk):
    """A disk with room for a job row's deletion but not for its anchor (its row and the prune refused)."""

    def _check(self, sql: str) -> None:
        if "list_anchors" in sql:
            super()._check(sql)


def test_a_delete_whose_anchor_the_disk_refuses_still_goes_through(tmp_path, monkeypatch, caplog):
    """The anchor is kept in memory only (the listing goes on until a restart), the row and its files go, no
    transaction is left open, and the next deletion with space back stores its anchor."""
    store = JobStore(tmp_path)
    ids = _jobs(store, 4)
    disk = AnchorsRefused(store, monkeypatch)
    disk.db_full = True
    with caplog.at_level(logging.WARNING, logger="worldserve.engine.jobs"):
        assert store.delete(ids[0]).id == ids[0]
    assert "list anchors not saved" in caplog.text
    assert store.get(ids[0]) is None and not store._db.in_transaction
    assert [j.id for j in store.list(order="asc", after=ids[0])[0]] == ids[1:]
    disk.db_full = False
    assert _anchored(store) == set()
    store.delete(ids[1])
    assert _anchored(store) == {ids[1]}
    store.close()
    store = JobStore(tmp_path)
    # (its anchor was in memory only)
    assert store.list(order="asc", after=ids[0]) == ([], False)
    assert [j.id for j in store.list(order="asc", after=ids[1])[0]] == ids[2:]
    store.close()


@pytest.mark.parametrize("disk_kind", [FullDisk, FullAtCommit])
def test_a_delete_on_a_full_disk_is_refused_as_before(tmp_path, monkeypatch, disk_kind):
    """No room for the row's deletion either: a 507 StorageError about the deletion, the row kept, no
    transaction left open, and no anchor (the job is still listed); with space back it goes through."""
    store = JobStore(tmp_path)
    ids = _jobs(store, 2)
    disk = disk_kind(store, monkeypatch)
    disk.db_full = True
    with pytest.raises(StorageError, match="could not save the deletion: database or disk is full") as info:
        store.delete(ids[0])
    assert info.value.status_code == 507
    assert store.get(ids[0]) is not None and not store._db.in_transaction
    disk.db_full = False
    assert _anchored(store) == set()
    assert store.delete(ids[0]) is not None and _anchored(store) == {ids[0]}
    store.close()


def test_a_database_from_before_the_anchors_opens_and_gains_them(tmp_path):
    """A v3 database written by a worldserve without `list_anchors`: it opens (the table created), its
    version unchanged, and its deletions anchor listings across a restart."""
    store = JobStore(tmp_path)
    ids = _jobs(store, 3)
    store.close()
    db = sqlite3.connect(tmp_path / "jobs.sqlite3")
    db.execute("DROP TABLE list_anchors")
    db.commit()
    db.close()
    store = JobStore(tmp_path)
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == 3
    store.delete(ids[0])
    store.close()
    store = JobStore(tmp_path)
    assert [j.id for j in store.list(order="asc", after=ids[0])[0]] == ids[1:]
    store.close()

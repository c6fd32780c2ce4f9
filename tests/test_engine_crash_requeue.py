"""A job the engine loop was running when the loop crashed counts that crash as a stop of the server, as a
death of the process does (jobs.py: MAX_INTERRUPTIONS): a job that crashes the loop every time it runs is
failed after that many crashes instead of crashing every restart (it was queued again uncounted, and the
server crash-looped with the jobs behind it never run). A clean shutdown that parks a job does not count."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time

import pytest
from serving_helpers import (
    SMALL_FORM,
    asgi_server,
    job_params,
    make_client,
    stored_job,
    submit_job,
    wait_until,
)

from worldserve.engine.fake_backend import FakeBackend
from worldserve.engine.jobs import GIVEN_UP_MESSAGE, MAX_INTERRUPTIONS, JobStatus, JobStore
from worldserve.engine.scheduler import Scheduler

CRASHER = "crashes the loop"


def _interrupted(root, job_id: str) -> int:
    db = sqlite3.connect(root / "jobs.sqlite3")
    try:
        return db.execute("SELECT interrupted FROM jobs WHERE id=?", (job_id,)).fetchone()[0]
    finally:
        db.close()


def test_a_crash_requeue_counts_and_fails_the_job_at_the_limit(tmp_path):
    """requeue(crashed=True) counts the stop; at MAX_INTERRUPTIONS the job fails (500, the message a
    restart gives, an expiry from the TTL, its reference removed) and its id is returned. A crash and a
    death of the process add up; a plain requeue (a clean shutdown) counts nothing."""
    store = JobStore(tmp_path)
    job, parked = stored_job(store, b"ref"), stored_job(store)
    store.requeue([parked.id])  # a clean shutdown's park
    assert _interrupted(tmp_path, parked.id) == 0
    assert store.requeue([job.id], crashed=True, ttl_s=60.0) == []
    assert store.get(job.id).status is JobStatus.QUEUED and _interrupted(tmp_path, job.id) == 1
    assert store.mark_in_progress(job.id, time.time())
    store.close()  # ... and the process dies running it: counted at the next start
    store = JobStore(tmp_path)
    assert store.recover(ttl_s=60.0) == [job.id, parked.id]
    assert _interrupted(tmp_path, job.id) == 2
    for other in (job, parked):
        assert store.mark_in_progress(other.id, time.time())
    assert store.requeue([job.id, parked.id], crashed=True, ttl_s=60.0) == [job.id]
    got = store.get(job.id)
    assert got.status is JobStatus.FAILED and (got.error_code, got.error_message) == (500, GIVEN_UP_MESSAGE)
    assert got.expires_at is not None and not store.reference_path(job.id).exists()
    assert f"stopped {MAX_INTERRUPTIONS} times" in GIVEN_UP_MESSAGE
    assert store.get(parked.id).status is JobStatus.QUEUED and _interrupted(tmp_path, parked.id) == 1
    store.close()


@pytest.fixture
def crashing_scheduler(monkeypatch) -> threading.Event:
    """A bug in the engine loop that a job's prompt sets off: once the event it returns is set, the scheduler
    raises when it has picked a batch holding the CRASHER job (the loop crashes; FakeBackend runs the rest)."""
    armed = threading.Event()
    real_next_batch = Scheduler.next_batch

    def next_batch(self):
        batch = real_next_batch(self)
        if armed.is_set() and any(request.params.prompt == CRASHER for request in batch or ()):
            raise RuntimeError("injected engine-loop bug")
        return batch

    monkeypatch.setattr(Scheduler, "next_batch", next_batch)
    return armed


@pytest.mark.anyio
async def test_a_job_that_crashes_the_loop_fails_after_max_crashes_and_the_rest_run(
    tmp_path, crashing_scheduler
):
    """The job crashes the loop at every start: after MAX_INTERRUPTIONS crashes it is failed (counted on
    /metrics as a 500), and the next start serves again and runs the job queued behind it."""
    form = {**SMALL_FORM, "num_inference_steps": "3"}
    gate = threading.Event()  # (the crasher's first step held until its mate is queued behind it)
    async with asgi_server(tmp_path, backend=FakeBackend(step_gate=gate), max_batch_size=1) as http:
        crasher = (await http.post("/v1/videos", data={"prompt": CRASHER, **form})).json()["id"]
        store = http.engine_client.store
        await asyncio.to_thread(wait_until, lambda: store.get(crasher).status is JobStatus.IN_PROGRESS)
        mate = (await http.post("/v1/videos", data={"prompt": "a mate", **form})).json()["id"]
        crashing_scheduler.set()
        gate.set()
        await asyncio.to_thread(wait_until, lambda: not http.engine_client.engine.alive)
        assert store.get(crasher).status is JobStatus.QUEUED
    assert _interrupted(tmp_path, crasher) == 1
    for start in range(2, MAX_INTERRUPTIONS + 1):
        async with asgi_server(tmp_path, backend=FakeBackend(), max_batch_size=1) as http:
            await asyncio.to_thread(wait_until, lambda: not http.engine_client.engine.alive)
            assert (await http.get("/health")).status_code == 503
            job = (await http.get(f"/v1/videos/{crasher}")).json()
            if start < MAX_INTERRUPTIONS:
                assert job["status"] == "queued", (start, job)
            else:
                assert job["status"] == "failed", job
                assert job["error"] == {"code": 500, "message": GIVEN_UP_MESSAGE}, job
                assert (await http.get(f"/v1/videos/{mate}")).json()["status"] == "queued"
                metrics = (await http.get("/metrics")).text
                assert 'worldserve:request_failure_total{model_name="test-model",status="500"} 1.0' in metrics
        assert _interrupted(tmp_path, crasher) == start
    async with asgi_server(tmp_path, backend=FakeBackend(), max_batch_size=1) as http:
        assert (await http.get("/health")).status_code == 200
        r = await http.post("/v1/videos/sync", data={"prompt": "after", **form})
        assert r.status_code == 200, r.text
        assert (await http.get(f"/v1/videos/{mate}")).json()["status"] == "completed"
        assert (await http.get(f"/v1/videos/{crasher}")).json()["status"] == "failed"


def test_a_running_job_parked_by_a_shutdown_is_not_counted(tmp_path):
    """The shutdown's deadline stops a job mid-run (parked, queued for the next start): no stop counted."""

    async def main():
        client = make_client(tmp_path, backend=FakeBackend(step_delay=0.01))
        await client.start()
        job = submit_job(client, job_params("long", steps=1000))
        await asyncio.to_thread(wait_until, lambda: client.store.get(job.id).status is JobStatus.IN_PROGRESS)
        await client.shutdown(0)
        return job

    job = asyncio.run(main())
    assert _interrupted(tmp_path, job.id) == 0
    store = JobStore(tmp_path)
    assert store.get(job.id).status is JobStatus.QUEUED
    store.close()

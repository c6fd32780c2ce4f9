"""Engine + EngineClient on the FakeBackend: batching, joins at step boundaries, cancel, failure isolation,
queue bound, drain/stop and restart recovery (decode and encode: test_engine_decode.py). Stub encoder unless
the test is about the encoder."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import threading
import time

import pytest
from serving_helpers import job_params, job_spec, make_client, stub_encoder, submit_job, wait_until

from worldserve.engine.client import EncodeOptions, JobStatus, QueueFullError, ShuttingDownError
from worldserve.engine.fake_backend import FakeBackend


def run(coro):
    return asyncio.run(coro)


def test_one_request_end_to_end(tmp_path):
    backend = FakeBackend()

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        job = submit_job(
            client, job_params(steps=3, seed=7), EncodeOptions(crf=0, codec_options={"preset": "fast"})
        )
        done = await asyncio.wait_for(client.wait(job.id), 10)
        await client.shutdown(5)
        return job, done

    job, done = run(main())
    assert done.status is JobStatus.COMPLETED and done.progress == 100
    assert set(done.stage_durations) >= {"prepare", "diffuse", "decode", "encode"}
    meta = json.loads((tmp_path / "videos" / f"{job.id}.mp4").read_bytes()[7:])
    assert meta["frames"] == [5, 64, 64, 3] and meta["audio"] == [2, 30000] and meta["fps"] == 8.0
    assert meta["crf"] == 0 and meta["codec_options"] == {"preset": "fast"}
    assert backend.batch_sizes == [1, 1, 1] and not backend.live, "three steps, state released"


def test_same_shape_requests_batch_and_join_at_step_boundaries(tmp_path):
    backend = FakeBackend(step_delay=0.02)

    async def main():
        client = make_client(tmp_path, backend=backend, max_batch_size=4)
        await client.start()
        first = submit_job(client, job_params(steps=20))
        await asyncio.to_thread(wait_until, lambda: client.get(first.id).progress >= 15)
        late = [submit_job(client, job_params(steps=3, seed=s)) for s in range(2)]
        other = submit_job(client, job_params(steps=2, width=128))  # different batch key
        jobs = [first, *late, other]
        results = await asyncio.wait_for(asyncio.gather(*(client.wait(j.id) for j in jobs)), 20)
        await client.shutdown(5)
        return results

    results = run(main())
    assert all(r.status is JobStatus.COMPLETED for r in results)
    assert max(backend.batch_sizes) == 3, f"the late pair joined the running request: {backend.batch_sizes}"
    assert backend.batch_sizes[0] == 1 and backend.batch_sizes[-2:] == [1, 1], "the 128-wide one runs alone"
    assert len(backend.batch_sizes) == 20 + 2, "joined steps cost nothing extra"


def test_progress_rises_step_by_step(tmp_path):
    backend = FakeBackend(step_delay=0.05)

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        job = submit_job(client, job_params(steps=5))
        seen = []
        while (current := client.get(job.id)).status is not JobStatus.COMPLETED:
            seen.append(current.progress)
            await asyncio.sleep(0.005)
        await client.shutdown(5)
        return seen

    seen = run(main())
    assert seen == sorted(seen) and len(set(seen) & {20, 40, 60, 80}) >= 3 and max(seen) < 100


def test_cancel_mid_job_releases_and_next_runs(tmp_path):
    backend = FakeBackend(step_delay=0.02)

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        victim = submit_job(client, job_params(steps=200))
        queued = submit_job(client, job_params(steps=200, seed=3))
        after = submit_job(client, job_params(steps=2))
        await asyncio.to_thread(wait_until, lambda: client.get(victim.id).progress >= 2)
        assert client.delete(queued.id).status is JobStatus.QUEUED
        assert client.delete(victim.id).status is JobStatus.IN_PROGRESS
        assert await asyncio.wait_for(client.wait(victim.id), 5) is None
        done = await asyncio.wait_for(client.wait(after.id), 10)
        await client.shutdown(5)
        return victim, done

    victim, done = run(main())
    assert done.status is JobStatus.COMPLETED
    assert victim.id in backend.released and not backend.live
    assert len(backend.batch_sizes) < 60, "the cancelled job stopped at a step boundary"
    assert not (tmp_path / "videos" / f"{victim.id}.mp4").exists()


@pytest.mark.parametrize("stage", ["prepare", "denoise", "decode", "decode_stream", "encode"])
def test_a_failing_request_fails_alone(tmp_path, stage):
    """decode_stream: the decode fails after its first chunk reached the encoder (the encode stops, the job
    fails once); encode: the mux fails while the decode still streams (its later chunks are dropped)."""
    backend = FakeBackend()

    def encoder(frames, fps, audio, **kw):
        if frames.shape[2] == 96:
            raise RuntimeError("mux exploded")
        return stub_encoder(frames, fps, audio, **kw)

    async def main():
        client = make_client(tmp_path, backend=backend, max_batch_size=2, encoder=encoder)
        await client.start()
        bad = job_params(f"x __fail__:{stage}", width=96 if stage == "encode" else 64)
        jobs = [submit_job(client, bad), submit_job(client, job_params(width=80))]
        results = await asyncio.wait_for(asyncio.gather(*(client.wait(j.id) for j in jobs)), 10)
        health = client.health()
        await client.shutdown(5)
        return results, health

    (failed, ok), health = run(main())
    assert failed.status is JobStatus.FAILED and failed.error_code == 500
    assert failed.error_message.startswith("Video generation failed:")
    injected = "mux exploded" if stage == "encode" else f"injected failure at {stage}"
    assert failed.error_message.endswith(injected)
    assert ok.status is JobStatus.COMPLETED and health == (True, None)
    assert not backend.live


def _one_job(tmp_path, backend):
    """One job through a client on `backend`, to its end: its finished record."""

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        job = submit_job(client, job_params())
        done = await asyncio.wait_for(client.wait(job.id), 10)
        await client.shutdown(5)
        return done

    return run(main())


def test_a_failed_request_s_traceback_holds_none_of_its_state(tmp_path):
    """A log handler that keeps records (pytest's, a memory or error-reporting one) keeps a failure's
    exc_info: the traceback's frames had kept the failed batch's state alive with it (on a GPU: a 720p job's
    latents, 70 MiB after a CUDA OOM in its step). The frames let their locals go once the job has failed."""
    import logging
    import weakref

    class Held:
        pass

    held: list = []

    class Failing(FakeBackend):
        def denoise(self, states):
            state = Held()  # (a local of the failing frame, as a step's activations are)
            held.append(weakref.ref(state))
            raise RuntimeError("out of memory")

    records: list[logging.LogRecord] = []
    keeper = logging.Handler()
    keeper.emit = records.append  # (keeps every record, its exc_info too)
    logging.getLogger("worldserve").addHandler(keeper)

    try:
        failed = _one_job(tmp_path, Failing())
    finally:
        logging.getLogger("worldserve").removeHandler(keeper)
    assert failed.status is JobStatus.FAILED and any(r.exc_info for r in records)
    gc.collect()
    assert held and held[0]() is None


def test_the_engine_thread_prepares_its_backend_s_compile_settings(tmp_path):
    """The engine's thread calls its backend's prepare_thread first: the compiled layers' graph limits set at
    load (on the loader thread) are that thread's own on torch >= 2.12, and the engine's had kept dynamo's 8
    graphs, then ran eagerly without a word (VideoPipeline.prepare_thread raises them there)."""
    import torch._dynamo

    from worldserve.runner.video_pipeline import VideoPipeline

    seen = []

    class Compiled(FakeBackend):
        prepare_thread = VideoPipeline.prepare_thread

        def denoise(self, states):
            seen.append(torch._dynamo.config.recompile_limit)
            super().denoise(states)

    assert _one_job(tmp_path, Compiled()).status is JobStatus.COMPLETED
    assert seen and min(seen) >= 4096


def test_queue_bound_and_shutdown_intake(tmp_path):
    backend = FakeBackend(step_delay=0.05)

    async def main():
        client = make_client(tmp_path, backend=backend, max_queued_requests=2)
        await client.start()
        running = submit_job(client, job_params(steps=100))
        await asyncio.to_thread(wait_until, lambda: client.engine.num_running == 1)
        submit_job(client, job_params())
        submit_job(client, job_params())
        with pytest.raises(QueueFullError) as full:
            submit_job(client, job_params())
        assert full.value.retry_after_s >= 1
        # before any job has ended, the wait is the running job's own pace (100 steps of 0.05 s, 10-30 % done:
        # >= 3.5 s left; it had said 1 s until a first job ended)
        await asyncio.to_thread(wait_until, lambda: client.jobs.store.get(running.id).progress >= 10)
        with pytest.raises(QueueFullError) as full:
            submit_job(client, job_params())
        assert full.value.retry_after_s >= 3, full.value.retry_after_s
        waiter = asyncio.create_task(client.wait(running.id))
        client.begin_shutdown(0.2)
        with pytest.raises(ShuttingDownError):
            submit_job(client, job_params())
        await client.shutdown(0.2)
        with pytest.raises(ShuttingDownError):
            await waiter
        return running

    running = run(main())
    # The hard stop parked the running job: it is queued again, to resume at the next start.
    from worldserve.engine.jobs import JobStore

    store = JobStore(tmp_path)
    assert store.get(running.id).status is JobStatus.QUEUED
    assert sum(j.status is JobStatus.QUEUED for j in store.list()[0]) == 3


def test_retry_after_follows_the_first_job_s_decode(tmp_path):
    """Before any job has ended, a job past its last step (decoding: no longer among the running) still sets
    the full queue's Retry-After (as long again as its decode has run; it said 1 s)."""
    gate = threading.Event()
    backend = FakeBackend(chunk_gate=gate)

    async def main():
        client = make_client(tmp_path, backend=backend, max_queued_requests=2)
        await client.start()
        try:
            first = submit_job(client, job_params(steps=2, frames=17))
            await asyncio.to_thread(wait_until, lambda: client.jobs.store.get(first.id).progress == 99)
            submit_job(client, job_params())  # (both wait: the engine thread is in the held decode)
            submit_job(client, job_params())
            await asyncio.sleep(2.5)
            with pytest.raises(QueueFullError) as full:
                submit_job(client, job_params())
            assert full.value.retry_after_s >= 2, full.value.retry_after_s
        finally:
            gate.set()
            await client.shutdown(5)

    run(main())


def test_retry_after_follows_a_long_running_job_after_short_ones_ended(tmp_path):
    """Once short jobs have ended, a long one running sets the full queue's Retry-After at its own pace (the
    short jobs' mean service time had said ~1 s with most of its 100 steps left)."""
    backend = FakeBackend(step_delay=0.05)

    async def main():
        client = make_client(tmp_path, backend=backend, max_queued_requests=2)
        await client.start()
        try:
            for _ in range(2):
                short = submit_job(client, job_params(steps=1, frames=1, generate_sound=False))
                await client.wait(short.id)
            assert client.engine._ends.service_ewma_s < 2
            long = submit_job(client, job_params(steps=100))
            await asyncio.to_thread(wait_until, lambda: client.jobs.store.get(long.id).progress >= 10)
            submit_job(client, job_params())
            submit_job(client, job_params())
            with pytest.raises(QueueFullError) as full:
                submit_job(client, job_params())
            assert full.value.retry_after_s >= 3, full.value.retry_after_s
        finally:
            await client.shutdown(0.2)

    run(main())


def test_restart_resumes_unfinished_jobs(tmp_path):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (20, 12), (10, 200, 30)).save(buf, format="PNG")
    png = buf.getvalue()

    async def first_life():
        client = make_client(tmp_path, backend=FakeBackend(step_delay=0.05))
        await client.start()
        p = job_params(steps=100, generate_sound=False)
        running = client.submit(p, job_spec(p), EncodeOptions(crf=5), png)
        lost = client.submit(p, job_spec(p), EncodeOptions(), png)
        loud = job_params(generate_sound=True)
        loud = client.submit(loud, job_spec(loud), EncodeOptions(), None)
        await asyncio.to_thread(wait_until, lambda: client.get(running.id).progress > 0)
        client.engine.stop(0)  # what a crash leaves: one row in_progress, two queued
        client.store.close()  # the dead process's storage lock goes with it
        return running, lost, loud

    running, lost, loud = run(first_life())
    (tmp_path / "inputs" / f"{lost.id}.ref").unlink()

    async def second_life():  # restarted with a model without sound: a job asking for it no longer fits
        backend = FakeBackend(has_sound=False)
        client = make_client(tmp_path, backend=backend)
        await client.start()
        waits = (client.wait(job.id) for job in (running, lost, loud))
        results = await asyncio.wait_for(asyncio.gather(*waits), 10)
        await client.shutdown(5)
        return results

    resumed, failed, refused = run(second_life())
    assert resumed.status is JobStatus.COMPLETED
    meta = json.loads((tmp_path / "videos" / f"{running.id}.mp4").read_bytes()[7:])
    assert meta["crf"] == 5
    assert (
        failed.status is JobStatus.FAILED
        and "uploaded reference (image or video) is missing" in failed.error_message
    )
    assert (refused.status, refused.error_code) == (JobStatus.FAILED, 400)
    assert "model now served does not take it (generate_sound)" in refused.error_message


def test_waiters_are_woken_from_the_engine_thread(tmp_path):
    async def main():
        client = make_client(tmp_path)
        await client.start()
        jobs = [submit_job(client, job_params(steps=1, seed=i)) for i in range(20)]
        results = await asyncio.wait_for(asyncio.gather(*(client.wait(j.id) for j in jobs)), 10)
        await client.shutdown(5)
        return results, threading.active_count()

    results, _ = run(main())
    assert all(r.status is JobStatus.COMPLETED for r in results)


def test_ephemeral_requests_are_cancelled_at_shutdown_and_leave_the_queue_alone(tmp_path):
    """Image requests (no job): at a shutdown the running one and the one still waiting are cancelled
    (503 for their callers, they cannot resume); a queued video job stays queued for the next start."""
    from worldserve.engine.refusals import CancelledRequest

    backend = FakeBackend(step_delay=0.05)

    async def main():
        client = make_client(tmp_path, backend=backend, max_batch_size=1)
        await client.start()
        images = asyncio.ensure_future(
            client.jobless.generate(
                [job_params(steps=200), job_params(steps=200, seed=2)], prefix="img", timeout_s=30
            )
        )
        for _ in range(500):  # the loop must run for the requests to reach the engine
            if client.engine.num_running == 1:
                break
            await asyncio.sleep(0.01)
        queued_video = submit_job(client, job_params(steps=3))
        await client.shutdown(0.1)
        with pytest.raises(CancelledRequest) as cancelled:
            await asyncio.wait_for(images, 5)
        return client, queued_video, cancelled.value

    from worldserve.engine.jobs import JobStore

    _, job, exc = run(main())
    assert exc.status_code == 503
    assert not backend.live, "the running image request was released"
    store = JobStore(tmp_path)  # as the next start sees it: the video job, queued; no trace of the images
    assert [j.id for j in store.list(after=None, limit=None, order="asc")[0]] == [job.id]
    assert store.get(job.id).status is JobStatus.QUEUED


def test_a_request_a_stop_ends_is_counted_as_its_abort_says(tmp_path):
    """An ephemeral request a stop ends: counted cancelled, or failed with its abort's status when one was set
    (an image request whose timeout already answered 504, a stalled stream) as Endings.cancelled counts it;
    a failing observer still lets its caller have the end."""
    from worldserve.engine.observer import NullObserver
    from worldserve.engine.refusals import CancelledRequest
    from worldserve.engine.request import Request

    seen: list[object] = []

    class Recorded(NullObserver):
        def on_failed(self, code: int) -> None:
            seen.append(code)

        def on_cancelled(self) -> None:
            seen.append("cancelled")

    class Broken(NullObserver):
        def on_cancelled(self) -> None:
            raise RuntimeError("metrics down")

    client = make_client(tmp_path, backend=FakeBackend())
    ends: list[object] = []
    for status, observer in ((None, Recorded()), (504, Recorded()), (None, Broken())):
        request = Request(job_id=f"r-{status}", params=job_params(), arrival_time=0.0, on_result=ends.append,
                          observer=observer)  # fmt: skip
        request.abort_status = status
        client.engine._end_at_shutdown(request, "the server is shutting down")
    assert seen == ["cancelled", 504]
    assert len(ends) == 3 and all(isinstance(end, CancelledRequest) for end in ends)


def test_an_ephemeral_request_after_the_loop_ended_is_cancelled_at_once(tmp_path):
    import time as _time

    from worldserve.engine.refusals import CancelledRequest
    from worldserve.engine.request import Request

    async def main():
        client = make_client(tmp_path)
        await client.start()
        await client.shutdown(0.1)
        return client

    from worldserve.engine.observer import NullObserver

    class Cancels(NullObserver):
        counted = 0

        def on_cancelled(self) -> None:
            Cancels.counted += 1

    client = run(main())
    outcomes = []
    client.engine.add_request(Request(job_id="img-late", params=job_params(), arrival_time=_time.monotonic(),
                                      on_result=outcomes.append, observer=Cancels()))  # fmt: skip
    assert len(outcomes) == 1 and isinstance(outcomes[0], CancelledRequest) and client.engine.num_waiting == 0
    assert Cancels.counted == 1  # (as the requests the stop itself ended are)


def test_deleted_queued_jobs_free_their_queue_slots_at_once(tmp_path):
    """A queued job deleted while the engine is inside a long step no longer counts against the queue bound
    (the loop itself only sees the abort at its next step boundary)."""
    backend = FakeBackend(step_delay=1.0)

    async def main():
        client = make_client(tmp_path, backend=backend, max_queued_requests=2)
        await client.start()
        submit_job(client, job_params(steps=100))
        await asyncio.to_thread(wait_until, lambda: client.engine.num_running == 1)
        queued = [submit_job(client, job_params(seed=s)) for s in range(2)]
        with pytest.raises(QueueFullError):
            submit_job(client, job_params())
        for job in queued:
            assert client.delete(job.id) is not None
        assert client.engine.num_waiting == 0
        fresh = submit_job(client, job_params())  # no 429: the deleted jobs' slots are free
        assert client.get(fresh.id).status is JobStatus.QUEUED
        await client.shutdown(0.1)

    run(main())


def test_shutdown_answers_waiters_of_queued_jobs_at_once_and_the_rest_after_the_timeout(tmp_path):
    """On shutdown a sync waiter whose job stays queued is answered right away; one whose job runs gets its
    answer after the shutdown timeout even while the engine is still inside a long step (held by the gate:
    its answer comes while the step cannot have ended)."""
    step = threading.Event()
    backend = FakeBackend(step_gate=step)

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        running = submit_job(client, job_params(steps=100))
        await asyncio.to_thread(wait_until, lambda: client.engine.num_running == 1)
        queued = submit_job(client, job_params(seed=1))
        waiters = [asyncio.create_task(client.wait(j.id)) for j in (running, queued)]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        client.begin_shutdown(0.5)
        try:
            with pytest.raises(ShuttingDownError):
                await asyncio.wait_for(waiters[1], 10)
            assert not waiters[0].done()  # at once: before the timeout answers the running job's waiter
            with pytest.raises(ShuttingDownError):  # (wait_for: a hang guard, not a speed bound)
                await asyncio.wait_for(waiters[0], 10)
            assert backend.steps_done == 0  # answered while the step was still held, not when it ended
            # not before the timeout (a lower bound: timers do not fire early, so it cannot flake)
            assert time.monotonic() - t0 > 0.4
        finally:
            step.set()
        await client.shutdown(0.5)

    run(main())


def test_a_job_deleted_as_it_is_admitted_is_counted_cancelled(tmp_path):
    """A DELETE removes the row, then queues the abort: the engine may take the job from its queue between
    the two. Its admission then finds no row (and the abort finds nothing): the job is counted cancelled
    (it had been counted nowhere)."""
    backend = FakeBackend(step_delay=0.2)

    async def main():
        client = make_client(tmp_path, backend=backend)
        cancelled = []
        client.engine.observer.on_cancelled = lambda: cancelled.append(1)  # (the metrics' hook)
        await client.start()
        submit_job(client, job_params(steps=2))
        await asyncio.to_thread(wait_until, lambda: client.engine.num_running == 1)
        queued = submit_job(client, job_params(seed=1))
        client.store.delete(queued.id)  # the row is gone; the engine's abort is not sent (the race's window)
        await asyncio.to_thread(wait_until, lambda: cancelled == [1] and client.engine.num_running == 0)
        await client.shutdown(1)

    run(main())


def test_health_says_what_the_backend_reports_wrong_while_idle(tmp_path):
    """A multi-rank backend whose peer died while no request ran: /health said healthy until a request
    failed on it; the backend's `problem()` is asked too."""

    async def main():
        client = make_client(tmp_path)
        await client.start()
        assert client.health() == (True, None)
        client.engine.backend.problem = lambda: (
            "--ulysses-degree 2 peer (rank 1, pid 7) exited: exit code -9 (SIGKILL)"
        )
        assert client.health() == (
            False,
            "--ulysses-degree 2 peer (rank 1, pid 7) exited: exit code -9 (SIGKILL)",
        )
        # and a new job is refused (503) rather than accepted for work nothing can do before a restart
        with pytest.raises(ShuttingDownError, match="exited: exit code -9"):
            await client.create_job(job_params(), job_spec(job_params()), EncodeOptions(), None)
        await client.shutdown(1)

    run(main())


def test_a_job_deleted_while_its_mp4_is_made_is_counted_cancelled(tmp_path):
    """The engine hands a decoded job to the encode pool, where an abort no longer reaches it: a DELETE then
    left it counted nowhere (success + failed + cancelled fell short of the jobs)."""
    encoding, release = threading.Event(), threading.Event()

    def slow_encoder(*args, **kwargs):
        encoding.set()
        release.wait(10)
        return stub_encoder(*args, **kwargs)

    async def main():
        client = make_client(tmp_path, encoder=slow_encoder)
        counted = []
        client.engine.observer.on_cancelled = lambda: counted.append("cancelled")
        client.engine.observer.on_finished = lambda *a: counted.append("finished")
        await client.start()
        job = submit_job(client, job_params(steps=1))
        await asyncio.to_thread(encoding.wait, 10)
        assert client.delete(job.id) is not None
        release.set()
        await asyncio.to_thread(wait_until, lambda: counted == ["cancelled"])
        assert client.store.get(job.id) is None and not client.store.video_path(job.id).exists()
        await client.shutdown(1)

    run(main())


def test_a_decode_running_at_the_shutdown_deadline_stops_and_its_job_is_queued_again(tmp_path, caplog):
    """The shutdown's deadline stops a decode in progress at its next chunk, and its job is queued again for
    the next start (the deadline had only stopped the loop at a step boundary, so a long decode, ~45 s for a
    720p one on a CPU, kept the process up past --shutdown-timeout); its waiter gets the 503 at the deadline.
    The log counts it once, in its decode (it was counted in its steps too)."""
    from worldserve.engine.jobs import JobStore

    chunk = threading.Event()
    backend = FakeBackend(chunk_gate=chunk)  # frame 0, then 3 chunks, each held until `chunk` is set
    stopping = "stopping 0 request(s) in their steps and 1 in their decode"

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        job = submit_job(client, job_params(steps=1, frames=49))
        waiter = asyncio.create_task(client.wait(job.id))
        await asyncio.to_thread(wait_until, lambda: backend.decoded_chunks >= 1)
        client.begin_shutdown(0.2)
        try:
            with pytest.raises(ShuttingDownError):  # at the deadline, while the second chunk is still held
                await asyncio.wait_for(waiter, 10)  # (a hang guard, not a speed bound)
            await asyncio.to_thread(wait_until, lambda: stopping in caplog.text)  # the deadline's stop...
        finally:
            chunk.set()  # ...then the chunk in progress ends, and the decode stops at the next one
        await client.shutdown(0.2)
        return job

    with caplog.at_level(logging.WARNING, logger="worldserve.engine.engine"):
        job = run(main())
    assert caplog.text.count(stopping) == 1, caplog.text
    assert backend.decoded_chunks < 4 and not backend.live
    assert JobStore(tmp_path).get(job.id).status is JobStatus.QUEUED


def test_a_step_hung_past_the_shutdown_deadline_is_abandoned_and_its_job_queued_again(tmp_path, monkeypatch):
    """A step that never ends (a multi-GPU pipeline's peer rank hung: SIGSTOP, a stuck GPU) held the shutdown
    for the collectives' timeout, minutes after SIGTERM and --shutdown-timeout; now STEP_STOP_GRACE_S past the
    deadline the engine calls the backend's abandon_step (ParallelPipeline kills its peers, which fails the
    stuck exchange with BackendLost), and the job is queued again for the next start."""
    from worldserve.engine import engine_shutdown
    from worldserve.engine.jobs import JobStore
    from worldserve.engine.outputs import BackendLost

    monkeypatch.setattr(engine_shutdown, "STEP_STOP_GRACE_S", 0.2)
    hung, abandoned = threading.Event(), threading.Event()

    class HangingBackend(FakeBackend):
        def denoise(self, states):
            hung.set()
            if not abandoned.wait(30):  # (a hang guard: the stop below asserts that it came well before)
                raise AssertionError("the step was never abandoned")
            raise BackendLost("the peer ranks were killed at the shutdown (a step had hung)")

        def abandon_step(self):
            abandoned.set()

    backend = HangingBackend()

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        job = submit_job(client, job_params(steps=3))
        await asyncio.to_thread(hung.wait, 10)
        await asyncio.wait_for(client.shutdown(0.1), 15)
        return job

    job = run(main())
    assert abandoned.is_set()
    assert JobStore(tmp_path).get(job.id).status is JobStatus.QUEUED
    # the abandoned step's BackendLost is the shutdown's: not counted against the job (three restarts during
    # long steps had failed it as a poison job)
    import sqlite3

    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        assert db.execute("SELECT interrupted FROM jobs WHERE id=?", (job.id,)).fetchone()[0] == 0


def test_a_restart_without_enable_lora_refuses_the_queued_jobs_own_adapters(tmp_path):
    """Jobs queued on an --enable-lora server ran their own adapters after a restart without it (the paths
    are read from the server's disk: the operator's choice); now they fail with the 400 a new request gets,
    naming `lora`. A job whose adapter is the restarted server's --lora-path runs."""
    from worldserve.api.lora_field import PER_REQUEST_OFF, LoraSettings
    from worldserve.params import LoraRequest

    static = LoraRequest("house", "/adapters/house", 1.0)

    async def first_life():
        client = make_client(tmp_path, backend=FakeBackend(step_delay=0.05))
        await client.start()
        blocker = submit_job(client, job_params(steps=100))
        own = submit_job(client, job_params(lora=LoraRequest("mine", "/adapters/mine", 0.5)))
        house = submit_job(client, job_params(lora=static))
        await asyncio.to_thread(wait_until, lambda: client.get(blocker.id).progress > 0)
        client.engine.stop(0)
        client.store.close()
        return own, house

    own, house = run(first_life())

    async def second_life():
        client = make_client(tmp_path)
        client.restored_check = LoraSettings(per_request=False, static=static).check_restored
        await client.start()
        results = await asyncio.wait_for(asyncio.gather(client.wait(own.id), client.wait(house.id)), 10)
        await client.shutdown(5)
        return results

    refused, ran = run(second_life())
    assert (refused.status, refused.error_code) == (JobStatus.FAILED, 400)
    assert f"(lora): {PER_REQUEST_OFF}" in refused.error_message
    assert ran.status is JobStatus.COMPLETED


def test_a_stream_whose_prompt_was_written_is_queued_without_a_second_admission():
    """admitted_upsampling holds the request's queue slot while the Reasoner writes its prompt; the written
    request then queues without being admitted again: a shutdown begun meanwhile had refused it with
    ShuttingDownError, counted nowhere (the engine now ends it, counted, as the requests the stop ends)."""
    from worldserve.engine.client import ShuttingDownError
    from worldserve.engine.ephemeral import JoblessRequests
    from worldserve.engine.observer import NullObserver

    class Engine:
        observer = NullObserver()
        queued: list = []

        def add_requests(self, requests) -> None:
            self.queued.extend(requests)

    checks: list[int] = []

    def check_admission(count: int, what: str) -> None:
        checks.append(count)
        if len(checks) > 1:  # (the shutdown began while the prompt was written)
            raise ShuttingDownError("the server is shutting down")

    async def write_prompt(params) -> str:
        return '{"caption": "a written prompt"}'

    async def main():
        jobless = JoblessRequests(Engine(), check_admission, write_prompt)
        return await jobless.stream_upsampled(job_params(), "rt-1", lambda result: None, 5.0)

    prompt, request, _ = run(main())
    assert checks == [1] and Engine.queued == [request] and request.params.prompt == prompt

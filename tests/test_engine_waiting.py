"""Where the engine's jobs wait when something goes wrong or moves them: the queue bound's count
(EngineClient.num_waiting) is exact at every moment, and a backend that loses a peer rank (BackendLost,
multi-GPU layouts) while preparing a request or mid-step stops the engine as a crash with every job it held
queued in the store before the crash is reported (none stays `in_progress` in a process that will never run
it), still counted as waiting."""

from __future__ import annotations

import asyncio
import time

from serving_helpers import job_params, make_client, submit_job, wait_until

from worldserve.engine.client import JobStatus, ShuttingDownError
from worldserve.engine.fake_backend import FakeBackend
from worldserve.engine.outputs import BackendLost


class LosesPeerAtPrepare(FakeBackend):
    def prepare(self, request_id, params):
        if "lost" in params.prompt.split():
            raise BackendLost("the peer ranks are gone")
        return super().prepare(request_id, params)


def _submit(client, prompt: str, *, upsample: bool = False):
    return submit_job(client, job_params(prompt, steps=50, upsample_prompt=upsample))


def test_an_upsampled_job_entering_the_engine_queue_counts_once(tmp_path):
    async def main():
        client = make_client(tmp_path, backend=FakeBackend(step_delay=0.2), max_batch_size=1)
        await client.start()
        _submit(client, "busy")  # holds the only batch slot: the upsampled job stays queued
        await asyncio.to_thread(wait_until, lambda: client.engine.num_running == 1)

        async def written(params):  # the Reasoner's answer, at once
            return "a written prompt"

        client.upsampled_prompt = written
        counts, add = [], client.engine.add_request
        loop = asyncio.get_running_loop()

        def add_and_look(request):  # what a create handled next on the loop would count
            add(request)
            loop.call_soon(lambda: counts.append(client.num_waiting))

        client.engine.add_request = add_and_look
        _submit(client, "a fox", upsample=True)
        await asyncio.to_thread(wait_until, lambda: counts)
        await client.shutdown(0.1)
        return counts

    assert asyncio.run(main()) == [1]


def test_a_peer_lost_during_prepare_queues_its_job_again(tmp_path):
    async def main():
        client = make_client(tmp_path, backend=LosesPeerAtPrepare(step_delay=0.01), max_batch_size=3)
        await client.start()
        running = _submit(client, "a")
        await asyncio.to_thread(wait_until, lambda: client.engine.num_running == 1)
        lost, behind = _submit(client, "lost"), _submit(client, "b")  # admitted together at the next step
        await asyncio.to_thread(wait_until, lambda: not client.engine.alive)
        statuses = [client.get(j.id).status for j in (running, lost, behind)]
        health, waiting = client.health(), client.num_waiting
        await client.shutdown(1)
        return client.engine.crashed, statuses, health, waiting

    crashed, statuses, health, waiting = asyncio.run(main())
    assert isinstance(crashed, BackendLost), repr(crashed)
    assert health == (False, "engine crashed: the peer ranks are gone")
    assert statuses == [JobStatus.QUEUED] * 3  # they resume at the next start
    assert waiting == 2  # the two never prepared are back in the engine's queue


def test_clients_hear_of_a_lost_peer_without_its_cause(tmp_path):
    """/health (open without the API key) and a waiting sync request get the lost backend's public message; its
    cause (a transport error naming internal addresses, source paths, pids) stays in the log and in `str(exc)`
    (was: both answered the cause word for word)."""
    cause = "parallel peer (rank 1, pid 4242) is gone: [/pytorch/gloo/pair.cc:534] Connection closed by 10.0.0.7:29500"

    class Lost(FakeBackend):
        def denoise(self, states):
            raise BackendLost(f"--cfg-parallel-size 2: lost: {cause}", "--cfg-parallel-size 2: lost")

    async def main():
        client = make_client(tmp_path, backend=Lost(step_delay=0.01))
        await client.start()
        job = _submit(client, "a")
        try:
            await client.wait(job.id)
        except ShuttingDownError as exc:
            answer = str(exc)
        health = client.health()
        await client.shutdown(1)
        return answer, health, str(client.engine.crashed)

    answer, health, logged = asyncio.run(main())
    assert health == (False, "engine crashed: --cfg-parallel-size 2: lost")
    assert answer == "the engine has stopped (--cfg-parallel-size 2: lost)"
    assert cause in logged


class LosesPeerMidStep(FakeBackend):
    """BackendLost from a denoise step once `lose` is set; releasing a request takes 0.3 s (a peer exchange)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.lose = False

    def denoise(self, states):
        if self.lose:
            raise BackendLost("the peer ranks are gone")
        super().denoise(states)

    def release(self, state):
        if self.lose:
            time.sleep(0.3)
        super().release(state)


def test_a_crash_is_reported_once_the_running_jobs_are_queued_again(tmp_path):
    """Whoever sees the engine stopped (health, alive) finds its running job queued already (was: reported
    before the job was parked, which a loaded machine showed as a job still in_progress)."""

    async def main():
        backend = LosesPeerMidStep(step_delay=0.01)
        client = make_client(tmp_path, backend=backend)
        await client.start()
        job = _submit(client, "a")
        await asyncio.to_thread(wait_until, lambda: client.store.get(job.id).progress >= 2)
        backend.lose = True
        await asyncio.to_thread(wait_until, lambda: not client.engine.alive)
        status = client.store.get(job.id).status
        await client.shutdown(1)
        return status

    assert asyncio.run(main()) is JobStatus.QUEUED


class SlowPrepare(FakeBackend):
    def prepare(self, request_id, params):
        time.sleep(0.5)
        return super().prepare(request_id, params)


def test_a_job_being_prepared_counts_as_running(tmp_path):
    """From its admission a job counts as running (the /metrics gauge, and with the waiting count the queue
    bound): while the backend prepares it, it is in exactly one of the two counts."""

    async def main():
        client = make_client(tmp_path, backend=SlowPrepare(step_delay=0.01))
        await client.start()
        _submit(client, "slow")
        seen = set()
        for _ in range(60):
            seen.add((client.num_waiting, client.num_running))
            await asyncio.sleep(0.01)
        await client.shutdown(5)
        return seen

    seen = asyncio.run(main())
    assert (0, 1) in seen and seen <= {(1, 0), (0, 1), (1, 1)}, seen


def test_a_request_without_a_job_hears_why_the_engine_stopped(tmp_path):
    """A jobless request (an image, the offline Engine's) running when the backend is lost is ended with the
    crash's public reason (it said only "cancelled (the engine has stopped)": the caller read it as its own
    cancellation)."""
    from worldserve.engine.refusals import CancelledRequest

    class Lost(FakeBackend):
        def denoise(self, states):
            raise BackendLost("--cfg-parallel-size 2: lost: rank 1 gone", "--cfg-parallel-size 2: lost")

    async def main():
        client = make_client(tmp_path, backend=Lost(step_delay=0.01))
        await client.start()
        try:
            await client.jobless.generate([job_params("a", steps=5)], prefix="img", timeout_s=30)
        except CancelledRequest as exc:
            return str(exc)
        finally:
            await client.shutdown(1)

    assert "the engine has stopped: --cfg-parallel-size 2: lost" in asyncio.run(main())

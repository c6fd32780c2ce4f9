"""A failed batched denoising step fails only the request that fails alone (engine/batch.py), on the FakeBackend:
step_batch itself (which members count as stepped, which step again alone, what the failed call's memory
becomes), then the engine and the HTTP routes with the reviewer's four requests of one shape, one of them
`__fail__:denoise` joining a request already at 25 %. Steps are let through one by one (no clock)."""

from __future__ import annotations

import asyncio
import threading
import weakref

import pytest
from serving_helpers import SMALL_FORM, asgi_server, job_params, make_client, poll_job, submit_job, wait_until

from worldserve.engine.batch import step_batch
from worldserve.engine.client import JobStatus
from worldserve.engine.fake_backend import FAIL_MARKER, FakeBackend, FakeBackendError
from worldserve.engine.outputs import BackendLost
from worldserve.engine.request import Request

BAD = f"bad {FAIL_MARKER}denoise"
PROMPTS = ("good a", "good b", BAD, "good c")


class Metered(FakeBackend):
    """A FakeBackend whose denoise calls run only as the test lets them through (`let`, `open`); `entered`
    counts the calls begun (waiting included), `calls` the prompts of each call let through, failed or not."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = 0
        self.calls: list[list[str]] = []
        self._allowed = 0
        self._cv = threading.Condition()

    def let(self, calls: int) -> None:
        with self._cv:
            self._allowed += calls
            self._cv.notify_all()

    def open(self) -> None:
        self.let(10**9)

    def denoise(self, states):
        with self._cv:
            self.entered += 1
            self._cv.wait_for(lambda: self._allowed > 0)
            self._allowed -= 1
        self.calls.append([s.params.prompt.removeprefix("good ") for s in states])
        super().denoise(states)


def requests(backend: FakeBackend, prompts) -> list[Request]:
    """Prepared requests of one shape, as the engine holds them."""
    out = []
    for i, prompt in enumerate(prompts):
        params = job_params(prompt, steps=4)
        out.append(
            Request(job_id=f"r{i}", params=params, arrival_time=0.0, state=backend.prepare(f"r{i}", params))
        )
    return out


def test_the_common_path_is_one_call():
    class Counting(FakeBackend):
        freed = 0

        def free_cached_memory(self):
            self.freed += 1

    backend = Counting()
    batch = requests(backend, ["a", "b", "c"])
    outcome = step_batch(backend, batch, threading.Lock())
    assert backend.batch_sizes == [3] and backend.freed == 0 and not outcome.failed
    assert [r for r, _ in outcome.stepped] == batch and [size for _, size in outcome.calls] == [3]
    assert [r.steps_done for r in batch] == [1, 1, 1]


def test_members_step_alone_after_the_batch_fails_and_only_the_bad_one_fails():
    """The FakeBackend fails a batch holding a `__fail__:denoise` prompt before it advances any state."""
    backend = FakeBackend()
    batch = requests(backend, ["a", BAD, "c"])
    outcome = step_batch(backend, batch, threading.Lock())
    assert backend.batch_sizes == [1, 1], "the failed batch of 3, then a and c alone (the bad one fails)"
    assert [(r.job_id, str(exc)) for r, exc in outcome.failed] == [("r1", "injected failure at denoise")]
    assert [r.job_id for r, _ in outcome.stepped] == ["r0", "r2"] and [size for _, size in outcome.calls] == [
        1,
        1,
    ]
    assert [r.steps_done for r in batch] == [1, 0, 1]


def test_a_member_advanced_before_the_failure_is_not_stepped_again():
    """As VideoPipeline.apply_step: one batched forward, then each state stepped in order; the bad one raises
    after the members before it were advanced. Those count as stepped (once); the ones after step alone."""

    class InOrder(FakeBackend):
        def denoise(self, states):
            self.batch_sizes.append(len(states))
            for state in states:
                if BAD in state.params.prompt:
                    raise FakeBackendError("injected failure at combine")
                state.step_index += 1

    backend = InOrder()
    batch = requests(backend, ["a", BAD, "c"])
    outcome = step_batch(backend, batch, threading.Lock())
    assert backend.batch_sizes == [3, 1, 1], "a is not stepped again; the bad one and c alone"
    assert [r.steps_done for r in batch] == [1, 0, 1]
    assert [r.job_id for r, _ in outcome.failed] == ["r1"] and [r.job_id for r, _ in outcome.stepped] == [
        "r0",
        "r2",
    ]


def test_a_failure_after_every_member_advanced_fails_them_all():
    """The call's own error (say, a device sync after every update): no one member's, none stepped again."""

    class FailsAfter(FakeBackend):
        def denoise(self, states):
            super().denoise(states)
            raise RuntimeError("device-side assert triggered")

    backend = FailsAfter()
    batch = requests(backend, ["a", "b"])
    outcome = step_batch(backend, batch, threading.Lock())
    assert backend.batch_sizes == [2] and not outcome.stepped and not outcome.calls
    assert [(r.job_id, str(exc)) for r, exc in outcome.failed] == [("r0", "device-side assert triggered"),
                                                                   ("r1", "device-side assert triggered")]  # fmt: skip


def test_out_of_memory_in_a_batch_frees_its_activations_before_each_steps_alone():
    """Out of memory for the batch, not for one request alone: every member steps alone, after the failed
    call's frames let their locals go (its activations) and the backend freed its cached memory."""

    class Activations:
        pass

    class BatchTooLarge(FakeBackend):
        def __init__(self):
            super().__init__()
            self.freed = 0
            self.held: list[weakref.ref] = []
            self.seen_at_retry: list[tuple[int, bool]] = []

        def free_cached_memory(self):
            self.freed += 1

        def denoise(self, states):
            if len(states) > 1:
                activations = Activations()
                self.held.append(weakref.ref(activations))
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            self.seen_at_retry.append((self.freed, self.held[0]() is not None))
            super().denoise(states)

    backend = BatchTooLarge()
    batch = requests(backend, ["a", "b", "c"])
    outcome = step_batch(backend, batch, threading.Lock())
    assert not outcome.failed and [r for r, _ in outcome.stepped] == batch
    assert backend.seen_at_retry == [(1, False)] * 3, "freed once, the activations gone, before the retries"
    assert outcome.too_large, "every member fine alone: the batch's size failed"


def test_a_lost_backend_during_the_retries_stops_the_engine():
    class LostOnRetry(FakeBackend):
        def denoise(self, states):
            if len(states) > 1:
                raise RuntimeError("CUDA out of memory")
            raise BackendLost("peer rank 1 died")

    backend = LostOnRetry()
    with pytest.raises(BackendLost):
        step_batch(backend, requests(backend, ["a", "b"]), threading.Lock())


def test_the_engine_fails_only_the_request_that_fails_alone(tmp_path):
    """The reviewer's case: "good a" at 25 % alone, then b, the bad one and c join its batch; the batched step
    fails; a, b and c step alone, then batch again and complete; the bad one fails with its own error."""
    backend = Metered()

    async def main():
        client = make_client(tmp_path, backend=backend, max_batch_size=4)
        await client.start()
        first = submit_job(client, job_params("good a", steps=8))
        backend.let(2)
        await asyncio.to_thread(wait_until, lambda: backend.entered == 3)  # (its third step waits)
        progress = client.get(first.id).progress
        jobs = [first, *(submit_job(client, job_params(p, steps=8)) for p in PROMPTS[1:])]
        await asyncio.to_thread(wait_until, lambda: client.engine.num_waiting == 3)
        backend.open()
        results = await asyncio.wait_for(asyncio.gather(*(client.wait(j.id) for j in jobs)), 20)
        await client.shutdown(5)
        return progress, results

    progress, (a, b, bad, c) = asyncio.run(main())
    assert progress == 25
    assert (
        backend.calls
        == [["a"]] * 3
        + [["a", "b", BAD, "c"], ["a"], ["b"], [BAD], ["c"]]
        + [["a", "b", "c"]] * 4
        + [["b", "c"]] * 3
    ), "the failed batch, each alone, then together again"
    assert [r.status for r in (a, b, c)] == [JobStatus.COMPLETED] * 3 and a.progress == 100
    assert bad.status is JobStatus.FAILED and bad.error_code == 500
    assert bad.error_message == "Video generation failed: injected failure at denoise"
    assert not backend.live


@pytest.mark.anyio
async def test_sync_and_async_requests_batched_with_a_failing_one_still_complete(tmp_path):
    backend = Metered()
    form = {**SMALL_FORM, "num_inference_steps": "8"}
    async with asgi_server(tmp_path, backend=backend, max_batch_size=4) as http:
        first = (await http.post("/v1/videos", data={"prompt": "good a", **form})).json()
        backend.let(2)
        await asyncio.to_thread(wait_until, lambda: backend.entered == 3)
        assert (await http.get(f"/v1/videos/{first['id']}")).json()["progress"] == 25
        sync = [
            asyncio.create_task(http.post("/v1/videos/sync", data={"prompt": p, **form}))
            for p in ("good b", BAD)
        ]
        last = (await http.post("/v1/videos", data={"prompt": "good c", **form})).json()
        engine = http.engine_client.engine  # type: ignore[attr-defined]
        await asyncio.to_thread(wait_until, lambda: engine.num_waiting == 3)
        backend.open()
        good, bad = await asyncio.gather(*sync)
        jobs = [await poll_job(http, job["id"]) for job in (first, last)]
    assert good.status_code == 200 and good.content.startswith(b"FAKEMP4")
    assert bad.status_code == 500
    assert bad.json()["error"]["message"] == "Video generation failed: injected failure at denoise"
    assert [job["status"] for job in jobs] == ["completed", "completed"]
    assert any(sorted(call) == ["a", "b", BAD, "c"] for call in backend.calls), (
        "the bad one batched with a, b, c"
    )


def test_a_shape_whose_batch_fails_as_a_batch_steps_in_smaller_batches(tmp_path):
    """Out of memory at a batch of 4 but not at 2 (each member fine alone): after the failed call and the
    singles, that shape steps in batches of 2, not paying the failed batch of 4 again every step; a batch that
    failed because of a member (the `__fail__` one failed alone too) changes no cap."""
    sizes: list[int] = []

    class FitsTwo(FakeBackend):
        def denoise(self, states):
            sizes.append(len(states))
            if len(states) > 2:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            super().denoise(states)

    backend = FitsTwo(step_delay=0.05)

    async def main():
        client = make_client(tmp_path, backend=backend, max_batch_size=4)
        await client.start()
        jobs = [submit_job(client, job_params(f"good {i}", steps=3)) for i in range(4)]
        results = await asyncio.wait_for(asyncio.gather(*(client.wait(j.id) for j in jobs)), 30)
        caps = dict(client.engine._sched.caps)
        await client.shutdown(5)
        return results, caps

    results, caps = asyncio.run(main())
    assert [r.status for r in results] == [JobStatus.COMPLETED] * 4
    # (the four are usually admitted together; however they joined, the first batch over 2 fails once)
    failed = next(i for i, n in enumerate(sizes) if n > 2)
    after = sizes[failed + 1 + sizes[failed] :]
    assert sizes[failed + 1 : failed + 1 + sizes[failed]] == [1] * sizes[failed], sizes
    assert list(caps.values()) == [sizes[failed] // 2] and after and max(after) <= 2, sizes

    backend = FakeBackend()
    outcome = step_batch(backend, requests(backend, ["a", BAD, "b"]), threading.Lock())
    assert len(outcome.failed) == 1 and not outcome.too_large

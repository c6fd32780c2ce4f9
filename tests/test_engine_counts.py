"""The engine's running / waiting counts (the gauges /metrics and admission read) while requests admitted
together are prepared one after another: each is counted once."""

from __future__ import annotations

import asyncio
import threading

from serving_helpers import job_params, make_client, submit_job, wait_until

from worldserve.engine.fake_backend import FakeBackend


class SlowPrepare(FakeBackend):
    """Its prepare (the prompt's prefill) of a request with seed > 0 waits for `gate`, after telling
    `entered`."""

    def __init__(self) -> None:
        super().__init__(step_delay=0.02)
        self.gate, self.entered = threading.Event(), threading.Event()

    def prepare(self, request_id, params):
        if params.seed > 0:
            self.entered.set()
            self.gate.wait(10)
        return super().prepare(request_id, params)


def test_requests_admitted_together_are_counted_running_not_also_waiting(tmp_path):
    """Two same-shape jobs queued behind a running one join it at one step boundary: while the first of the
    two is prepared, all three count as running and none as waiting (the second had counted as both)."""
    backend = SlowPrepare()

    async def main():
        client = make_client(tmp_path, backend=backend, max_batch_size=3)
        await client.start()
        first = submit_job(client, job_params(steps=20, seed=0))
        await asyncio.to_thread(wait_until, lambda: client.engine.num_running == 1)
        late = [submit_job(client, job_params(steps=2, seed=s)) for s in (1, 2)]
        await asyncio.to_thread(backend.entered.wait, 10)
        counts = (client.engine.num_running, client.engine.num_waiting)
        backend.gate.set()
        await asyncio.wait_for(asyncio.gather(*(client.wait(j.id) for j in [first, *late])), 20)
        await client.shutdown(5)
        return counts

    assert asyncio.run(main()) == (3, 0)
